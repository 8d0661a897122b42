"""The one decision path, serving heads (no HTTP): which heads answer which model name, hot reload, the
scoring engine, micro-batchers, vector caches and metrics, configured by :class:`clm.serving.config.ServingConfig`.

clm-serve is its HTTP shell (routes, one protocol per dialect, settings, CLI, playground): it builds a
``ServingConfig`` from its settings and answers every dialect through :class:`clm.serving.service.ServeRuntime`.

* ``config`` — ``ServingConfig``: every knob the serving path reads, typed, with documented defaults;
* ``names`` — the names a request may give, resolved in one place (``ServedNames``, ``resolve_model``);
* ``registry`` — the served heads by name (``HeadsSource`` per name, one ``HeadsManager`` each);
* ``published`` — where heads are found (a file, a folder's or a bucket's ``latest``);
* ``reloader`` — ``HeadsManager``: load, check, swap, without dropping a request;
* ``loaded_heads`` — ``LoadedHeads``: one checked heads version, ready to score;
* ``engine`` — ``DecisionEngine``: texts to option probabilities (encode, project, score);
* ``batcher`` / ``action_cache`` — the projection micro-batcher; option vectors and projections cached;
* ``metrics`` — ``ServeMetrics`` (Prometheus, one registry per runtime);
* ``service`` — ``ServeRuntime``: start-up, readiness, encoder identity, shutdown.

The questions it scores are ``clm.contract.questions.Question``; the answers each dialect returns are built by
``clm.contract.answers``.
"""
