"""What a loaded model keeps between forwards, for every adapter and decode over it.

Adapters hold a family's facts and decodes hold their own state (model_adapters.base:
`Adapter.start`, `DecodeSetup`); what depends only on the model (the suppressed ids'
bias: decoding's masked_block) and the memos of its latest batched forward (the rows'
stacked prefix: runtime.stacked_prefix; their kept keys and values:
attention.bidirectional_cache, each checked against the rows it was made for) live here,
keyed by the model. Not its compiled backbone calls: mx.compile keeps the arrays a traced
call captures (the weights) as constants, so a trace kept with the model would outlive a
change of its weights in place (a training step, a fuse) and decode with the old ones;
they stay with the adapter (runtime.batched._compiled; tests/decoding/test_batch_ops.py).

Per thread (runtime.thread_compiled's tables): two threads decoding over one model each
keep their own memos. A model's caches go with it (`weakref.finalize`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from model_adapters.runtime.thread_compiled import ThreadTables

_lock = threading.Lock()
_by_model: dict[int, ThreadTables] = {}  # id(model) -> its caches, while the model lives


def model_cache(model: Any) -> dict:
    """The calling thread's caches for `model` (a dict, made on first use)."""
    key = id(model)
    with _lock:
        tables = _by_model.get(key)
        if tables is None:
            tables = _by_model[key] = ThreadTables()
            weakref.finalize(model, _by_model.pop, key, None)
    return tables.table()


__all__ = ["model_cache"]
