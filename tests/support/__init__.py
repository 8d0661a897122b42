"""Helpers shared by the test suites (on the path through pytest's ``pythonpath``; no ``sys.path`` edits).

* ``support.serve``: clm-serve in-process, checkpoints as the trainer publishes them, vLLM's error shape.
* ``support.trainer``: the trainer stack (API + workers as processes), job data, waiting on job events.
* ``support.faults``: restartable Redis/embedder/clm-serve processes and fault helpers for tests/faults.
"""
