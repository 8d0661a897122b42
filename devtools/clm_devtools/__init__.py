"""Dev tools of the CLM stack: start real local processes for tests, ``make demo`` and the benchmarks.

* ``clm_devtools.procs``: free ports, a process stopped by PID (its whole group),
  readiness waits (``wait_until``, ``wait_http``), a private ``redis-server``.
* ``clm_devtools.devstack``: the three services launched through their console
  scripts, as an operator starts them.
* ``clm_devtools.vllm_server``: a vLLM pooling server from ``.venv-vllm``.
* ``clm_devtools.compose``: a private Docker daemon and the compose stack on it
  (``make test-compose``).
* ``clm_devtools.tiny_qwen3``: the tiny test encoder (a Qwen3 built from a fixed
  seed; ``make setup`` and the vllm-cpu image run it).
* ``clm_devtools.synthetic`` / ``synthetic_families``: the SOC-triage record
  generator of the examples, benchmarks and tests.

Not part of the core (``clm``): no service and no user command needs them, so
the service images do not install this distribution, and nothing under
``shared/`` or ``services/`` imports it (``tests/unit/test_devtools_boundary.py``).
"""
