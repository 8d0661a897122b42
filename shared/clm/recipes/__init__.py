"""The heads training recipe (``clm train``), split by concern.

* ``config`` / ``overrides``: the YAML recipe config and ``--a.b value`` overrides.
* ``embed_phase`` / ``embedding`` / ``shards``: the embed-once table cache, sharded over torchrun ranks
  (the encoder itself is ``encoder.spec()``: ``clm.encoders.spec``, as the services build theirs).
* ``batches`` / ``objectives`` / ``loop`` / ``evaluation``: scoring, losses, epochs, metrics.
* ``report`` / ``results``: what a run writes and returns.
* ``train_clm_heads``: ``TrainCLMHeadsRecipe``, which ties them together; ``submit``: the jobs API client.
"""
