"""Evaluation of decision heads: scoring, metrics, baselines, intervals, seen vs unseen, comparisons.

* ``scoring``: heads -> ``ScoredQuestion``s, per split (no gradients).
* ``metrics``: the one scored-question type and the decision metrics of a set of them.
* ``bootstrap``: paired bootstrap intervals of a metric difference.
* ``baselines``: what a person would try before heads, from the same embedding table.
* ``generalisation``: questions training did / did not contain.
* ``comparison``: the above composed (``worth_it_sections`` for a run's report,
  ``compare_heads`` for ``clm eval --compare``).

Components only: nothing here imports ``clm.recipes`` (the recipe composes
them; ``tests/unit/test_component_boundary.py``). Submodules are imported
explicitly, so ``import clm.evaluation`` stays cheap.
"""
