"""Fast-dLLM's prefix and dual caches (`cache=`) for LLaDA and Dream, against oracles.

The oracles run Fast-dLLM's cached loops (llada/generate.py: generate_with_prefix_cache,
generate_with_dual_cache; dream/model/generation_utils_block.py with dual_cache off / on)
written here from the algorithm, batch 1, over a reference forward written here too (a
plain-MLX Llama / Qwen2 over the checkpoint's weights that can attend to kept keys and
values), itself checked against the model's full forward first. Shared deviations, as
for every oracle in this suite: the mask token is never proposed, and a block that fills
at its first step spends no second forward (Fast-dLLM's newer snapshot). The Dream loop
here commits by the chosen rule at the block's first step too (see
model_adapters/attention/bidirectional_cache.py); its block's first position is fed by the first
full forward's row start - 1 throughout the block, as in Fast-dLLM.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import oracles
import pytest
from oracles import softmax

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.commit_rules import RULES
from mlx_lm_diffusion.decoding.options import DecodeOptions, named_options, resolve, schema
from mlx_lm_diffusion.testing.checkpoints import MASK_ID
from mlx_lm_diffusion.testing.engine_runs import engine_decode
from model_adapters import adapter_for
from model_adapters.base import DecodeSetup

PROMPTS = [[72, 101, 108, 108, 111], [5, 17, 99, 200, 31, 7, 64, 250, 12], [33, 40]]
MODES = ["prefix", "dual"]


# --- the reference forward ---------------------------------------------------------


class Reference:
    """A plain-MLX forward of the checkpoint (Llama for LLaDA, Qwen2 with q/k/v biases
    for Dream): non-traditional RoPE at absolute positions, grouped-query attention
    written out, bidirectional. `forward(tokens, offset, prefix, suffix)` attends from
    the window (positions offset ...) to kept keys/values before and after it and
    returns the logits with each layer's (keys, values) of the window."""

    def __init__(self, model):
        self.w = model.parameters()["model"]
        self.head = model.parameters()["lm_head"]["weight"]
        attn = model.layers[0].self_attn
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.dim = model.layers[0].self_attn.q_proj.weight.shape[0] // self.heads
        self.base = attn.rope.base
        self.eps = model.layers[0].input_layernorm.eps

    def _linear(self, x, p):
        y = x @ p["weight"].T
        return y + p["bias"] if "bias" in p else y

    def _norm(self, x, weight):
        return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _rope(self, x, offset):
        d = self.dim
        freqs = self.base ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)
        angles = mx.arange(offset, offset + x.shape[2], dtype=mx.float32)[:, None] * freqs[None]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def forward(self, tokens: np.ndarray, offset: int = 0, prefix=None, suffix=None):
        x = self.w["embed_tokens"]["weight"][mx.array(tokens)][None]
        L, kept = x.shape[1], []
        for i, layer in enumerate(self.w["layers"]):
            a = layer["self_attn"]
            h = self._norm(x, layer["input_layernorm"]["weight"])
            split = lambda t, n: t.reshape(1, L, n, self.dim).transpose(0, 2, 1, 3)  # noqa: E731
            q = self._rope(split(self._linear(h, a["q_proj"]), self.heads), offset)
            k = self._rope(split(self._linear(h, a["k_proj"]), self.kv_heads), offset)
            v = split(self._linear(h, a["v_proj"]), self.kv_heads)
            kept.append((k, v))
            ks = [p[i][0] for p in (prefix,) if p] + [k] + [s[i][0] for s in (suffix,) if s]
            vs = [p[i][1] for p in (prefix,) if p] + [v] + [s[i][1] for s in (suffix,) if s]
            k_all, v_all = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
            rep = self.heads // self.kv_heads
            k_all, v_all = mx.repeat(k_all, rep, axis=1), mx.repeat(v_all, rep, axis=1)
            scores = (q @ k_all.transpose(0, 1, 3, 2)) / math.sqrt(self.dim)
            out = mx.softmax(scores, axis=-1) @ v_all
            x = x + self._linear(out.transpose(0, 2, 1, 3).reshape(1, L, -1), a["o_proj"])
            m = layer["mlp"]
            h = self._norm(x, layer["post_attention_layernorm"]["weight"])
            gate = self._linear(h, m["gate_proj"])
            x = x + self._linear(gate * mx.sigmoid(gate) * self._linear(h, m["up_proj"]), m["down_proj"])
        x = self._norm(x, self.w["norm"]["weight"])
        logits = np.array(x[0] @ self.head.T).astype(np.float64)
        logits[:, MASK_ID] = -np.inf  # (the engine never proposes the mask)
        return logits, kept


def _slice(kept, lo, hi):
    return [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in kept]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_reference_forward_matches_the_model(family, request):
    model, _ = request.getfixturevalue(family)
    ref = Reference(model)
    x = np.array(PROMPTS[1] + [MASK_ID] * 7)
    full = np.array(model(mx.array(x[None]))[0]).astype(np.float64)
    logits, kept = ref.forward(x)
    full[:, MASK_ID] = -np.inf
    close = lambda a, b: np.allclose(a, b, atol=1e-4, rtol=0)  # noqa: E731  (-inf == -inf)
    assert close(logits, full)
    # a window over kept keys/values of the same canvas is the full forward's rows
    window, _ = ref.forward(x[4:9], 4, _slice(kept, 0, 4), _slice(kept, 9, None))
    assert close(window, full[4:9])
    window, _ = ref.forward(x[4:], 4, _slice(kept, 0, 4))
    assert close(window, full[4:])


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", MODES)
def test_cached_step_is_exact_when_the_canvas_is_unchanged(family, mode, request):
    """Over an unchanged canvas the kept keys/values are the fresh ones: a cached step
    gives the full forward's logits."""
    model, tok = request.getfixturevalue(family)
    adapter = adapter_for(model, tok)
    setup = DecodeSetup(resolve(DecodeOptions(max_tokens=16, cache=mode), adapter, 5))
    canvas = mx.array([PROMPTS[0] + [MASK_ID] * 16])
    state = adapter.start(canvas[:, :5], setup=setup)
    first = adapter.predict(state, canvas, 9, 17)
    later = adapter.predict(state, canvas, 9, 17)
    full = adapter.predict(adapter.start(canvas[:, :5]), canvas, 9, 17)  # (no options: no cache)
    assert mx.abs(first - full).max().item() < 1e-4
    assert mx.abs(later - full).max().item() < 1e-4


# --- oracles of Fast-dLLM's cached loops ---------------------------------------------


def _commit(rule, logits, block, step, steps, schedule, mask_id):
    """One step's commits in a block (batch 1): `rule` "quota" (LLaDA's low_confidence,
    `schedule` the block's quotas), "threshold" (Fast-dLLM's: every p >= 0.9, else the
    most confident), or Dream's "entropy" / "maskgit_plus" (count int(M (1 - s / t)) over
    the block's M masks, all at the last step; `schedule` the timesteps)."""
    probs = softmax(logits)
    x0, p = probs.argmax(-1), probs.max(-1)
    masked = block == mask_id
    if rule == "threshold":
        conf = np.where(masked, p, -np.inf)
        chosen = masked & (conf >= 0.9)
        if not chosen.any():
            chosen[int(np.argmax(conf))] = True
        return np.where(chosen, x0, block)
    if rule == "quota":
        count, score = schedule[step], p
    else:
        M = int(masked.sum())
        t, s = schedule[step], schedule[step + 1]
        count = M if step >= steps - 1 else int(np.floor(np.float32(M) * (np.float32(1.0) - s / t)))
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy = -np.sum(np.where(probs > 0, probs * np.log(probs), 0.0), axis=-1)
        score = -entropy if rule == "entropy" else p
    conf = np.where(masked, score, -np.inf)
    order = np.argsort(-conf, kind="stable")[: min(count, int(masked.sum()))]
    out = block.copy()
    out[order] = x0[order]
    return out


def fast_dllm_cached(model, prompt, *, gen, block_length, steps, rule, mode, shift):
    """Fast-dLLM's cached loop. Per block: one forward over the whole canvas drives the
    first step and its keys/values are kept (prefix: before the block; dual: outside
    it); until the block is full, each later step runs x[start:] (prefix) or
    x[start:end] (dual) over them. `shift` 1 is Dream: position i reads row i - 1, and
    the block's first position keeps the full forward's row start - 1."""
    ref, P = Reference(model), len(prompt)
    x = np.array(prompt + [MASK_ID] * gen)
    forwards = 0
    for start in range(P, P + gen, block_length):
        end = min(start + block_length, P + gen)
        n = int((x[start:end] == MASK_ID).sum())
        if rule == "quota":
            schedule = [n // steps + (1 if i < n % steps else 0) for i in range(steps)]
        else:
            schedule = np.linspace(1.0, 1e-3, steps + 1, dtype=np.float64).astype(np.float32)
        logits, kept = ref.forward(x)
        forwards += 1
        block_logits = logits[start - shift : end - shift]
        first_row = block_logits[:1]
        x[start:end] = _commit(rule, block_logits, x[start:end], 0, steps, schedule, MASK_ID)
        prefix = _slice(kept, 0, start)
        suffix = _slice(kept, end, None) if mode == "dual" and end < len(x) else None
        step = 1
        while (x[start:end] == MASK_ID).any():
            stop = end if mode == "dual" else len(x)
            window, _ = ref.forward(x[start:stop], start, prefix, suffix)
            forwards += 1
            if shift:
                block_logits = np.concatenate([first_row, window[: end - start - 1]])
            else:
                block_logits = window[: end - start]
            x[start:end] = _commit(rule, block_logits, x[start:end], step, steps, schedule, MASK_ID)
            step += 1
    return x[P:].tolist(), forwards


LLADA_CASES = [(32, 8, 8), (32, 8, 4), (24, 24, 6), (20, 8, 3), (16, 16, 1)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("gen,block,steps", LLADA_CASES)
def test_llada_quota_matches_fast_dllm(llada, mode, prompt, gen, block, steps):
    model, tok = llada
    expected = fast_dllm_cached(
        model, prompt, gen=gen, block_length=block, steps=steps, rule="quota", mode=mode, shift=0
    )
    got = engine_decode(
        model, tok, prompt, max_tokens=gen, block_length=block, steps=steps, strategy="low_confidence", cache=mode
    )
    assert got == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("gen,block", [(32, 8), (24, 12), (20, 32)])
def test_llada_threshold_matches_fast_dllm(llada, mode, prompt, gen, block):
    model, tok = llada
    expected = fast_dllm_cached(
        model, prompt, gen=gen, block_length=block, steps=block, rule="threshold", mode=mode, shift=0
    )
    got = engine_decode(model, tok, prompt, max_tokens=gen, block_length=block, threshold=0.9, cache=mode)
    assert got == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("rule", ["entropy", "maskgit_plus", "threshold"])
@pytest.mark.parametrize("gen,block,steps", [(32, 8, 8), (24, 8, 3), (16, 16, 16)])
def test_dream_matches_fast_dllm(dream, mode, prompt, rule, gen, block, steps):
    model, tok = dream
    expected = fast_dllm_cached(model, prompt, gen=gen, block_length=block, steps=steps, rule=rule, mode=mode, shift=1)
    options = dict(threshold=0.9) if rule == "threshold" else dict(strategy=rule, steps=steps)
    got = engine_decode(model, tok, prompt, max_tokens=gen, block_length=block, cache=mode, **options)
    assert got == expected


def test_no_cache_is_todays_decode(llada, dream):
    """cache=None: the uncached references, token for token and forward for forward."""
    model, tok = llada
    assert engine_decode(model, tok, PROMPTS[1], max_tokens=24, block_length=8, steps=4) == oracles.llada_generate(
        model, PROMPTS[1], gen_length=24, block_length=8, steps=4, mask_id=MASK_ID
    )
    model, tok = dream
    assert engine_decode(model, tok, PROMPTS[0], max_tokens=16, steps=8, strategy="entropy") == oracles.dream_generate(
        model, PROMPTS[0], max_new_tokens=16, steps=8, alg="entropy", mask_id=MASK_ID
    )


def test_caches_cut_the_work_not_the_forwards(llada):
    """One token per step: the same number of forwards with and without a cache."""
    model, tok = llada
    runs = {
        mode: engine_decode(model, tok, PROMPTS[0], max_tokens=32, block_length=8, cache=mode)
        for mode in (None, "prefix", "dual")
    }
    assert {mode: forwards for mode, (_, forwards) in runs.items()} == {None: 32, "prefix": 32, "dual": 32}
    # (and the caches are approximate: on this random model each decodes differently)
    assert len({tuple(tokens) for tokens, _ in runs.values()}) == 3


@pytest.mark.parametrize("mode", MODES)
def test_window_writes_work_in_place(llada, mode, monkeypatch):
    """A later step writes its window into a kept copy of the canvas's keys and values;
    the copies take turns, so even a pipelined decode (step t + 1 queued while step t,
    which reads the other copy, may still run) writes in place: within a block each copy
    keeps its memory once its first write has copied it (the first forward's keys and
    values, which that forward's graph may still hold)."""
    from model_adapters.attention.bidirectional_cache import BidirectionalCacheAdapter

    def address(array):
        return np.asarray(memoryview(array)).__array_interface__["data"][0]

    seen = {}  # (block start, copy) -> data address of layer 0's keys before each write
    cached_step = BidirectionalCacheAdapter._cached_step

    def spy(self, state, canvas, start, end):  # (holds no array: a held one cannot be written in place)
        seen.setdefault((start, state.turn), []).append(address(state.kept[state.turn][0]))
        return cached_step(self, state, canvas, start, end)

    monkeypatch.setattr(BidirectionalCacheAdapter, "_cached_step", spy)
    model, tok = llada
    engine_decode(model, tok, PROMPTS[0], max_tokens=24, block_length=8, cache=mode)  # one token per step
    assert len(seen) == 6 and all(len(addresses) >= 3 for addresses in seen.values())
    assert all(len(set(addresses[1:])) == 1 for addresses in seen.values()), seen


# --- composition -------------------------------------------------------------------


RULE_OPTIONS = {
    "factor": dict(factor=1.0),
    "entropy_bound": dict(entropy_bound=0.35),
    "entropy_bounded": dict(entropy_bound=0.35),
}


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", MODES)
def test_every_commit_rule_runs_with_each_cache(family, mode, request):
    model, tok = request.getfixturevalue(family)
    variants = [dict(strategy=name, **RULE_OPTIONS.get(name, {})) for name in RULES]
    variants += [
        dict(schedule="cosine"),
        dict(threshold=0.5, editing_threshold=0.5),
        dict(temperature_schedule=(0.0, 0.5, 0.0, 1.0), seed=3, steps=4),
    ]
    for options in variants:
        tokens, forwards = engine_decode(
            model, tok, PROMPTS[0], max_tokens=16, block_length=8, cache=mode, **{"steps": 4, "seed": 1, **options}
        )
        assert len(tokens) == 16 and MASK_ID not in tokens, options
        assert 2 <= forwards <= 16 + (17 * 2 if "editing_threshold" in options else 0), options


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", MODES)
def test_stream_generate_with_drafts(family, mode, request):
    model, tok = request.getfixturevalue(family)
    drafts = []
    responses = list(
        mld.stream_generate(
            model,
            tok,
            [72, 101, 108],
            max_tokens=24,
            block_length=8,
            cache=mode,
            draft_callback=lambda s: drafts.append(s.canvas.copy()),
        )
    )
    assert len(drafts) == responses[-1].forwards
    tokens = [r.token for r in responses]
    assert tokens == drafts[-1][0, 3 : 3 + len(tokens)].tolist()
    for i, r in enumerate(responses):  # an emitted token never changes afterwards
        assert all(d[0, 3 + i] == r.token for d in drafts[r.forwards - 1 :])
    sampled = mld.generate(
        model,
        tok,
        [72, 101, 108],
        max_tokens=16,
        block_length=8,
        cache=mode,
        logits_processors=[lambda history, logits: logits * 0.5],
    )
    assert isinstance(sampled, str)


def test_batched_rows_decode_as_alone(llada):
    """Rows of a batch with a cache decode as they do one at a time."""
    from mlx_lm_diffusion.api.generation import generate_batch

    model, tok = llada
    prompts = [[72, 101, 108, 108], [5, 17, 99, 200]]
    kw = dict(max_tokens=16, block_length=8, cache="dual", return_token_ids=True)
    rows = generate_batch(model, tok, prompts, **kw).token_ids
    for prompt, row in zip(prompts, rows):
        assert row == generate_batch(model, tok, [prompt], **kw).token_ids[0]


def test_fast_preset(llada, dream):
    for model, tok in (llada, dream):
        adapter = adapter_for(model, tok)
        fast = resolve(DecodeOptions(max_tokens=64, preset="fast"), adapter, 5)
        assert fast.rule.name == "threshold" and fast.rule.threshold == 0.9
        assert fast.family["cache"] == "dual" and fast.block_length == 32
        mine = resolve(DecodeOptions(max_tokens=64, preset="fast", cache="prefix", threshold=0.7), adapter, 5)
        assert mine.family["cache"] == "prefix" and mine.rule.threshold == 0.7


def test_cache_option_everywhere_and_refused_elsewhere(tmp_path):
    import argparse

    from mlx_lm_diffusion.decoding.options import add_arguments, check_fields
    from mlx_lm_diffusion.testing.block_checkpoints import write_sdar

    assert "cache" in named_options() and schema()["cache"].json_schema()["enum"] == ["prefix", "dual"]
    assert check_fields({"cache": "dual"}) == {"cache": "dual"}  # the server's JSON field
    assert add_arguments(argparse.ArgumentParser()).parse_args(["--cache", "prefix"]).cache == "prefix"
    model, tok = mld.load(str(write_sdar(tmp_path / "sdar")))
    with pytest.raises(ValueError, match="cache does not apply to SDAR"):
        mld.generate(model, tok, [72, 101], max_tokens=8, cache="dual")
    with pytest.raises(ValueError, match="cache must be one of prefix, dual"):
        schema()["cache"].check("full")


def test_protocol_takes_cache_as_an_extension_field(llada):
    from mlx_lm_diffusion.api.protocol import run_request, validate_response

    model, tok = llada
    request = dict(
        prompt_tokens=PROMPTS[0],
        target_length=21,
        num_steps=8,
        mask_schedule="cosine",
        temperature_schedule=[0.0] * 8,
        top_p=1.0,
    )
    for cache in ("prefix", "dual"):
        response = run_request(model, tok, {**request, "cache": cache})
        validate_response(response)
        assert MASK_ID not in response["final_tokens"]
    with pytest.raises(ValueError, match="cache"):
        run_request(model, tok, {**request, "cache": "full"})
