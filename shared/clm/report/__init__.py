"""The run report: assembled from a run's facts and scores (``assembly``), read as tables for the terminal
(``tables``) and rendered as a page (``html``, with the per-epoch ``curves``), every number through
``numbers``; a finished run is also written to TensorBoard and, optionally, MLflow (``tracking``).

Submodules are imported explicitly, so ``import clm.report`` stays cheap
(``clm train`` imports only ``tables`` once a run is over).
"""
