"""Export vLLM's structured-decisions contract as JSON, for clm-serve's compatibility tests.

Run ONCE with the vLLM environment (never from the project's own .venv, which
must not depend on vLLM), and commit the output::

    .venv-vllm/bin/python scripts/export_vllm_schemas.py            # writes tests/serve/data/
    .venv-vllm/bin/python scripts/export_vllm_schemas.py --check    # exit 1 if the files are stale

It writes:

* ``structured_decision_response.schema.json``: JSON schema of vLLM's
  ``StructuredDecisionResponse``; every clm-serve answer is validated against it.
* ``error_response.schema.json``: JSON schema of vLLM's ``ErrorResponse``.
* ``structured_decision_request.schema.json``: JSON schema of vLLM's
  ``StructuredDecisionRequest`` (clm-serve's request model must have the same fields).
* ``vllm_answers.json``: answers built by vLLM's own question types from fixed
  probabilities, so the tests compare clm-serve's answers to vLLM's field by
  field and value by value, not only by shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "serve" / "data"

# (question id, type, criteria, probabilities over the options, label_mass)
ANSWER_CASES = [
    ("disposition", "choice", {"benign": "expected activity", "malicious": None, "unknown": "no idea"},
     [0.2, 0.7, 0.1], 1.0),
    ("escalate", "noul", {"true": "needs a human", "false": "auto-close"}, [0.35, 0.65], 1.0),
    ("escalate_plain", "noul", None, [0.9, 0.1], 1.0),
    ("severity", "score", ["none", "low", "medium", "high", "critical"], [0.05, 0.1, 0.2, 0.4, 0.25], 1.0),
    ("tie", "choice", {"a": None, "b": None}, [0.5, 0.5], 1.0),
]


def build_exports() -> dict[str, object]:
    import vllm
    from vllm.entrypoints.generate.structured_decisions.protocol import (
        StructuredDecisionRequest,
        StructuredDecisionResponse,
    )
    from vllm.entrypoints.generate.structured_decisions.question_types import build_question
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    answers = []
    for qid, type_name, criteria, probs, label_mass in ANSWER_CASES:
        question = build_question(qid, type_name, "", criteria, max_options=26)
        answers.append({
            "qid": qid, "type": type_name, "criteria": criteria, "probs": probs, "label_mass": label_mass,
            "answer": question.type.answer(question, probs, label_mass),
        })
    source = f"vllm {vllm.__version__}, vllm.entrypoints.generate.structured_decisions"
    return {
        "structured_decision_response.schema.json": {"$comment": source,
                                                     **StructuredDecisionResponse.model_json_schema()},
        "error_response.schema.json": {"$comment": source, **ErrorResponse.model_json_schema()},
        "structured_decision_request.schema.json": {"$comment": source,
                                                    **StructuredDecisionRequest.model_json_schema()},
        "vllm_answers.json": {"$comment": source, "cases": answers},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the committed files; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, content in build_exports().items():
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"stale or missing: {', '.join(stale)}; rerun without --check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
