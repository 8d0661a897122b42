"""The heads training recipe (``clm train``), split by concern.

* ``config`` / ``overrides``: the YAML recipe config and ``--a.b value`` overrides.
* ``encoder_setup`` / ``embedding``: the frozen encoder and the embed-once table cache.
* ``batches`` / ``objectives`` / ``loop`` / ``evaluation``: scoring, losses, epochs, metrics.
* ``report`` / ``results``: what a run writes and returns.
* ``train_clm_heads``: ``TrainCLMHeadsRecipe``, which ties them together; ``submit``: the jobs API client.
"""
