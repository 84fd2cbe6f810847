"""mlx-lm's batches, with validation batches in a fixed order.

mlx-lm's `iterate_batches` shuffles its batches with numpy's global generator every time
it is called, so a validation of fewer batches than the set holds (--val-batches) scored
a different subset at every report. Here an evaluation pass (loop=False) draws its order
from a fixed seed and then puts numpy's global state back, so the training batches'
order is what mlx-lm's would have been.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from mlx_lm.tuner.trainer import iterate_batches as mlx_lm_iterate_batches

VALIDATION_ORDER_SEED = 0


def iterate_batches(
    dataset: Any, batch_size: int, max_seq_length: int, loop: bool = False, seed: Any = None, comm_group: Any = None
) -> Iterator:
    """mlx_lm.tuner.trainer.iterate_batches; one pass (loop=False) in a fixed order."""
    batches = mlx_lm_iterate_batches(dataset, batch_size, max_seq_length, loop=loop, seed=seed, comm_group=comm_group)
    if loop or seed is not None:
        yield from batches
        return
    saved = np.random.get_state()
    np.random.seed(VALIDATION_ORDER_SEED)
    try:  # the order is drawn before the first batch is made
        first = next(batches, None)
    finally:
        np.random.set_state(saved)
    if first is not None:
        yield first
        yield from batches
