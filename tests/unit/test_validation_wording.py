"""One wording of a pydantic refusal (``clm.errors.format_validation_error``): every config, policy and file
the core validates says ``key.path: message`` the same way, and a new hand-written copy fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from clm.errors import format_validation_error, validation_problems

ROOT = Path(__file__).resolve().parents[2]
# Modules that read pydantic's problems for another vocabulary than a config's: the records' own field words,
# and the HTTP dialects' validation bodies (vLLM's message and param, FastAPI's 422 detail list).
OTHER_VOCABULARIES = {
    "shared/clm/errors.py",
    "shared/clm/records/loader.py",
    "services/common/clm_http/errors.py",
    "services/serve/clm_serve/http/decisions.py",
    "services/serve/clm_serve/http/typesafe.py",
}


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: float = Field(ge=0, le=1)

    @field_validator("share")
    @classmethod
    def not_half(cls, value: float) -> float:
        if value == 0.5:
            raise ValueError("half is refused")
        return value


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inner: Inner
    name: str = "x"


@dataclass(config=ConfigDict(extra="forbid"))
class Loss:
    margin: float = 0.1


def refusal(data: dict) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        Outer.model_validate(data)
    return caught.value


def test_each_problem_is_its_key_path_and_the_validators_own_words():
    error = refusal({"inner": {"share": 0.5}, "colour": 1})
    assert format_validation_error(error) == (
        "inner.share: half is refused\ncolour: Extra inputs are not permitted")


def test_the_options_prefix_join_and_show_the_input():
    error = refusal({"inner": {"share": 2}})
    text = format_validation_error(error, prefix="config.", separator="; ", show_input=True)
    assert text == "config.inner.share: Input should be less than or equal to 1 (got 2)"


def test_a_whole_object_at_fault_is_named_by_root_and_skip_drops_a_tag():
    error = refusal({"inner": 3})
    assert format_validation_error(error, root="<policy>", skip=1) == (
        "<policy>: Input should be a valid dictionary or instance of Inner")
    assert validation_problems(error)[0][0] == "inner"


def test_a_dataclass_unknown_keyword_reads_as_every_models_unknown_key():
    with pytest.raises(ValidationError) as caught:
        Loss(margin=0.2, colour=1)  # type: ignore[call-arg]
    assert "colour: Extra inputs are not permitted" in format_validation_error(caught.value)


def test_no_module_words_a_pydantic_refusal_by_hand():
    copies = []
    for folder in ("shared", "services"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative in OTHER_VOCABULARIES or "/tests/" in relative:
                continue
            if re.search(r"\.errors\(\)", path.read_text(encoding="utf-8")):
                copies.append(relative)
    assert not copies, f"use clm.errors.format_validation_error / validation_problems instead: {copies}"
