"""Promotion of a candidate version (a pair of trained heads) over the live one, and watching it afterwards.

* ``config``: the gate's and the drift check's settings (``GateConfig``, ``Margins``, ``DriftConfig``).
* ``gate``: the offline promotion gate (``evaluate_gate`` -> ``GateVerdict``): non-inferiority per question id
  by a paired bootstrap over records with Holm's step-down, calibration, automated share, latency, and the
  list of answers that flip.
* ``report_html``: a verdict as a standalone HTML page (``render_gate_html``).
* ``sequential``: the canary's always-valid rollback tests (``CanaryMonitor`` on accuracy, ``AgreementMonitor``
  on agreement with the previous version), mixture SPRTs whose state is stored between processes.
* ``drift``: PSI of a version's outputs per question id and an MMD two-sample test of state embeddings.
* ``policy``: a model name's gate (``gate.json`` beside its versions: what it evaluates on, its criteria) and
  its stored verdicts.

A component: no HTTP, no ``clm.recipes``. Submodules are imported explicitly, so ``import clm.promotion``
stays cheap.
"""
