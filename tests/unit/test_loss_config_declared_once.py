"""Every loss hyper-parameter is declared once, by the decision component (issue #32: "each setting declared
once").

``clm.decision.config.DecisionLossConfig`` owns each knob's name, default, bounds and description; the recipe's
``loss:`` section (``clm.recipes.config.LossConfig``) *is* that class, adding only the recipe-only mode
``infonce``. Two checks, each shown able to fail:

* structural: the section declares nothing in its own body but ``mode``, and each of its other fields is the
  component's declaration (default, bounds, strictness, description);
* a source scan (AST): no class anywhere in the code declares a field named like a loss knob except the
  component's config, so a third copy (a service's request model, a bench's settings) is caught too.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Annotated, get_args

from clm_devtools.paths import REPO_ROOT
from pydantic import Field
from pydantic.dataclasses import dataclass

from clm.decision.config import DecisionLossConfig, Mode
from clm.recipes.config import LossConfig, RecipeConfig

CODE_ROOTS = ("shared/clm", "services", "bench", "scripts", "devtools")
OWNER = REPO_ROOT / "shared" / "clm" / "decision" / "config.py"
# ``mode`` is left out of the scan: many sections have a mode of their own (the recipe's eval|train); the
# structural check covers the loss section's.
KNOBS = {field.name for field in dataclasses.fields(DecisionLossConfig)} - {"mode"}


def redeclared(section: type) -> list[str]:
    """The loss fields ``section`` declares itself, or holds with another default, bound or description
    than the component's; only ``mode`` may be the section's own."""
    own = set(vars(section).get("__annotations__", {})) - {"mode"}
    ours, theirs = DecisionLossConfig.__pydantic_fields__, getattr(section, "__pydantic_fields__", {})
    differing = {name for name in ours if name != "mode" and repr(theirs.get(name)) != repr(ours[name])}
    return sorted(own | differing)


def test_the_recipe_loss_section_is_the_component_config():
    assert RecipeConfig.model_fields["loss"].annotation is LossConfig
    assert issubclass(LossConfig, DecisionLossConfig)
    assert [f.name for f in dataclasses.fields(LossConfig)] == [f.name for f in dataclasses.fields(DecisionLossConfig)]
    assert redeclared(LossConfig) == []
    # The recipe's modes are the component's and infonce, the component's not spelled out again.
    assert get_args(LossConfig.__pydantic_fields__["mode"].annotation) == (*get_args(Mode), "infonce")
    assert LossConfig().mode == DecisionLossConfig().mode == "sft"


def test_the_structural_check_catches_a_redeclared_knob():
    @dataclass(frozen=True)
    class Copied(DecisionLossConfig):
        kl_coef: float = 0.05  # the same default, but declared a second time (and without its bound)

    @dataclass(frozen=True)
    class Loosened(DecisionLossConfig):
        brier_weight: Annotated[float, Field(ge=-1.0)] = 1.0

    assert redeclared(Copied) == ["kl_coef"]
    assert redeclared(Loosened) == ["brier_weight"]


def second_declarations(path: Path, source: str) -> list[str]:
    """``path:line: name`` of each class-body field named like a loss knob (any class: a dataclass, a pydantic
    model, a TypedDict), unless ``path`` is the component's config."""
    if path == OWNER:
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                        and statement.target.id in KNOBS):
                    where = path.relative_to(REPO_ROOT) if path.is_absolute() else path
                    found.append(f"{where}:{statement.lineno}: {node.name}.{statement.target.id}")
    return found


def test_no_other_class_declares_a_loss_knob():
    sources = sorted(path for root in CODE_ROOTS for path in (REPO_ROOT / root).rglob("*.py"))
    assert OWNER in sources  # the scan looks where the component is
    found = [problem for path in sources for problem in second_declarations(path, path.read_text())]
    assert found == [], "declared outside clm.decision.config (subclass DecisionLossConfig instead):\n" + "\n".join(found)


def test_the_scan_catches_a_copied_knob_and_only_declarations():
    copy = '''
from pydantic import BaseModel, Field
class LossSection(BaseModel):
    mode: str = "sft"
    kl_coef: float = Field(0.05, ge=0.0)
def run(kl_coef: float = 0.05) -> dict:
    return {"label_smoothing": 0.1, "kl_coef": kl_coef}
'''
    assert second_declarations(Path("services/x.py"), copy) == ["services/x.py:5: LossSection.kl_coef"]
    assert second_declarations(OWNER, copy) == []
