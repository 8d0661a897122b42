"""Group texts into encoder batches bounded by a size budget and an item count.

Why a budget rather than a fixed count: the cost of a batch is its tokens, not
its texts. For a padded forward pass (transformers) a batch costs
``count x longest``, which is why the local backend sorts by length first: a
256-text batch of mixed lengths pads every row to the longest one and is
slower than 32 well-sorted ones. A vLLM server packs sequences without padding,
so there a batch costs the sum of its lengths.
"""

from __future__ import annotations

from typing import Sequence


def batch_by_budget(
    order: Sequence[int],
    lengths: Sequence[int],
    *,
    budget: int,
    max_items: int,
    padded: bool,
) -> list[list[int]]:
    """Split ``order`` (indices into ``lengths``) into consecutive batches.

    A batch closes before it would exceed ``max_items`` items or ``budget``
    (``items x longest`` when ``padded``, else ``sum of lengths``). An item
    larger than the budget on its own still gets a batch of one: the budget
    shapes batches, it never refuses input.
    """
    if budget < 1 or max_items < 1:
        raise ValueError(f"budget ({budget}) and max_items ({max_items}) must be positive")
    batches: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for index in order:
        length = max(1, lengths[index])
        new_longest, new_total = max(longest, length), total + length
        cost = (len(current) + 1) * new_longest if padded else new_total
        if current and (len(current) >= max_items or cost > budget):
            batches.append(current)
            current, new_longest, new_total = [], length, length
        current.append(index)
        longest, total = new_longest, new_total
    if current:
        batches.append(current)
    return batches
