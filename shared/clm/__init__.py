"""clm: the core package of the CLM decision-heads system.

Everything that is not HTTP lives here: SystemOne records, the text contract,
the embedding cache, the decision objectives, heads, checkpoints, metrics and
the training recipe. Services under ``services/`` are thin wrappers around it.
"""

__version__ = "0.1.0"

# The Python surface of upstream contrastive-lm 0.1.0, which installs this same top-level ``clm``:
# ``from clm import CLMClient, Engine, ...`` works as there. Lazy (module __getattr__), so ``import clm``
# stays cheap: the client pulls in httpx, the engine torch, only when first used.
_LAZY = {
    **dict.fromkeys(("CLMClient", "CLMError", "Noul", "Choice", "Score", "Question", "Answer", "NoulAnswer",
                     "ChoiceAnswer", "ScoreAnswer", "SystemOneResponse", "Usage"), "clm.client"),
    **dict.fromkeys(("Engine", "Embedder", "HeadPair"), "clm.engine"),
    **dict.fromkeys(("build_pairs", "candidates", "state_text", "answer_from_logits", "answer_from_probs"),
                    "clm.schema"),
}

__all__ = ["CLMClient", "CLMError", "Noul", "Choice", "Score", "Question", "Answer", "NoulAnswer", "ChoiceAnswer",
           "ScoreAnswer", "SystemOneResponse", "Usage", "Engine", "Embedder", "HeadPair",
           "build_pairs", "candidates", "state_text", "answer_from_logits", "answer_from_probs", "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'clm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
