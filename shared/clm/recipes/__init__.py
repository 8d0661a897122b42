"""The heads training recipe (``clm train``), split by concern.

* ``config`` / ``overrides``: the YAML recipe config and ``--a.b value`` overrides.
* ``data_phase``: where the records come from (files, or a window of the decision log) and their lineage.
* ``embed_phase`` / ``table_cache`` / ``shards``: every text embedded once into a cached table (the phase; the
  tables' keys, paths and lookup; the chunks each torchrun rank encodes). The encoder itself is
  ``encoder.spec()``: ``clm.encoders.spec``, as the services build theirs.
* ``objectives`` / ``loop`` / ``distributed``: the per-step losses, the epochs, the ranks.
* ``calibration_phase`` / ``publishing`` / ``drift_phase`` / ``promotion_phase``: what a train run does with its
  best heads (calibrate, publish with its drift reference, promote).
* ``progress`` / ``results`` / ``errors``: what a run tells its observer, returns, and can fail with.
* ``train_clm_heads``: ``TrainCLMHeadsRecipe``, which ties them together; ``submit``: the jobs API client.
"""
