"""clm: the core package of the CLM decision-heads system.

Everything that is not HTTP lives here: SystemOne records, the text contract,
the embedding cache, the decision objectives, heads, checkpoints, metrics and
the training recipe. Services under ``services/`` are thin wrappers around it.
"""

__version__ = "0.1.0"
