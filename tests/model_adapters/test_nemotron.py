"""Nemotron-Labs Diffusion: forward parity against mlx-vlm's nemotron_labs_diffusion, decode
parity against an independent oracle of NVIDIA's `generate` (causal context on and off, with
and without token editing) and against mlx-vlm's diffusion mode; loading, conversion,
streaming, batching and bad input.

The oracle runs the reference loop literally over full-sequence forwards with explicit
attention masks (no KV cache): prefix positions attend causally (causal context) or
block-causally (causal context off), the current block attends to the prefix and to itself.
As in tests/helpers/oracles.py, the mask token is never proposed (the engine's documented deviation).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from oracles import softmax

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, VOCAB
from mlx_lm_diffusion.testing.engine_runs import engine_decode
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import NEMOTRON_MASK_ID as MASK_ID
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron
from model_adapters import adapter_for

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [5, 17, 99, 200, 31, 7, 64, 250, 12], [33]]


@pytest.fixture(scope="module")
def nemotron_path(tmp_path_factory):
    return write_nemotron(tmp_path_factory.mktemp("nemotron"))


@pytest.fixture(scope="module")
def nemotron(nemotron_path):
    return mld.load(str(nemotron_path))


@pytest.fixture(scope="module")
def reference(nemotron_path):
    """mlx-vlm's Nemotron-Labs Diffusion on the same checkpoint, in its transformers-parity mode."""
    from mlx_vlm.models import nemotron_labs_diffusion as ref

    config = ref.ModelConfig.from_dict(json.loads((nemotron_path / "config.json").read_text()))
    model = ref.Model(config)
    weights = mx.load(str(nemotron_path / "model.safetensors"))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.language_model._set_transformers_parity_runtime(True)
    return model.language_model


# ---------------------------------------------------------------------------- forward


def test_forward_matches_mlx_vlm(nemotron, reference):
    """Bidirectional, causal, and a bidirectional block over a causal prefix cache; the
    sequences pass position 128, where Ministral-3's query scaling starts."""
    model, _ = nemotron
    ids = mx.array(np.random.default_rng(0).integers(0, VOCAB, (2, 150)))
    ref_model, ref_head = reference.model, reference.diffusion_head
    ours = model(ids)
    theirs = ref_head(ref_model(ids, use_causal_mask=False))
    assert float(mx.abs(ours - theirs).max()) <= 1e-4
    ours = model(ids, mask="causal")
    theirs = ref_head(ref_model(ids, use_causal_mask=True))
    assert float(mx.abs(ours - theirs).max()) <= 1e-4
    cache = model.make_kv_cache()
    model.backbone(ids[:, :120], "causal", cache)
    ours = model.head(model.backbone(ids[:, 120:], None, cache))
    ref_cache = reference.make_cache()
    ref_model(ids[:, :120], cache=ref_cache, use_cache=True, use_causal_mask=True)
    theirs = ref_head(ref_model(ids[:, 120:], cache=ref_cache, use_cache=False, use_causal_mask=False))
    assert float(mx.abs(ours - theirs).max()) <= 1e-4


def test_sanitize_accepts_both_layouts_and_is_idempotent(nemotron, nemotron_path):
    from mlx.utils import tree_flatten

    model, _ = nemotron
    params = dict(tree_flatten(model.parameters()))
    assert set(model.sanitize(dict(params))) == set(params)
    hf = mx.load(str(nemotron_path / "model.safetensors"))
    assert set(model.sanitize(hf)) == set(params)
    vlm = {
        ("language_model.model." + k[len("encoder.") :]) if k.startswith("encoder.") else "language_model." + k: v
        for k, v in hf.items()
    }
    assert set(model.sanitize(vlm)) == set(params)


def test_mask_id_comes_from_the_checkpoint(nemotron):
    model, tok = nemotron
    assert adapter_for(model, tok).mask_id == MASK_ID != 100


# ---------------------------------------------------------------------------- oracle


def _masked_logits(model, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    logits = np.array(model(mx.array(x[None]), mask=mx.array(mask))[0]).astype(np.float64)
    logits[:, MASK_ID] = -np.inf
    return logits


def _attention(chunks: list, causal_context: bool, block: int) -> np.ndarray:
    """Mask over chunks (prompt, finished blocks..., current block of `block` tokens):
    the prefix is causal (causal context) or block-causal over chunks, the last `block`
    positions see the whole prefix and each other."""
    bounds = np.cumsum([0] + chunks + [block])
    L = bounds[-1]
    mask = np.zeros((L, L), dtype=bool)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if causal_context and hi != L:
            mask[lo:hi, :hi] = np.tril(np.ones((hi - lo, hi), dtype=bool), k=lo)
        else:
            mask[lo:hi, :hi] = True
    return mask


def nemotron_generate(
    model, prompt, *, gen_length, block_length, threshold, causal_context, editing_threshold=None, max_post_steps=16
):
    """NVIDIA's Nemotron-Labs Diffusion `generate` (temperature 0, batch 1, no EOS stop), with
    LLaDA2.1's token editing when `editing_threshold` is set. Returns (tokens, denoising forwards)."""
    assert gen_length % block_length == 0
    x = list(prompt)
    chunks = [len(prompt)]
    forwards = 0
    for _ in range(gen_length // block_length):
        block = np.full(block_length, MASK_ID, dtype=np.int64)
        if causal_context:  # the causal pass over the prefix proposes the block's first token
            causal = np.tril(np.ones((len(x), len(x)), dtype=bool))
            block[0] = _masked_logits(model, np.array(x), causal)[-1].argmax()
        mask = _attention(chunks, causal_context, block_length)
        masked0 = int((block == MASK_ID).sum())
        quota = [masked0 // block_length + (i < masked0 % block_length) for i in range(block_length)]
        step = post_steps = 0
        while True:
            masked = block == MASK_ID
            if not masked.any():
                post_steps += 1
                if editing_threshold is None or post_steps > max_post_steps:
                    break
            probs = softmax(_masked_logits(model, np.concatenate([x, block]), mask)[-block_length:])
            forwards += 1
            x0, p = probs.argmax(-1), probs.max(-1)
            conf = np.where(masked, p, -np.inf)
            order = np.argsort(-conf, kind="stable")
            commit = np.zeros(block_length, dtype=bool)
            if masked.any():
                if threshold is None:  # even quota, most confident first
                    commit[order[: quota[step]]] = True
                else:  # the most confident always, then every other with p >= threshold
                    commit[order[0]] = True
                    commit |= masked & (conf >= threshold)
            edit = np.zeros(block_length, dtype=bool)
            if editing_threshold is not None:
                edit = ~masked & (x0 != block) & (p > editing_threshold)
            block = np.where(commit | edit, x0, block)
            step += 1
            if editing_threshold is not None and not masked.any() and not edit.any():
                break
        x += block.tolist()
        chunks.append(block_length)
    return x[len(prompt) :], forwards


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("causal_context", [True, False])
@pytest.mark.parametrize("threshold", [0.3, 0.9, None])
def test_decode_matches_reference_loop(nemotron, prompt, causal_context, threshold):
    model, tok = nemotron
    ref_tokens, ref_forwards = nemotron_generate(
        model, prompt, gen_length=24, block_length=8, threshold=threshold, causal_context=causal_context
    )
    strategy = {"threshold": threshold} if threshold is not None else {"strategy": "low_confidence"}
    tokens, forwards = engine_decode(
        model, tok, prompt, max_tokens=24, block_length=8, causal_context=causal_context, **strategy
    )
    assert tokens == ref_tokens
    assert forwards == ref_forwards


@pytest.mark.parametrize("causal_context", [True, False])
@pytest.mark.parametrize("editing_threshold,max_post_steps", [(0.2, 16), (0.05, 2)])
def test_editing_matches_reference_loop(nemotron, causal_context, editing_threshold, max_post_steps):
    model, tok = nemotron
    prompt = PROMPTS[0]
    ref_tokens, ref_forwards = nemotron_generate(
        model,
        prompt,
        gen_length=16,
        block_length=8,
        threshold=0.5,
        causal_context=causal_context,
        editing_threshold=editing_threshold,
        max_post_steps=max_post_steps,
    )
    tokens, forwards = engine_decode(
        model,
        tok,
        prompt,
        max_tokens=16,
        block_length=8,
        threshold=0.5,
        causal_context=causal_context,
        editing_threshold=editing_threshold,
        max_post_steps=max_post_steps,
    )
    assert tokens == ref_tokens
    assert forwards == ref_forwards


@pytest.mark.parametrize("prompt", PROMPTS[:2])
@pytest.mark.parametrize("threshold", [0.3, 0.9, None])
def test_decode_matches_mlx_vlm_diffusion_mode(nemotron, reference, prompt, threshold):
    """mlx-vlm's `generate` (its "native" sampler: >= threshold, the most confident always;
    threshold None: the even quota) on the same checkpoint: same tokens, same denoising forwards."""
    model, tok = nemotron
    stats = {}
    theirs = reference.generate(
        mx.array([prompt]),
        block_length=8,
        steps=8,
        gen_length=32,
        threshold=threshold,
        eos_id=-1,
        stats=stats,
    )
    strategy = {"threshold": threshold} if threshold is not None else {"strategy": "low_confidence"}
    tokens, forwards = engine_decode(model, tok, prompt, max_tokens=32, block_length=8, **strategy)
    assert tokens == theirs[0].tolist()
    assert forwards == stats["diffusion_denoise_nfe"]


def test_block_length_one_is_autoregressive(nemotron, reference):
    """With causal context, blocks of one token are all seed: greedy autoregressive decoding,
    the tokens of mlx-vlm's `ar_generate`, with no denoising forward; each token streams."""
    model, tok = nemotron
    prompt = PROMPTS[0]
    theirs, _ = reference.ar_generate(mx.array([prompt]), max_new_tokens=12, eos_token_id=-1)
    responses = list(mld.stream_generate(model, tok, prompt, max_tokens=12, block_length=1))
    assert [r.token for r in responses] == theirs[0, len(prompt) :].tolist()
    assert responses[-1].forwards == 0 and responses[-1].finish_reason == "length"


# ---------------------------------------------------------------------------- the doors


def test_batch_rows_match_single_prompts(nemotron):
    model, tok = nemotron
    a, b = PROMPTS[0], [80, 81, 82, 83, 84, 85, 86]
    for causal_context in (True, False):
        kw = dict(max_tokens=20, block_length=8, causal_context=causal_context, threshold=0.5)
        rows = mld.generate_batch(model, tok, [a, b], **kw, return_token_ids=True).token_ids
        assert rows == [mld.generate_batch(model, tok, [p], **kw, return_token_ids=True).token_ids[0] for p in (a, b)]


@pytest.mark.parametrize("options", [{}, dict(editing_threshold=0.2), dict(causal_context=False)])
def test_stream_contract(nemotron, options):
    """Tokens are emitted once final, left to right; one draft per denoising forward; with
    editing, a block's tokens are emitted only once the block is over."""
    model, tok = nemotron
    prompt = PROMPTS[0]
    P = len(prompt)
    drafts = []
    responses = list(
        mld.stream_generate(
            model,
            tok,
            prompt,
            max_tokens=20,
            block_length=8,
            threshold=0.5,
            draft_callback=lambda s: drafts.append(s.canvas.copy()),
            **options,
        )
    )
    assert len(drafts) == responses[-1].forwards
    tokens = [r.token for r in responses]
    assert tokens == drafts[-1][0, P : P + len(tokens)].tolist()
    assert [r.generation_tokens for r in responses] == list(range(1, len(tokens) + 1))
    for i, r in enumerate(responses):
        for canvas in drafts[r.forwards - 1 :]:
            assert canvas[0, P + i] == r.token
    if "editing_threshold" in options:  # whole blocks at a time
        groups = np.unique([r.forwards for r in responses], return_counts=True)[1]
        assert all(n == 8 for n in groups[:-1])
    assert MASK_ID not in tokens
    assert responses[-1].finish_reason in ("stop", "length")
    assert abs(float(mx.exp(responses[-1].logprobs).sum()) - 1) < 1e-4


def test_eos_stops_early(nemotron):
    model, tok = nemotron

    def eos_at_three(tokens, logits):  # (mlx-lm's call: the tokens so far, the next position's logits)
        bias = mx.zeros(logits.shape)
        if len(tokens) == len(PROMPTS[0]) + 3:
            bias[:, EOS_ID] = 1e4
        return logits + bias

    responses = list(
        mld.stream_generate(model, tok, PROMPTS[0], max_tokens=32, block_length=8, logits_processors=[eos_at_three])
    )
    assert responses[-1].finish_reason == "stop" and responses[-1].token == EOS_ID
    assert len(responses) == 4 and responses[-1].forwards <= 7


def test_bad_input(nemotron, llada):
    model, tok = nemotron
    with pytest.raises(ValueError, match="mask token"):
        mld.generate(model, tok, PROMPTS[0] + [MASK_ID], max_tokens=4)
    with pytest.raises(ValueError, match="causal_context"):
        mld.generate(model, tok, PROMPTS[0], max_tokens=4, causal_context="yes")
    with pytest.raises(ValueError, match="causal_context does not apply"):
        mld.generate(*llada, PROMPTS[0], max_tokens=4, causal_context=True)


def test_quantized_convert_and_reload(tmp_path, nemotron_path, nemotron):
    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / "q8"
    convert(str(nemotron_path), str(out), quantize=True, q_bits=8)
    model, tok = mld.load(str(out))
    assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    ids = mx.array([PROMPTS[1]])
    corr = np.corrcoef(np.array(model(ids)).ravel(), np.array(nemotron[0](ids)).ravel())[0, 1]
    assert corr > 0.999
    assert isinstance(mld.generate(model, tok, PROMPTS[0], max_tokens=8), str)


def test_cli_generates(nemotron_path):
    from cli_run import run_main

    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(nemotron_path),
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--block-length",
        "4",
        "--show-canvas",
    )
    assert r.returncode == 0, r.stderr
    assert "forwards" in r.stdout and "[forward 1]" in r.stderr
