"""Compiled functions live and die on the thread that traced them (model_adapters.runtime.
thread_compiled). MLX may leave a compiled function's trace behind in the tracing thread's
cache when the function is released on another thread, and hand it to a later function at
the same address: a CI run failed with a fused commit that returned three outputs where
four were asked for (tests/decoding/test_batch_ops.py's entropy_bound case, an IndexError)."""

import gc
import random
import threading
import weakref

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.commit_rules import EntropyBound, Threshold
from mlx_lm_diffusion.decoding.decoders import fused_commit
from mlx_lm_diffusion.decoding.interpreter_exit import thread_streams
from model_adapters.runtime.thread_compiled import ThreadTables


def plan(rule, width=8):
    return fused_commit.RowCommit(
        rule,
        None,
        0,
        8,
        np.array([width]),
        np.ones((1, width), bool),
        np.zeros((1, width), np.int32),
        None,
        mx.zeros((1, width)),
        False,
        None,
    )


def outputs(rule, keep, rows=6, width=8, vocab=64):
    """How many arrays the compiled commit of `rows` rows answers (4 keeping log-probs, else 3)."""
    logits = mx.random.normal((rows, width, vocab))
    return len(fused_commit._compiled_commit([plan(rule, width) for _ in range(rows)], logits, keep))


def test_compiled_commits_made_on_other_threads_never_answer_for_this_ones():
    """Threads that compile commits beside the main thread, whose own table fills and is
    cleared, as a server's scheduler thread beside a test: every call answers its own arity.
    (Before the tables were per thread: wrong answers in 2 of 3 runs of 12 rounds, 3 of 3 of 24.)"""
    wrong = []

    def worker(seed):
        with thread_streams():
            draw = random.Random(seed)
            for _ in range(60):
                rule = Threshold(threshold=draw.choice([0.1, 0.3, 0.5, 0.9]))
                keep = draw.random() < 0.5
                if outputs(rule, keep, rows=draw.choice([1, 2, 6])) != (4 if keep else 3):
                    wrong.append((rule, keep))
                keep = draw.random() < 0.5
                if outputs(EntropyBound(bound=0.35), keep, rows=draw.choice([1, 2, 6])) != (4 if keep else 3):
                    wrong.append(("worker", keep))

    for round_ in range(24):
        threads = [threading.Thread(target=worker, args=(round_ * 10 + k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i in range(fused_commit.MAX_COMMIT_FUNCTIONS + 8):  # (fills this thread's table: it is cleared)
            outputs(Threshold(threshold=0.01 * (i + 1)), False, rows=3)
        for keep in (True, False, True):
            if outputs(EntropyBound(bound=0.35), keep) != (4 if keep else 3):
                wrong.append(("main", keep))
    assert not wrong, wrong[:5]


def test_a_table_dropped_on_another_thread_is_released_on_its_own():
    """An owner (an adapter, a decode's state) dropped on thread B while thread A, whose
    table it is, lives: A's table is handed back and released on A, when A next asks."""
    released_on = []
    ready, dropped, asked = threading.Event(), threading.Event(), threading.Event()

    class Traced:  # (stands for a compiled function: records the thread that releases it)
        pass

    def on_release():
        released_on.append(threading.get_ident())

    holder = {}

    def a():
        with thread_streams():
            tables = ThreadTables()
            item = Traced()
            weakref.finalize(item, on_release)
            tables.table()["f"] = item
            del item
            holder["tables"] = tables
            del tables
            ready.set()
            dropped.wait(timeout=60)
            ThreadTables().table()  # (any table asked for on this thread releases what came back)
            asked.set()

    thread = threading.Thread(target=a)
    thread.start()
    assert ready.wait(timeout=60)
    del holder["tables"]  # dropped here, on the main thread, while A lives
    gc.collect()
    assert released_on == []  # (not here)
    dropped.set()
    assert asked.wait(timeout=60)
    thread.join(timeout=60)
    assert released_on == [thread.ident]
