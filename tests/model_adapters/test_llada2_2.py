"""LLaDA2.2: block-routed experts and the joint decoder with DELETE / SPLIT edits, on a
tiny random checkpoint in the released layout (mlx_lm_diffusion.testing.write_llada2_2).

The forward is checked against mlx-vlm's llada2_moe with its gate replaced by an
independent numpy implementation of block routing; the decoder against an independent,
batch-1, cacheless oracle of the reference loop written below from its description
(the block-causal window [0, block end) re-run at every step, the edit scan as plain
lists)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.block_checkpoints import (
    LLADA2_2_DELETE,
    LLADA2_2_EOS,
    LLADA2_2_SPLIT,
    LLADA2_MASK,
    write_llada2,
    write_llada2_2,
)
from model_adapters import adapter_for
from model_adapters.families.llada2 import BlockRouter, Router

WINDOW, CAPACITY, TOL = 8, 3, 1e-4
MASK, DELETE, SPLIT = LLADA2_MASK, LLADA2_2_DELETE, LLADA2_2_SPLIT


@pytest.fixture(scope="module")
def path22(tmp_path_factory):
    return write_llada2_2(tmp_path_factory.mktemp("llada2_2"))


@pytest.fixture(scope="module")
def llada22(path22):
    return mld.load(str(path22))


# -- block routing -----------------------------------------------------------------------


def numpy_block_routing(gate, hidden: np.ndarray):
    """LLaDA2.2's routing, per row, windows of WINDOW positions from the row's first:
    s = sigmoid(g), r = s + bias; a window keeps the CAPACITY experts with the highest max
    of r over its tokens; a token takes its top-k of r among them; weights s there,
    normalized, scaled."""
    W = np.array(gate.weight, dtype=np.float64)
    bias = np.array(gate.expert_bias, dtype=np.float64)
    s = 1 / (1 + np.exp(-(hidden.astype(np.float64) @ W.T)))
    r = s + bias
    B, L, E = r.shape
    inds = np.zeros((B, L, gate.top_k), np.int32)
    weights = np.zeros((B, L, gate.top_k))
    for b in range(B):
        for w0 in range(0, L, WINDOW):
            rows = r[b, w0 : w0 + WINDOW]
            kept = np.argsort(-rows.max(axis=0), kind="stable")[:CAPACITY]
            for i in range(len(rows)):
                allowed = np.full(E, -np.inf)
                allowed[kept] = rows[i, kept]
                top = np.argsort(-allowed, kind="stable")[: gate.top_k]
                wt = s[b, w0 + i, top]
                inds[b, w0 + i] = top
                weights[b, w0 + i] = wt / wt.sum() * gate.routed_scaling_factor
    return inds, weights


@pytest.fixture(scope="module")
def vlm_block_routed(path22):
    """mlx-vlm's llada2_moe (attention, experts, layout) with a numpy block-routing gate."""
    from mlx_vlm.models.llada2_moe import Model, ModelConfig, language

    config = json.loads((path22 / "config.json").read_text())
    model = Model(ModelConfig.from_dict(config))
    model.load_weights(list(model.sanitize(dict(mx.load(str(path22 / "model.safetensors")))).items()), strict=True)

    def gate(self, hidden):
        inds, weights = numpy_block_routing(self, np.array(hidden.astype(mx.float32)))
        return mx.array(inds), mx.array(weights.astype(np.float32)), None

    original = language.LLaDA2MoeGate.__call__
    language.LLaDA2MoeGate.__call__ = gate
    yield model
    language.LLaDA2MoeGate.__call__ = original


def test_config_selects_block_routing(llada22, tmp_path):
    model, _ = llada22
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    assert gates and all(type(g) is BlockRouter for g in gates)
    assert model.args.text.n_group == 2  # the group fields stay in the config, unused
    older, _ = mld.load(str(write_llada2(tmp_path / "l21", extra_config={"block_size": 8})))
    assert all(type(layer.mlp.gate) is Router for layer in older.model.layers[1:])
    zero, _ = mld.load(str(write_llada2(tmp_path / "zero", extra_config={"expert_capacity": 0})))
    assert all(type(layer.mlp.gate) is Router for layer in zero.model.layers[1:])


def test_forward_is_block_routed(llada22, vlm_block_routed):
    from mlx_arsenal.attention import block_causal_mask

    model, _ = llada22
    for L in (37, 40):  # a last window the input covers in part, and whole windows
        ids = mx.array(np.random.default_rng(L).integers(0, 256, (2, L)))
        theirs = np.array(vlm_block_routed(ids, mask=block_causal_mask(L, WINDOW) == 0).logits)
        ours = np.array(model(ids))
        assert np.abs(ours - theirs).max() <= TOL


def test_routing_windows_are_per_row_in_a_ragged_batch(llada22):
    """Rows of 13 and 11 positions (24: a multiple of the window, which a flattened count
    of tokens would route as three shared windows) give each row's own logits."""
    model, tokenizer = llada22
    adapter = adapter_for(model, tokenizer)
    from mlx_lm_diffusion.decoding.decoders import Forward

    rng = np.random.default_rng(7)
    canvases = [mx.array(rng.integers(0, 256, (1, n))) for n in (13, 11)]
    requests = []
    for canvas in canvases:
        state = adapter.start(canvas[:, :5])
        requests.append(Forward(state, canvas, 8, canvas.shape[1]))
    batched = adapter.predict_batch(requests)
    for canvas, logits in zip(canvases, batched):
        alone = np.array(model(canvas))[:, 8:]
        assert np.abs(np.array(logits) - alone).max() <= TOL


def test_prefix_cache_keeps_routing(llada22):
    """A forward over a window after a cached prefix routes as the whole sequence does."""
    model, tokenizer = llada22
    adapter = adapter_for(model, tokenizer)
    canvas = mx.array(np.random.default_rng(3).integers(0, 256, (1, 30)))
    state = adapter.start(canvas[:, :20])
    adapter.predict(state, canvas, 16, 24)  # stores [0, 16)
    assert state.stored == 16
    cached = np.array(adapter.predict(state, canvas, 24, 30))
    assert np.abs(cached - np.array(model(canvas))[:, 24:30]).max() <= TOL


# -- the decoder ---------------------------------------------------------------------------


def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def oracle(
    model,
    prompt,
    max_tokens,
    *,
    block=WINDOW,
    steps=None,
    threshold=0.5,
    editing=0.0,
    max_post=16,
    max_steps=1000,
    eos=tuple(LLADA2_2_EOS),
):
    """LLaDA2.2's `generate`, batch 1, greedy, no cache, written from the algorithm."""
    P, S = len(prompt), steps or block
    total = -(-(P + max_tokens) // block) * block
    x = list(prompt) + [MASK] * (total - P)
    forwards, escapes = 0, 0
    for start in range(P // block * block, total, block):
        end, held = start + block, max(P - start, 0)
        orig = [i >= held and x[start + i] == MASK for i in range(block)]
        N, t, post, seen = sum(orig), 0, 0, set()
        while True:
            logits = np.array(model(mx.array([x[:end]])))[0, start:end].astype(np.float64)
            forwards += 1
            logits[:, MASK] = -np.inf
            p = softmax(logits)
            x0 = p.argmax(-1)
            conf = p[np.arange(block), x0]
            second = np.where(np.arange(p.shape[1]) == x0[:, None], -1.0, p).argmax(-1)
            p_clean = p.copy()
            p_clean[:, [DELETE, SPLIT]] = -1.0
            clean = p_clean.argmax(-1)
            old = x[start:end]
            masks = [i >= held and old[i] == MASK for i in range(block)]
            left = [m and o for m, o in zip(masks, orig)]
            post = 0 if any(left) else post + 1
            made = sum(masks) - sum(left)
            if t >= S:
                m2t = list(masks)
            else:
                need = N // S + (t < N % S) + made
                high = [m and conf[i] > threshold for i, m in enumerate(masks)]
                if sum(high) >= need:
                    m2t = high
                else:
                    ranked = sorted((i for i in range(block) if masks[i]), key=lambda i: (-conf[i], i))
                    chosen = set(ranked[:need])
                    m2t = [i in chosen for i in range(block)]
            t2t = [i >= held and not masks[i] and x0[i] != old[i] and conf[i] > editing for i in range(block)]
            final = post >= max_post if max_post > 0 else not any(l and not m for l, m in zip(left, m2t))
            final = final or t >= max_steps - 1
            proposal = [int(v) for v in x0]
            if final:
                m2t = list(masks)
                proposal = [int(clean[i]) if v in (DELETE, SPLIT) else v for i, v in enumerate(proposal)]
            written = [proposal[i] if m2t[i] or t2t[i] else old[i] for i in range(block)]
            for _ in range(5 if not final else 0):
                if tuple(written) not in seen:
                    break
                changed = [i for i in range(block) if written[i] != old[i]]
                if not changed:
                    break
                at = min(changed, key=lambda i: (conf[i], i))
                written[at] = int(second[at]) if written[at] == proposal[at] else proposal[at]
                escapes += 1
            seen.add(tuple(written))
            new, track = [], []
            for i, token in enumerate(written):
                if i < held:
                    new.append(old[i])
                    track.append(False)
                elif token == DELETE:
                    continue
                elif token == SPLIT:
                    new += [MASK, old[i]]
                    track += [False, orig[i]]
                else:
                    new.append(token)
                    track.append(orig[i])
            new, track = (new + [MASK] * block)[:block], (track + [False] * block)[:block]
            changed = new != old
            x[start:end], orig, t = new, track, t + 1
            if final or (not changed and MASK not in new[held:]):
                break
        text = x[P:end]
        stops = [i for i, v in enumerate(text) if v in eos]
        if stops and stops[0] < max_tokens:
            return text[: stops[0] + 1], forwards, escapes
        if len(text) >= max_tokens:
            return text[:max_tokens], forwards, escapes
    return x[P : P + max_tokens], forwards, escapes


def engine(model, tokenizer, prompts, use_cache=True, **options):
    adapter = adapter_for(model, tokenizer)
    adapter.use_cache = use_cache
    P = len(prompts[0])
    resolved = resolve(DecodeOptions(**options), adapter, P)
    run = Engine(adapter, resolved)
    steps = list(run.run(mx.array(prompts)))
    last = steps[-1]
    return [last.canvas[b, P : P + last.final[b]].tolist() for b in range(len(prompts))], last.forwards, run, steps


CASES = [(seed, n, max_tokens) for seed in range(6) for n, max_tokens in ((3, 10), (9, 16), (14, 7))]


@pytest.mark.parametrize("seed,length,max_tokens", CASES)
def test_decode_matches_the_reference_loop(llada22, seed, length, max_tokens):
    model, tokenizer = llada22
    prompt = np.random.default_rng(seed).integers(0, 256, length).tolist()
    want, forwards, _ = oracle(model, prompt, max_tokens)
    got, got_forwards, run, steps = engine(model, tokenizer, [prompt], max_tokens=max_tokens)
    assert got[0] == want
    assert got_forwards == forwards
    for step in steps:  # no DELETE, SPLIT or mask in any final text
        final = step.canvas[0, len(prompt) : len(prompt) + step.final[0]].tolist()
        assert not set(final) & {MASK, DELETE, SPLIT}
    assert run.decoder.name == "block_edits"


def test_edits_are_exercised(llada22, monkeypatch):
    """The test checkpoint's random weights propose DELETE and SPLIT: the scan runs."""
    from mlx_lm_diffusion.decoding.decoders import block_edits

    model, tokenizer = llada22
    seen = []
    real = block_edits.apply_block_edits

    def spy(old, new, *args, **kwargs):
        seen.append(np.array(new))
        return real(old, new, *args, **kwargs)

    monkeypatch.setattr(block_edits, "apply_block_edits", spy)
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, 256, 9).tolist()
        engine(model, tokenizer, [prompt], max_tokens=16)
    written = np.concatenate([s.ravel() for s in seen])
    assert (written == DELETE).sum() > 0 and (written == SPLIT).sum() > 0


@pytest.mark.parametrize(
    "options",
    [
        dict(max_post_steps=0),
        dict(max_post_steps=2, steps=4),
        dict(threshold=0.9, editing_threshold=0.3),
        dict(block_length=16),
    ],
)
def test_options_match_the_reference_loop(llada22, options):
    model, tokenizer = llada22
    names = {"max_post_steps": "max_post", "editing_threshold": "editing", "block_length": "block"}
    for seed in range(3):
        prompt = np.random.default_rng(10 + seed).integers(0, 256, 6 + seed).tolist()
        want, forwards, _ = oracle(model, prompt, 12, **{names.get(k, k): v for k, v in options.items()})
        got, got_forwards, _, _ = engine(model, tokenizer, [prompt], max_tokens=12, **options)
        assert (got[0], got_forwards) == (want, forwards)


def test_cache_and_batch_rows_are_the_row_alone(llada22):
    model, tokenizer = llada22
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, 10).tolist() for _ in range(3)]
    alone = [engine(model, tokenizer, [p], max_tokens=14)[0][0] for p in prompts]
    assert [engine(model, tokenizer, [p], use_cache=False, max_tokens=14)[0][0] for p in prompts] == alone
    together, *_ = engine(model, tokenizer, prompts, max_tokens=14)  # one canvas, rows independent
    assert together == alone


def test_ragged_running_batch_is_the_row_alone(llada22):
    model, tokenizer = llada22
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (4, 9, 13)]
    alone = [mld.generate_batch(model, tokenizer, [p], max_tokens=12, return_token_ids=True) for p in prompts]
    batch = mld.generate_batch(model, tokenizer, prompts, max_tokens=12, return_token_ids=True)
    assert batch.token_ids == [row.token_ids[0] for row in alone]
    assert batch.forwards == [row.forwards[0] for row in alone]


@pytest.mark.parametrize("seed", range(12))
def test_invariants_under_fuzzed_settings(llada22, seed):
    """Fixed block length, prompt intact, no DELETE / SPLIT / mask in any final text,
    steps bounded, whatever the thresholds and budgets."""
    model, tokenizer = llada22
    rng = np.random.default_rng(100 + seed)
    prompt = rng.integers(0, 256, int(rng.integers(1, 20))).tolist()
    options = dict(
        max_tokens=int(rng.integers(1, 30)),
        threshold=float(rng.uniform(0, 1)),
        editing_threshold=float(rng.uniform(0, 1)),
        max_post_steps=int(rng.integers(0, 5)),
        steps=int(rng.integers(1, 10)),
        max_steps_per_block=int(rng.integers(1, 12)),
        block_length=int(rng.choice([8, 16])),
    )
    out, forwards, run, steps = engine(model, tokenizer, [prompt], **options)
    P, width = len(prompt), steps[0].canvas.shape[1]
    for step in steps:
        assert step.canvas.shape[1] == width  # the canvas keeps its length
        assert step.canvas[0, :P].tolist() == prompt
        start, end = step.block  # (the first block begins at the prompt's end, its tail before it)
        assert end % options["block_length"] == 0 and 0 < end - start <= options["block_length"]
    assert not set(out[0]) & {MASK, DELETE, SPLIT}
    blocks = len({s.block for s in steps})
    assert forwards <= blocks * options["max_steps_per_block"]


def test_defaults_and_errors(llada22):
    model, tokenizer = llada22
    adapter = adapter_for(model, tokenizer)
    resolved = resolve(DecodeOptions(max_tokens=8), adapter, 5)
    assert (resolved.block_length, resolved.steps, resolved.rule.threshold, resolved.max_post_steps) == (8, 8, 0.5, 16)
    assert adapter.eos_ids == frozenset(LLADA2_2_EOS)
    with pytest.raises(ValueError, match="multiple of this checkpoint's routing window"):
        resolve(DecodeOptions(max_tokens=8, block_length=12), adapter, 5)
    with pytest.raises(ValueError, match="edit_ops=\\[\\]"):
        resolve(DecodeOptions(max_tokens=8, strategy="entropy_bounded"), adapter, 5)
    with pytest.raises(ValueError, match="come together"):
        resolve(DecodeOptions(max_tokens=8, edit_ops=("substitute", "insert")), adapter, 5)
    # edits off: the masked-block decoder with any rule, never proposing DELETE or SPLIT
    for options in (
        dict(edit_ops=()),
        dict(edit_ops=(), strategy="entropy_bounded"),
        dict(edit_ops=("substitute",), editing_threshold=0.0),
    ):
        out, _, run, _ = engine(model, tokenizer, [[72, 101, 108]], max_tokens=16, **options)
        assert run.decoder.name == "masked_block"
        assert not set(out[0]) & {MASK, DELETE, SPLIT}
    with pytest.raises(ValueError, match="max_steps_per_block"):
        resolve(DecodeOptions(max_tokens=8, edit_ops=(), max_steps_per_block=3), adapter, 5)


# -- the doors -----------------------------------------------------------------------------


def test_server_batches_edit_decodes_with_the_rows_alone(llada22, path22):
    """OpenAI completions on a LLaDA2.2 checkpoint, several at once (one running batch):
    each answer is what the Python API gives for its prompt alone; a protocol request on
    the same server keeps its schedule (no edits)."""
    from concurrent.futures import ThreadPoolExecutor

    from server_runs import post_json, running_server

    model, tokenizer = llada22
    prompts = ["Hello", "The sky is", "1, 2, 3,", "abc"]
    alone = [mld.generate(model, tokenizer, p, max_tokens=12) for p in prompts]
    with running_server(["--model", str(path22), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        port = httpd.server_address[1]

        def complete(prompt):
            return post_json(port, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        assert [status for status, _ in answers] == [200] * len(prompts)
        assert [body["choices"][0]["text"] for _, body in answers] == alone
        status, body = post_json(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "block_length": 12})
        assert status == 400 and "routing window" in body["error"]["message"]


def test_stock_mlx_lm_doors_after_install(llada22, path22, installed):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path22))
    assert type(model.model.layers[1].mlp.gate) is BlockRouter
    ours = mld.generate(*llada22, "Hello", max_tokens=12)
    assert mlx_lm.generate(model, tokenizer, "Hello", max_tokens=12) == ours
    assert "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, "Hello", max_tokens=12)) == ours


@pytest.mark.parametrize("bits", [None, 8])
def test_convert_and_quantize_keep_block_routing(llada22, path22, tmp_path, bits):
    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / f"q{bits}"
    convert(str(path22), str(out), quantize=bits is not None, q_bits=bits or 4)
    model, tokenizer = mld.load(str(out))
    assert type(model.model.layers[1].mlp.gate) is BlockRouter
    assert (model.args.expert_capacity, model.args.delete_token_id) == (CAPACITY, DELETE)
    ids = mx.array([list(range(40, 61))])
    if bits is None:
        assert float(mx.abs(model(ids) - llada22[0](ids)).max()) == 0.0
        assert mld.generate(model, tokenizer, "Hello", max_tokens=12) == mld.generate(*llada22, "Hello", max_tokens=12)
    else:
        q, f = np.array(model(ids)).ravel(), np.array(llada22[0](ids)).ravel()
        assert np.corrcoef(q, f)[0, 1] > 0.95
        out_text = mld.generate(model, tokenizer, "Hello", max_tokens=12)
        assert isinstance(out_text, str)


def test_draft_callback_sees_inserts_and_deletes(llada22):
    """Every step's draft carries the DELETEs it applied and the masks its SPLITs inserted;
    an inserted mark sits on a mask of the block after the scan."""
    model, tokenizer = llada22
    drafts = []
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, 256, 9).tolist()
        mld.generate(model, tokenizer, prompt, max_tokens=16, draft_callback=drafts.append)
    marked = [s for s in drafts if s.edits is not None]
    assert marked and len(marked) == len(drafts)
    assert sum(int(s.edits.deleted.sum()) for s in marked) > 0 and sum(int(s.edits.inserted.sum()) for s in marked) > 0
    for step in marked:
        start, end = step.block
        block = step.canvas[:, start:end]
        assert (block[step.edits.inserted] == MASK).all()


def test_draft_frames_carry_the_edits_for_the_studio(llada22):
    from mlx_lm_diffusion.serving.responses import draft_frame

    model, tokenizer = llada22
    frames, texts = [], {}
    prompt = np.random.default_rng(1).integers(0, 256, 9).tolist()
    mld.generate(
        model,
        tokenizer,
        prompt,
        max_tokens=16,
        draft_callback=lambda step: frames.append(draft_frame(tokenizer, step, MASK, texts)),
    )
    assert all("inserted" in f and "deleted" in f for f in frames)
    assert any(f["deleted"] for f in frames) and any(f["inserted"] for f in frames)
    for frame in frames:
        assert all(frame["states"][i] == "m" for i in frame["inserted"])


def test_either_eos_of_the_list_ends_the_decode_in_a_final_block(tmp_path):
    """A checkpoint whose two EOS rows are proposed often: decodes end at <|endoftext|> and
    at <|role_end|> as the reference loop does (only once their block is final), and the
    stream ends there with finish_reason "stop"."""
    eos, role_end = LLADA2_2_EOS
    model, tokenizer = mld.load(str(write_llada2_2(tmp_path / "eos", head_scales={eos: 1.45, role_end: 1.45})))
    ended = set()
    for seed in range(8):
        prompt = np.random.default_rng(seed).integers(0, 256, 5 + seed).tolist()
        want, forwards, _ = oracle(model, prompt, 24)
        got, got_forwards, _, _ = engine(model, tokenizer, [prompt], max_tokens=24)
        assert (got[0], got_forwards) == (want, forwards)
        if want[-1] in LLADA2_2_EOS:
            ended.add(want[-1])
            streamed = list(mld.stream_generate(model, tokenizer, prompt, max_tokens=24))
            assert [r.token for r in streamed] == want and streamed[-1].finish_reason == "stop"
    assert ended == {eos, role_end}


def test_the_generate_cli_takes_edit_ops(path22):
    from cli_run import run_main

    base = [
        "--model",
        str(path22),
        "--prompt",
        "Hello",
        "--max-tokens",
        "8",
        "--ignore-chat-template",
        "--verbose",
        "False",
    ]
    for ops in (["none"], ["substitute", "insert", "delete"]):
        done = run_main("mlx_lm_diffusion.generate", *base, "--edit-ops", *ops)
        assert done.returncode == 0, done.stderr
    bad = run_main("mlx_lm_diffusion.generate", *base, "--edit-ops", "insert", "delete")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: LLaDA2.2's insert and delete edits are written by its token edits; add 'substitute' to edit_ops"
    ]


def test_the_chat_repl_decodes_with_edits(path22):
    """The chat door on a LLaDA2.2 checkpoint (its chat template, the edit decoding)."""
    from cli_run import run

    done = run("mlx_lm_diffusion.chat", "--model", str(path22), "--max-tokens", "8", stdin="Hello\nq\n")
    assert done.returncode == 0, done.stderr
    assert "tokens" in done.stdout and "bye" in done.stdout
