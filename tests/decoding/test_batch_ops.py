"""A batched step's cost per row (issue 15, batched serving throughput): the rows' plain
steps build their stacked inputs on the host (fused_commit, model_adapters.runtime.batched.
token_matrix) and record their kept log-probs in one gather for all rows
(fused_commit.SharedRecord), so an added row adds few MLX operations to a step; each row
still gets the tokens, forwards and log-probs of its decode alone."""

import collections
import io
import re
import traceback
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_diffusion.decoding.batch import RunningBatch
from mlx_lm_diffusion.decoding.decoders import fused_commit
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from model_adapters import adapter_for
from model_adapters.runtime.batched import token_matrix
from model_adapters.runtime.thread_compiled import ThreadTables

# six prompts of different lengths: several rows of each kind share a record
PROMPTS = [
    [72, 101, 108],
    [5, 17, 99, 200, 31, 7, 64],
    [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44],
    [9, 8, 7, 6, 5],
    [100, 101, 102, 103, 104, 105, 106, 107, 108],
    [61, 62],
]
MAX_TOKENS = (16, 12, 10, 16, 14, 12)
FIELDS = {"sdar": {}, "llada": {"block_length": 8}}


def kept_of(steps, prompt_len):
    """{position: (token, its kept log-probs (V,))} of every final token, read as the
    server reads them (at the step whose block holds it); and (tokens, forwards)."""
    kept, last = {}, None
    for step in steps:
        last = step
        start, end = step.block
        for q in range(max(prompt_len, start), min(end, prompt_len + int(step.final[0]))):
            token = int(step.canvas[0, q])
            kept[q] = (token, np.array(step.logprobs(0, q)))
        if step.done[0]:
            break
    return kept, (last.canvas[0, prompt_len : prompt_len + last.final[0]].tolist(), last.forwards)


def batched_steps(adapter, options):
    """Each row's Steps in one running batch (unpipelined: each step's own arrays)."""
    batch, steps, ids = RunningBatch(adapter, keep_logprobs=True), collections.defaultdict(list), {}
    for i, (prompt, o) in enumerate(zip(PROMPTS, options)):
        ids[batch.add(prompt, o).id] = i
    for _ in range(1000):  # (bounded: every row's decode is)
        for event in batch.step():
            # (the row's traceback: a CI run once failed here with an IndexError seen nowhere else)
            assert event.error is None, "".join(traceback.format_exception(event.error))
            if event.step is not None:
                steps[ids[event.row.id]].append(event.step)
        if not len(batch):
            break
    return [steps[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_shared_records_give_each_row_its_own_log_probs(request, family, monkeypatch):
    """SDAR's threshold rule (commit counts known only from the commits, and known where one
    mask is left) and LLaDA's quota (counts known beforehand): the rows' kept log-probs come
    from shared records, and every row's tokens, forwards and log-prob vectors are those of
    its decode alone."""
    model, tok = request.getfixturevalue(family)
    adapter = adapter_for(model, tok)
    built = []
    real = fused_commit.SharedRecord._build
    monkeypatch.setattr(fused_commit.SharedRecord, "_build", lambda self: built.append(len(self.rows)) or real(self))
    options = [
        resolve(DecodeOptions(max_tokens=n, **FIELDS[family]), adapter, len(p)) for p, n in zip(PROMPTS, MAX_TOKENS)
    ]
    got = batched_steps(adapter, options)
    assert built and max(built) >= 3  # (records were shared, by three rows or more)
    for prompt, o, steps in zip(PROMPTS, options, got):
        alone = kept_of(Engine(adapter, o, keep_logprobs=True).run(mx.array([prompt])), len(prompt))
        together = kept_of(steps, len(prompt))
        assert together[1] == alone[1]  # tokens and forwards
        assert together[0].keys() == alone[0].keys() and together[0]
        for q, (token, vector) in alone[0].items():
            assert together[0][q][0] == token
            # (the padded batched forward reduces in another order: ~1e-6 relative)
            np.testing.assert_allclose(together[0][q][1], vector, atol=1e-5, rtol=1e-5)


def test_a_shared_record_view_reads_its_own_row():
    """A view of a record stacked over rows reads its row only (index, vectors, dense)."""
    from mlx_lm_diffusion.decoding.decoders.kept_logprobs import KeptLogprobs, KeptRows

    positions = mx.array([[0, 2], [1, 0], [3, 1]], dtype=mx.int32)
    valid = mx.array([[True, False], [True, True], [False, False]])
    logprobs = mx.array(np.arange(3 * 2 * 5, dtype=np.float32).reshape(3, 2, 5))
    view = KeptRows(positions, valid, logprobs, row_offset=1, rows=1)
    assert view.index() == {(0, 1): 0, (0, 0): 1}
    kept = KeptLogprobs(1, 4, 5).add(view)
    assert np.array(kept.row(0, 0)).tolist() == np.array(logprobs[1, 1]).tolist()
    assert kept.values(0, range(2), np.array([3, 4])) == [float(logprobs[1, 1, 3]), float(logprobs[1, 0, 4])]
    dense = np.array(kept.dense())
    assert dense.shape == (1, 4, 5)
    assert dense[0, 1].tolist() == np.array(logprobs[1, 0]).tolist() and not dense[0, 2:].any()


def test_token_matrix_builds_the_same_rows_on_the_host_and_on_the_device():
    canvases = [np.array([[4, 5, 6, 7, 8]], dtype=np.int32), np.array([[9, 10, 11]], dtype=np.int32)]
    spans = [(1, 4, 0, 2), (0, 3, 2, 0)]  # (lo, hi, left, right)
    expected = [[5, 6, 7, 0, 0], [0, 0, 9, 10, 11]]
    for hosts in ((True, True), (False, False), (True, False)):
        requests = [SimpleNamespace(canvas=mx.array(c), host=c if h else None) for c, h in zip(canvases, hosts)]
        matrix = token_matrix([(r, *span) for r, span in zip(requests, spans)])
        assert matrix.dtype == mx.int32 and matrix.tolist() == expected, hosts


_NODE = re.compile(r'\[label ="[^"]+", shape=rectangle\]')


def ops_per_step(adapter, fields: dict, rows: int, steps=range(2, 5)) -> float:
    """The MLX operations a step of `rows` rows evaluates, mean over `steps` (unpipelined:
    each step's graph is evaluated within it; evaluated arrays are no longer in a graph)."""
    counted = [0]
    real_eval = mx.eval

    def counting(*arrays):
        dot = io.StringIO()
        mx.export_to_dot(dot, *arrays)
        counted[0] += len(_NODE.findall(dot.getvalue()))
        return real_eval(*arrays)

    batch = RunningBatch(adapter, keep_logprobs=True, pipeline=False)
    for prompt in (PROMPTS * 2)[:rows]:
        batch.add(prompt, resolve(DecodeOptions(max_tokens=32, **fields), adapter, len(prompt)))
    per_step = []
    for i in range(max(steps) + 1):
        counted[0] = 0
        mx.eval = counting
        try:
            batch.step()
        finally:
            mx.eval = real_eval
        assert len(batch) == rows  # (no row finished: every counted step has them all)
        per_step.append(counted[0])
    return sum(per_step[i] for i in steps) / len(steps)


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_an_added_row_adds_few_operations(request, family, monkeypatch):
    """An 8-row step evaluates fewer than 30 MLX operations more per row than a 2-row step
    (a 1-row step is a plain predict). Before the rows' stacked inputs were built on the
    host and their kept log-probs recorded together: 47 for SDAR, 52 for LLaDA against
    one row (bench/profile_batch_step.py). The rows' canvases share one call here (a
    second width group adds its own forward's operations, by design)."""
    from model_adapters.runtime import batched

    monkeypatch.setattr(batched, "CPU_WIDTH_SPREAD", 2.0)
    model, tok = request.getfixturevalue(family)
    adapter = adapter_for(model, tok)
    two, eight = ops_per_step(adapter, FIELDS[family], 2), ops_per_step(adapter, FIELDS[family], 8)
    assert 0 < (eight - two) / 6 < 30, (two, eight)


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_the_compiled_batched_forward_gives_the_plain_one(request, family, monkeypatch):
    """The batched block-causal window (SDAR) and full-canvas (LLaDA) forwards through
    mx.compile (COMPILE_WINDOWS) and without: the same kept log-probs, bit for bit, and the
    same tokens and forwards per row."""
    from model_adapters.runtime import batched

    model, tok = request.getfixturevalue(family)
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(batched, "COMPILE_WINDOWS", compiled)
        adapter = adapter_for(model, tok)
        options = [
            resolve(DecodeOptions(max_tokens=n, **FIELDS[family]), adapter, len(p)) for p, n in zip(PROMPTS, MAX_TOKENS)
        ]
        steps = batched_steps(adapter, options)
        results.append([kept_of(row, len(p)) for row, p in zip(steps, PROMPTS)])
    for (kept_c, tokens_c), (kept_p, tokens_p) in zip(*results):
        assert tokens_c == tokens_p and kept_c.keys() == kept_p.keys()
        for q in kept_p:
            assert kept_c[q][0] == kept_p[q][0] and (kept_c[q][1] == kept_p[q][1]).all()


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_a_compiled_forward_keeps_at_most_max_traces_shapes(request, family, monkeypatch):
    """Past MAX_TRACES distinct input shapes a compiled backbone call is made afresh (its
    traces freed with it), and the rows' tokens and forwards stay those of the plain forward."""
    from model_adapters.runtime import batched

    model, tok = request.getfixturevalue(family)

    def decode(compiled: bool, adapter):
        monkeypatch.setattr(batched, "COMPILE_WINDOWS", compiled)
        options = [
            resolve(DecodeOptions(max_tokens=n, **FIELDS[family]), adapter, len(p)) for p, n in zip(PROMPTS, MAX_TOKENS)
        ]
        return [kept_of(row, len(p))[1] for row, p in zip(batched_steps(adapter, options), PROMPTS)]

    made = []
    compile_ = mx.compile
    monkeypatch.setattr(batched.mx, "compile", lambda f: made.append(f) or compile_(f))
    monkeypatch.setattr(batched, "MAX_TRACES", 2)
    adapter = adapter_for(model, tok)
    got = decode(True, adapter)
    table = adapter._compiled_backbones.table()  # (this thread's: thread_compiled)
    assert table and all(len(shapes) <= 2 for _, shapes in table.values())
    assert len(made) > len(table)  # (some call met a third shape: made afresh)
    assert got == decode(False, adapter_for(model, tok))


def test_new_weights_are_decoded_with_after_a_compiled_forward(tmp_path, monkeypatch):
    """mx.compile keeps the arrays a traced function captures (the model's weights) as
    constants: a compiled backbone call kept past a change of the weights in place (a
    training step, a fuse, model.update) would decode with the old ones. Its owner is the
    adapter, made for each request or a server's lifetime; an adapter made after the
    change decodes with the new weights, compiled or not."""
    from mlx.utils import tree_map

    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.testing.checkpoints import write_llada
    from model_adapters.runtime import batched

    model, tok = mld.load(str(write_llada(tmp_path)))  # (its own model: its weights change here)

    def decode(compiled: bool):
        monkeypatch.setattr(batched, "COMPILE_WINDOWS", compiled)
        adapter = adapter_for(model, tok)
        options = [
            resolve(DecodeOptions(max_tokens=n, block_length=8), adapter, len(p)) for p, n in zip(PROMPTS, MAX_TOKENS)
        ]
        return [kept_of(row, len(p))[1] for row, p in zip(batched_steps(adapter, options), PROMPTS)]

    before = decode(True)
    model.update(tree_map(lambda w: -w if w.dtype == mx.float32 else w, model.parameters()))
    after = decode(True)
    assert after == decode(False) and after != before


def confidences_of(steps) -> list:
    """Each Step's block confidence, on the host (the values the commits wrote)."""
    return [np.array(step.block_confidence) for step in steps if step.block_confidence is not None]


@pytest.mark.parametrize(
    "family, fields",
    [
        ("sdar", {}),  # low_confidence_dynamic: threshold, else the step's quota
        ("sdar", {"threshold": 0.2}),
        ("llada", {"block_length": 8}),  # low_confidence: the quota
        ("llada", {"block_length": 8, "steps": 3}),  # quotas that differ between rows' steps
        ("llada", {"block_length": 8, "strategy": "threshold", "threshold": 0.3}),
        ("llada", {"block_length": 8, "strategy": "entropy_bound"}),  # reads the entropy
    ],
)
def test_the_compiled_fused_commit_gives_the_plain_one(request, family, fields, monkeypatch):
    """The rows' fused commit through mx.compile (COMPILE_COMMITS) and op by op: the same
    tokens, forwards, kept log-probs and confidences per row, bit for bit; and the compiled
    function did commit the steps (it answers a group whose rows share one rule and quota)."""
    model, tok = request.getfixturevalue(family)
    compiled_calls = []
    real = fused_commit._compiled_commit
    monkeypatch.setattr(
        fused_commit,
        "_compiled_commit",
        lambda *a: (lambda out: compiled_calls.append(out is not None) or out)(real(*a)),
    )
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(fused_commit, "COMPILE_COMMITS", compiled)
        adapter = adapter_for(model, tok)
        options = [
            resolve(DecodeOptions(max_tokens=n, **{**FIELDS[family], **fields}), adapter, len(p))
            for p, n in zip(PROMPTS, MAX_TOKENS)
        ]
        steps = batched_steps(adapter, options)
        results.append([(kept_of(row, len(p)), confidences_of(row)) for row, p in zip(steps, PROMPTS)])
    assert sum(compiled_calls) >= 5  # (the compiled function committed steps)
    for ((kept_c, tokens_c), conf_c), ((kept_p, tokens_p), conf_p) in zip(*results):
        assert tokens_c == tokens_p and kept_c.keys() == kept_p.keys() and kept_p
        for q in kept_p:
            assert kept_c[q][0] == kept_p[q][0] and (kept_c[q][1] == kept_p[q][1]).all()
        assert len(conf_c) == len(conf_p) and all((a == b).all() for a, b in zip(conf_c, conf_p))


def test_a_compiled_commit_answers_only_groups_that_share_one_rule_and_quota():
    """Rows whose rules or quotas at their steps differ, or whose biases differ, are committed
    op by op (None: the compiled commit does not take the group)."""
    from mlx_lm_diffusion.decoding.commit_rules import EntropyBounded, LowConfidence, Quota, Threshold

    def plan(rule, quota=None, bias=None, takes_all=False):
        state = None if quota is None else Quota(mx.array([[quota]]), np.array([[quota]]))
        return fused_commit.RowCommit(
            rule,
            state,
            0,
            4,
            np.array([2]),
            np.ones((1, 4), bool),
            np.zeros((1, 4), np.int32),
            None,
            mx.zeros((1, 4)),
            takes_all,
            bias,
        )

    logits = mx.zeros((2, 4, 8))
    take = fused_commit._compiled_commit
    assert take([plan(LowConfidence(), 1), plan(LowConfidence(), 1)], logits, False) is not None
    assert take([plan(LowConfidence(), 1), plan(LowConfidence(), 2)], logits, False) is None
    assert take([plan(LowConfidence(), 1), plan(LowConfidence(), 2, takes_all=True)], logits, False) is not None
    assert take([plan(LowConfidence(), 1), plan(Threshold(), None)], logits, False) is None
    assert take([plan(Threshold()), plan(Threshold(), bias=mx.zeros((8,)))], logits, False) is None
    # (its per-row count goes to topk_transfer as an array, range-checked on the host)
    assert take([plan(EntropyBounded()), plan(EntropyBounded())], logits, False) is None


def test_how_rows_are_selected_together_is_each_rules_own_declaration():
    """The fused commit reads a rule's batching from the rule (CommitRule.joint / compiled,
    issue 52.3): rows of a joint rule are selected in one call, others row by row; a subclass
    that declares nothing selects row by row (it does not inherit its parent's), and one that
    declares "stateless" joins the single call. The settings lists come from the rules too."""
    from dataclasses import dataclass
    from typing import ClassVar, Optional

    from mlx_lm_diffusion.decoding import generation_defaults
    from mlx_lm_diffusion.decoding.commit_rules import (
        IMPLIED_RULES,
        RULE_SETTINGS,
        RULES,
        Factor,
        LowConfidence,
        Quota,
        RandomRemasking,
        Threshold,
    )
    from mlx_lm_diffusion.serving import openai_requests

    @dataclass
    class Undeclared(Threshold):
        pass

    @dataclass
    class Declared(Threshold):
        joint: ClassVar[Optional[str]] = "stateless"

    def select_calls(rule_type, rows=3, **fields):
        calls = []

        class Counting(rule_type):
            def select(self, s, state):
                calls.append(s.candidates.shape[0])
                return super().select(s, state)

        Counting.joint, Counting.compiled = rule_type.joint, rule_type.compiled  # (the traits under test)
        state = Quota(mx.array([[1]]), np.array([[1]])) if issubclass(rule_type, LowConfidence) else None
        plans = [
            SimpleNamespace(
                rule=Counting(**fields), rule_state=state, step=0, steps=4, masked=np.array([4]), takes_all=False
            )
            for _ in range(rows)
        ]
        probs = mx.softmax(mx.random.normal((rows, 4, 8)), axis=-1)
        x0, prob = mx.argmax(probs, axis=-1), mx.max(probs, axis=-1)
        fused_commit._select(plans, x0, prob, mx.log(probs), mx.ones((rows, 4), dtype=mx.bool_))
        return calls

    assert select_calls(Threshold, threshold=0.5) == [3] and select_calls(Factor) == [3]
    assert select_calls(LowConfidence) == [3]
    assert select_calls(RandomRemasking) == [1, 1, 1]  # (its draws are each row's own)
    assert Undeclared.joint is None and not Undeclared.compiled and select_calls(Undeclared) == [1, 1, 1]
    assert select_calls(Declared) == [3] and not Declared.compiled
    # what a setting selects and which fields name a rule: from the rules' declarations
    assert RULE_SETTINGS == ("threshold", "factor", "entropy_bound", "alg_temp")
    assert (
        IMPLIED_RULES
        == {r.selected_by: n for n, r in RULES.items() if r.selected_by}
        == {"threshold": "threshold", "factor": "factor", "entropy_bound": "entropy_bound"}
    )
    assert set(openai_requests._RULE_FIELDS) == {"strategy", "schedule", *IMPLIED_RULES}
    assert generation_defaults.RULE_OPTIONS == {"strategy", "schedule", *RULE_SETTINGS}


def test_a_compiled_commit_keeps_at_most_max_commit_traces_shapes(request, monkeypatch):
    """Past MAX_COMMIT_TRACES input shapes (rows joining and leaving change the row count) a
    compiled commit is made afresh, and the rows' tokens and forwards stay the op-by-op ones."""
    model, tok = request.getfixturevalue("sdar")
    monkeypatch.setattr(fused_commit, "_commit_functions", ThreadTables())
    made = []  # (one _pure_commit per compiled commit function made)
    pure = fused_commit._pure_commit
    monkeypatch.setattr(fused_commit, "_pure_commit", lambda *a: made.append(a) or pure(*a))
    monkeypatch.setattr(fused_commit, "MAX_COMMIT_TRACES", 2)
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(fused_commit, "COMPILE_COMMITS", compiled)
        adapter = adapter_for(model, tok)
        options = [resolve(DecodeOptions(max_tokens=n), adapter, len(p)) for p, n in zip(PROMPTS, MAX_TOKENS)]
        results.append([kept_of(row, len(p))[1] for row, p in zip(batched_steps(adapter, options), PROMPTS)])
    assert results[0] == results[1]
    table = fused_commit._commit_functions.table()  # (this thread's: thread_compiled)
    assert all(len(shapes) <= 2 for _, shapes in table.values())
    assert len(made) > len(table)  # (some function met a third shape: made afresh)
