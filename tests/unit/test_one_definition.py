"""One decision path: every model name, answer shape, confidence and the noul vocabulary are defined once, in
``clm.contract`` (issue: "a second definition of a model name or of an answer builder fails a test").

The check reads the code (AST, docstrings and comments excluded), so a copy is caught whatever it is called:

* a model name (``clm-latest``, ``clm-raw``, ``jev-latest``) written as a string anywhere but
  ``clm/contract/names.py``;
* an answer object (a dict literal with ``type`` and ``probabilities``/``probability``/``noul``) built anywhere
  but ``clm/contract/answers.py``;
* a softmax, tempering, option-logit or confidence function defined anywhere but ``clm/contract/answers.py``;
* the noul options spelled out (``("no", "yes")``, ``("false", "true")``) anywhere but
  ``clm/contract/question_types.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from clm_devtools.paths import REPO_ROOT

from clm.contract.names import DEFAULT_ALIASES, DEFAULT_MODEL, RAW_MODEL

CODE_ROOTS = ("shared/clm", "services", "bench", "scripts", "devtools")
CONTRACT = REPO_ROOT / "shared" / "clm" / "contract"
MODEL_NAMES = {DEFAULT_MODEL, RAW_MODEL, *DEFAULT_ALIASES} - {"clm"}  # "clm" is also the package's name
ANSWER_KEYS = {"probabilities", "probability", "noul"}
NOUL_SPELLINGS = {("no", "yes"), ("yes", "no"), ("false", "true"), ("true", "false")}
MATHS = re.compile(r"^(softmax|tempered_logits|option_logits|[a-z_]*confidence)$")


def _sources() -> list[Path]:
    return sorted(path for root in CODE_ROOTS for path in (REPO_ROOT / root).rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    owners = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, owners) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def second_definitions(path: Path, source: str) -> list[str]:
    """What ``source`` (the file at ``path``) defines that only the contract may."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(REPO_ROOT) if path.is_absolute() else path}:{getattr(node, 'lineno', 0)}"
        if (isinstance(node, ast.Constant) and node.value in MODEL_NAMES and id(node) not in docstrings
                and path != CONTRACT / "names.py"):
            found.append(f"{where}: the model name {node.value!r} (use clm.contract.names)")
        if isinstance(node, ast.Dict) and path != CONTRACT / "answers.py":
            keys = {key.value for key in node.keys if isinstance(key, ast.Constant)}
            if "type" in keys and keys & ANSWER_KEYS:
                found.append(f"{where}: an answer object {sorted(keys)} (build it with clm.contract.answers)")
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and MATHS.match(node.name)
                and path != CONTRACT / "answers.py"):
            found.append(f"{where}: {node.name}() (clm.contract.answers has it)")
        if (isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == 2
                and all(isinstance(e, ast.Constant) for e in node.elts)
                and tuple(e.value for e in node.elts) in NOUL_SPELLINGS and path != CONTRACT / "question_types.py"):
            found.append(f"{where}: the noul options spelled out (clm.contract.question_types has them)")
    return sorted(found, key=lambda problem: int(problem.split(":")[1]))  # in line order


def test_the_contract_is_defined_once():
    found = [problem for path in _sources() for problem in second_definitions(path, path.read_text())]
    assert found == [], "\n".join(found)


def test_the_check_catches_each_kind_of_copy():
    """The check can fail: each kind of second definition, written in a module outside the contract."""
    copy = '''
"""A docstring may say clm-raw."""
RAW = "clm-raw"
def answer(p):
    return {"type": "noul", "noul": p}
def typesafe_confidence(probs):
    return max(probs)
OPTIONS = ("no", "yes")
'''
    problems = second_definitions(Path("services/serve/clm_serve/copy.py"), copy)
    assert [problem.split(": ", 1)[1].split(" (")[0] for problem in problems] == [
        "the model name 'clm-raw'", "an answer object ['noul', 'type']", "typesafe_confidence()",
        "the noul options spelled out"], problems
