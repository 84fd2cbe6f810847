"""Ragged batches (issue 15, part 1): rows of different prompt lengths, each with its own
stopping, max_tokens and seed, decode together with one forward per step, and each row
gives exactly the tokens and forward count of its decode alone (Engine.run)."""

import mlx.core as mx
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.batch import RunningBatch
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
from mlx_lm_diffusion.testing.engine_runs import record_batch_sizes
from model_adapters import adapter_for

PROMPTS = [[72, 101, 108], [5, 17, 99, 200, 31, 7, 64], [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44]]


def eos_after(history_len, eos):
    """EOS once the committed tokens (prompt included) number `history_len` (mlx-lm's
    processor call: the tokens so far, the next position's logits)."""

    def processor(tokens, logits):
        if tokens.size < history_len:
            return logits
        bias = mx.zeros(logits.shape)
        bias[:, eos] = 1e4
        return logits + bias

    return processor


def alone(adapter, prompt, options):
    """(final tokens, forwards) of one prompt decoded alone, as stream_generate reads them."""
    last = None
    for last in Engine(adapter, options).run(mx.array([prompt])):
        if last.done[0]:
            break
    return last.canvas[0, len(prompt) : len(prompt) + last.final[0]].tolist(), last.forwards


def batched(adapter, prompts, options, join_late=(), joins=None):
    """(final tokens, forwards) per row of one running batch; rows in `join_late` join
    after the batch's second step (or `joins`: {step: rows joining before it})."""
    if joins is None:
        joins = {0: [i for i in range(len(prompts)) if i not in join_late], 2: list(join_late)}
    batch, rows, results = RunningBatch(adapter), {}, {}
    for steps in range(10_000):  # (bounded: every row's decode is)
        for i in joins.get(steps, ()):
            rows[batch.add(prompts[i], options[i]).id] = i
        for event in batch.step():
            assert event.error is None, event.error
            if event.finished:
                step, i = event.row.last, rows[event.row.id]
                P = len(prompts[i])
                results[i] = (step.canvas[0, P : P + step.final[0]].tolist(), step.forwards)
        if not len(batch) and len(results) == len(prompts):
            break
    assert batch.forwards < sum(f for _, f in results.values()) or len(prompts) == 1
    return [results[i] for i in range(len(prompts))]


def check_ragged(model, tok, prompts=PROMPTS, max_tokens=(16, 16, 10), eos_row=0, eos_offset=2, join_late=(), **kw):
    """Row `eos_row` ends at an EOS early (None: no such row), the last row at its max_tokens."""
    adapter = adapter_for(model, tok)
    eos = min(adapter.eos_ids)
    options = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        row_kw = dict(kw)
        if i == eos_row:
            offset = eos_offset if eos_offset is not None else 3
            row_kw["logits_processors"] = [eos_after(len(prompt) + offset, eos)]
        if "seed" in kw:
            row_kw["seed"] = kw["seed"] + i
        options.append(resolve(DecodeOptions(max_tokens=n, **row_kw), adapter, len(prompt)))
    expected = [alone(adapter, p, o) for p, o in zip(prompts, options)]
    if eos_row is not None:
        assert expected[eos_row][0][-1] == eos and len(expected[eos_row][0]) < max_tokens[eos_row]
    assert len(expected[-1][0]) == max_tokens[-1]
    assert batched(adapter, prompts, options, join_late) == expected
    return expected


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return mld.load(str(write_causal(tmp_path_factory.mktemp("qwen3"), "qwen3")), autoregressive=True)


def test_llada(llada):
    check_ragged(*llada, block_length=8)


def test_llada_rows_join_late(llada):
    check_ragged(*llada, block_length=8, join_late=(2,))


def test_dream(dream):
    check_ragged(*dream, block_length=8)


def test_canvases_of_very_different_widths_go_to_separate_calls():
    """A full-canvas call pads every row to its widest: on a CPU the rows of one call are
    within 1.2x in width (every padded column costs its attention row), 1.5x given."""
    from model_adapters.runtime.batched import width_groups

    assert mx.default_device() == mx.cpu  # (the tests' device, as CI's)
    assert width_groups([100, 68, 80, 78]) == [[1, 3, 2], [0]]
    assert width_groups([100, 68, 80, 78], spread=1.5) == [[1, 3, 2, 0]]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_caches(llada, dream, cache):
    check_ragged(*llada, block_length=8, cache=cache)
    check_ragged(*dream, block_length=8, cache=cache)


def test_sdar(sdar):
    check_ragged(*sdar)
    check_ragged(*sdar, join_late=(1,), threshold=0.5)


def test_llada2(llada2):
    check_ragged(*llada2, max_tokens=(40, 40, 20), eos_offset=5)


def test_nemotron(nemotron):
    check_ragged(*nemotron, block_length=8)


def test_diffusion_gemma_seeded_rows(gemma):
    # (DiffusionGemma refuses logits processors, the test's way to place an EOS: its canvas
    # is final only as a whole; the rows stop at their own max_tokens)
    check_ragged(*gemma, seed=3, steps=4, eos_row=None)


def test_ar(causal):
    check_ragged(*causal, eos_offset=None)


def test_seeded_random_rows_do_not_depend_on_each_other(llada):
    """A row's random draws come from its own key: alone, in a batch, or next to other rows."""
    check_ragged(*llada, block_length=8, strategy="random", seed=11)


def check_mixed(model, tok, per_row, max_tokens=(16, 16, 10), **kw):
    """Rows that differ in the family's own options (`per_row`: one dict each) share one
    running batch, and each gives what it gives alone."""
    adapter = adapter_for(model, tok)
    options = [
        resolve(DecodeOptions(max_tokens=n, **kw, **extra), adapter, len(p))
        for p, n, extra in zip(PROMPTS, max_tokens, per_row)
    ]
    assert batched(adapter, PROMPTS, options) == [alone(adapter, p, o) for p, o in zip(PROMPTS, options)]


def test_rows_with_different_family_options_share_a_batch(llada, dream, nemotron, gemma, monkeypatch):
    """Issue 52.2: a row's family options live in its decode's state, not on the adapter,
    so rows of every cache mode, causal_context or self_spec, exact or top-k step share one
    batch; the adapter puts the rows that need another forward in calls of their own."""
    from model_adapters.attention import bidirectional_cache

    calls = {
        "canvas": record_batch_sizes(monkeypatch, bidirectional_cache, "bidirectional_batch"),
        "window": record_batch_sizes(monkeypatch, bidirectional_cache, "cached_window_batch"),
    }
    for model in (llada, dream):
        check_mixed(*model, [{}, {"cache": "prefix"}, {"cache": "dual"}], block_length=8)
        check_mixed(*model, [{"cache": "dual"}, {"cache": "prefix"}, {"cache": "dual"}], block_length=8)
        # dual rows with blocks of other widths: a narrow row's padding columns are written
        # past its canvas, not over the kept keys after its block (which it attends to)
        dual = {"cache": "dual"}
        check_mixed(*model, [{**dual, "block_length": 8}, {**dual, "block_length": 4}, {**dual, "block_length": 8}])
    assert max(calls["canvas"]) >= 2 and max(calls["window"]) >= 2, calls  # (shared calls, not one per row)
    check_mixed(*nemotron, [{"causal_context": False}, {}, {"self_spec": True}], block_length=8)
    check_mixed(
        *gemma,
        [{}, {"fast_self_conditioning": True}, {"fast_step": True}],
        max_tokens=(40, 24, 20),
        seed=3,
        steps=4,
        self_conditioning_k=8,
    )


def test_removed_row_frees_its_place(llada):
    model, tok = llada
    adapter = adapter_for(model, tok)
    batch = RunningBatch(adapter)
    rows = [batch.add(p, resolve(DecodeOptions(max_tokens=16, block_length=8), adapter, len(p))) for p in PROMPTS]
    batch.step()
    batch.remove(rows[1])
    assert batch.stats()["running_rows"] == 2
    while len(batch):
        batch.step()


@pytest.mark.parametrize("strategy", ["threshold", "entropy_bounded", "factor", "low_confidence_static"])
def test_plain_steps_are_committed_together(sdar, monkeypatch, strategy):
    """Rows with plain steps (greedy, no processors, no editing) are committed by the batch
    in one call per step (mlx_lm_diffusion.decoding.decoders.fused_commit) and still decode as alone; the
    EOS row (a logits processor) commits on its own beside them."""
    import mlx_lm_diffusion.decoding.batch as batch_module

    sizes, real = [], batch_module.commit_rows
    monkeypatch.setattr(batch_module, "commit_rows", lambda plans, *a: sizes.append(len(plans)) or real(plans, *a))
    check_ragged(*sdar, strategy=strategy)
    assert sizes and max(sizes) == 2  # the two plain rows, together


def test_fused_and_unfused_batches_agree(llada):
    """fuse_commits=False (every row commits on its own) gives what the fused batch gives."""
    model, tok = llada
    adapter = adapter_for(model, tok)
    options = [
        resolve(DecodeOptions(max_tokens=n, block_length=8), adapter, len(p)) for p, n in zip(PROMPTS, (16, 12, 10))
    ]
    results = []
    for fuse in (True, False):
        batch, out = RunningBatch(adapter, fuse_commits=fuse), {}
        rows = [batch.add(p, o) for p, o in zip(PROMPTS, options)]
        for _ in range(1000):
            for event in batch.step():
                if event.finished:
                    out[event.row.id] = (event.row.last.canvas.tolist(), event.row.last.forwards)
            if not len(batch):
                break
        results.append([out[row.id] for row in rows])
    assert results[0] == results[1]


class CountingModel:
    """The adapter's model, counting model calls (an mlx-lm model's own call, a backbone)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def backbone(self, *args, **kwargs):
        self.calls += 1
        return self.model.backbone(*args, **kwargs)


@pytest.mark.parametrize("family", ["nemotron", "causal"])
def test_rows_share_model_calls(request, family):
    """Nemotron's block passes (over each row's causal cache) and the ar adapter's
    next-token feeds run as one model call for all rows (model_adapters.runtime.batched)."""
    model, tok = request.getfixturevalue(family)
    adapter = adapter_for(model, tok)
    adapter.model = counting = CountingModel(model)
    options = [
        resolve(DecodeOptions(max_tokens=12, block_length=8 if family == "nemotron" else None), adapter, len(p))
        for p in PROMPTS
    ]
    expected = [alone(adapter, p, o) for p, o in zip(PROMPTS, options)]
    calls_alone, counting.calls = counting.calls, 0
    assert batched(adapter, PROMPTS, options) == expected
    assert counting.calls < calls_alone * 0.7, (counting.calls, calls_alone)


def _drive(batch, prompts, options, keeps=None):
    """{row index: (canvas, forwards, kept log-probs of its final tokens or None)}."""
    rows = {
        batch.add(p, o, keep_logprobs=None if keeps is None else keeps[i]).id: i
        for i, (p, o) in enumerate(zip(prompts, options))
    }
    out = {}
    for _ in range(1000):  # (bounded: each row's decode is)
        for event in batch.step():
            assert event.error is None, event.error
            step, i = event.row.last, rows[event.row.id]
            if step is not None and step.block_logprobs is not None:
                P = len(prompts[i])
                out.setdefault(("logprobs", i), {}).update(
                    {
                        q: step.logprobs(0, q)[int(step.canvas[0, q])].item()
                        for q in range(max(P, step.block[0]), min(step.block[1], P + int(step.final[0])))
                    }
                )
            if event.finished:
                out[i] = (step.canvas.tolist(), step.forwards)
        if not len(batch):
            break
    return out


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_pipelined_and_unpipelined_batches_agree(request, family):
    """pipeline=True (step() returns with its forward in flight, read back at the next
    call) gives the steps, tokens, forwards and log-probs of pipeline=False; rows
    removed while a step is in flight leave the others as they were."""
    model, tok = request.getfixturevalue(family)
    adapter = adapter_for(model, tok)
    block = {} if family == "sdar" else {"block_length": 8}
    options = [resolve(DecodeOptions(max_tokens=n, **block), adapter, len(p)) for p, n in zip(PROMPTS, (16, 12, 10))]
    runs = [
        _drive(RunningBatch(adapter, keep_logprobs=True, pipeline=pipe), PROMPTS, options) for pipe in (True, False)
    ]
    assert runs[0] == runs[1]
    for i, (p, o) in enumerate(zip(PROMPTS, options)):  # each row as alone
        tokens, forwards = alone(adapter, p, o)
        canvas, row_forwards = runs[0][i]
        assert canvas[0][len(p) : len(p) + len(tokens)] == tokens and row_forwards == forwards
    batch = RunningBatch(adapter, pipeline=True)
    rows = [batch.add(p, o) for p, o in zip(PROMPTS, options)]
    batch.step()
    batch.step()  # (a step in flight now)
    batch.remove(rows[1])
    finished = {}
    while len(batch):
        for event in batch.step():
            if event.finished:
                finished[event.row.id] = event.row.last
    for row, i in ((rows[0], 0), (rows[2], 2)):
        tokens, forwards = alone(adapter, PROMPTS[i], options[i])
        P = len(PROMPTS[i])
        assert finished[row.id].canvas[0, P : P + len(tokens)].tolist() == tokens


def test_rows_keep_log_probs_or_not(sdar):
    """keep_logprobs per row: rows that keep them get the log-probs a batch of such rows
    gets, rows that do not get none, and every row's tokens and forwards are the same."""
    model, tok = sdar
    adapter = adapter_for(model, tok)
    options = [resolve(DecodeOptions(max_tokens=n), adapter, len(p)) for p, n in zip(PROMPTS, (16, 12, 10))]
    kept = _drive(RunningBatch(adapter, keep_logprobs=True), PROMPTS, options)
    mixed = _drive(RunningBatch(adapter), PROMPTS, options, keeps=[True, False, True])
    assert [mixed[i] for i in range(3)] == [kept[i] for i in range(3)]
    assert ("logprobs", 1) not in mixed
    for i in (0, 2):
        assert mixed[("logprobs", i)].keys() == kept[("logprobs", i)].keys() and mixed[("logprobs", i)]
        assert all(abs(mixed[("logprobs", i)][q] - v) < 1e-5 for q, v in kept[("logprobs", i)].items())


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_cache_rows_share_a_forward(llada, dream, cache, monkeypatch):
    """Fast-dLLM's kept keys and values differ per row and block, yet rows share forwards:
    those at their block's first step one full-canvas call (each keeping its own keys and
    values), those at a later step one window call; and each row still gives what it gives
    alone (canvases of different widths: padded keys masked; rows joining late: some rows
    open a block while others are inside one)."""
    from model_adapters.attention import bidirectional_cache

    calls = {
        "open": record_batch_sizes(monkeypatch, bidirectional_cache, "bidirectional_batch"),
        "window": record_batch_sizes(monkeypatch, bidirectional_cache, "cached_window_batch"),
    }
    for model in (llada, dream):
        for kind in calls.values():
            kind.clear()
        check_ragged(*model, block_length=8, cache=cache)
        assert max(calls["open"]) == 3 and max(calls["window"]) == 3, calls
        for kind in calls.values():
            kind.clear()
        check_ragged(*model, block_length=8, cache=cache, join_late=(1,))
        assert calls["open"] and len(calls["window"]) > 3, calls
        # a narrow row opens its block beside a wide one, which ends early: it goes on alone
        # over the keys and values it kept from the padded forward (its own positions only)
        check_ragged(*model, prompts=[PROMPTS[2], PROMPTS[0]], max_tokens=(12, 16), block_length=8, cache=cache)


@pytest.mark.parametrize(
    "fast",
    [{}, {"fast_self_conditioning": True, "self_conditioning_k": 8}, {"fast_step": True, "self_conditioning_k": 8}],
    ids=["exact", "fast_sc", "fast_step"],
)
def test_diffusion_gemma_rows_share_a_forward(gemma, fast, monkeypatch):
    """DiffusionGemma's rows share the decoder's forward (each over its own encoder cache:
    prompts shorter and longer than the sliding window, several canvases each, a row
    joining late whose first step has no self-conditioning beside rows that have it), and
    each row samples what it samples alone."""
    adapter_class = type(adapter_for(*gemma))
    calls = record_batch_sizes(monkeypatch, adapter_class, "_decode_rows")
    check_ragged(*gemma, max_tokens=(40, 24, 20), seed=3, steps=4, eos_row=None, **fast)
    assert max(calls) == 3, calls
    calls.clear()
    check_ragged(*gemma, max_tokens=(40, 24, 20), seed=5, steps=4, eos_row=None, join_late=(1,), **fast)
    assert max(calls) >= 2, calls
