"""SDAR / TraDo: forward parity against transformers' Qwen3 given the block-causal mask,
decode parity against an independent oracle of SDAR's `block_diffusion_generate`
(with and without the prefix cache), and the foundation's doors (load, generate,
stream, batch, CLI, convert/quantize, bad input) for this family.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_arsenal.attention import block_causal_mask
from oracles import softmax

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api import generation as api  # (mld.generate is rebound if the CLI module loads)
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.block_checkpoints import SDAR_EOS, SDAR_MASK, VOCAB, write_sdar
from model_adapters import adapter_for

TOL = 1e-4
BLOCK = 4
PROMPTS = [
    [72, 101, 108, 108, 111],
    [5, 17, 99, 200, 31, 7, 64, 250],
    [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45],
]


@pytest.fixture(scope="module")
def sdar_path(tmp_path_factory):
    return write_sdar(tmp_path_factory.mktemp("sdar"))


@pytest.fixture(scope="module")
def sdar(sdar_path):
    return mld.load(str(sdar_path))


def sdar_reference(
    model, prompt, *, gen_length, block_length, steps, strategy, mask_id, threshold=0.9, eb_threshold=0.35
):
    """SDAR's `block_diffusion_generate` (batch 1, greedy), without a cache: the window
    [0, block end) is recomputed with the block-causal mask at every step. Written from
    the algorithm with the evident intent of its defects: greedy at temperature 0, the
    mask token never proposed, top-k counts capped at the masks left, per-position
    entropies. Returns the generated tokens and the denoising forwards (the reference's
    extra pass that stores a finished block's KV is not counted)."""
    P = len(prompt)
    num_blocks = -(-(P + gen_length) // block_length)
    x = np.full(num_blocks * block_length, mask_id, dtype=np.int64)
    x[:P] = prompt
    quota = [block_length // steps + (1 if i < block_length % steps else 0) for i in range(steps)]
    forwards = 0
    for b in range(P // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        for step in range(steps + 1):
            masked = x[start:end] == mask_id
            if not masked.any():
                break
            attention = block_causal_mask(end, block_length)
            logits = np.array(model(mx.array(x[None, :end]), mask=attention)[0, start:end]).astype(np.float64)
            forwards += 1
            logits[:, mask_id] = -np.inf
            probs = softmax(logits)
            x0, p = probs.argmax(-1), probs.max(-1)
            confidence = np.where(masked, p, -np.inf)
            k = min(quota[step], int(masked.sum())) if step < steps else 0
            top_k = np.argsort(-confidence, kind="stable")[:k]
            chosen = np.zeros_like(masked)
            if strategy == "low_confidence_static":
                chosen[top_k] = True
            elif strategy == "low_confidence_dynamic":
                high = confidence > threshold
                if high.sum() >= quota[min(step, steps - 1)]:
                    chosen = high
                else:
                    chosen[top_k] = True
            elif strategy == "entropy_bounded":
                with np.errstate(divide="ignore", invalid="ignore"):
                    entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(-1)
                entropy = np.where(masked, entropy, np.inf)
                order = np.argsort(entropy, kind="stable")
                n = int(np.searchsorted(np.cumsum(entropy[order]), eb_threshold, side="left"))
                chosen[order[: max(1, min(n, int(masked.sum())))]] = True
            x[start:end] = np.where(chosen, x0, x[start:end])
    return x[P : P + gen_length].tolist(), forwards


def engine_decode(model, tokenizer, prompt, use_cache=True, **options):
    adapter = adapter_for(model, tokenizer)
    adapter.use_cache = use_cache
    adapter.eos_ids = frozenset()  # fill the whole canvas, as the reference does
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    last = None
    for last in Engine(adapter, resolved).run(mx.array([prompt])):
        pass
    P = len(prompt)
    return last.canvas[0, P : P + last.final[0]].tolist(), last.forwards


def whole_blocks(prompt, at_least=24, block=BLOCK):
    """A generation length that ends the canvas on a block boundary, as the reference's."""
    return at_least + (-(len(prompt) + at_least)) % block


def test_forward_matches_qwen3_with_block_causal_mask(sdar_path, sdar):
    import torch
    from safetensors.numpy import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model, _ = sdar
    cfg = json.loads((sdar_path / "config.json").read_text())
    config = Qwen3Config(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        num_hidden_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        rope_theta=cfg["rope_theta"],
        rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    ref = Qwen3ForCausalLM(config).eval()
    weights = load_file(str(sdar_path / "model.safetensors"))
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    ids = np.random.default_rng(0).integers(0, 256, (2, 23))
    additive = torch.from_numpy(np.array(block_causal_mask(23, cfg["block_size"])))  # (1, 1, L, L)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(ids), attention_mask=additive.expand(2, 1, 23, 23)).logits.numpy()
    ours = np.array(model(mx.array(ids)))
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= TOL
    # block-causal: a token changes its own block and later ones, never earlier blocks
    changed = ids.copy()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    again = np.array(model(mx.array(changed)))
    assert np.abs(again[:, :8] - ours[:, :8]).max() == 0.0
    assert np.abs(again[:, 8] - ours[:, 8]).max() > 1e-3


def test_family_facts_come_from_the_checkpoint(sdar):
    model, tok = sdar
    adapter = adapter_for(model, tok)
    assert adapter.mask_id == SDAR_MASK and adapter.eos_ids == {SDAR_EOS}
    assert adapter.block_length == adapter.attention_block == BLOCK and adapter.align_blocks
    options = resolve(DecodeOptions(max_tokens=16), adapter, 5)
    assert (options.block_length, options.steps, options.rule.name) == (4, 4, "low_confidence_dynamic")
    assert options.rule.threshold == 0.9 and options.rule.strict


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(
    "strategy,steps,threshold",
    [
        ("low_confidence_dynamic", 4, 0.9),
        ("low_confidence_dynamic", 2, 0.3),
        ("low_confidence_dynamic", 1, 0.9),
        ("low_confidence_static", 4, None),
        ("low_confidence_static", 3, None),
        ("entropy_bounded", 4, None),
    ],
)
def test_decode_matches_reference_with_and_without_cache(sdar, prompt, strategy, steps, threshold):
    model, tok = sdar
    gen = whole_blocks(prompt)
    ref_tokens, ref_forwards = sdar_reference(
        model,
        prompt,
        gen_length=gen,
        block_length=BLOCK,
        steps=steps,
        strategy=strategy,
        mask_id=SDAR_MASK,
        threshold=threshold or 0.9,
    )
    options = dict(max_tokens=gen, steps=steps, strategy=strategy, threshold=threshold)
    for use_cache in (True, False):
        tokens, forwards = engine_decode(model, tok, prompt, use_cache=use_cache, **options)
        assert tokens == ref_tokens
        assert forwards == ref_forwards
    assert SDAR_MASK not in ref_tokens


@pytest.mark.parametrize("gen", [1, 10, 23])
def test_any_length_decodes_whole_blocks_as_the_reference(sdar, gen):
    """A canvas that ends inside a block is decoded as the reference's whole block (the
    positions past max_tokens take part and are cut); the engine stops once the first
    max_tokens tokens are final, so it may spend fewer forwards."""
    model, tok = sdar
    prompt = PROMPTS[0]
    ref_tokens, ref_forwards = sdar_reference(
        model,
        prompt,
        gen_length=gen,
        block_length=BLOCK,
        steps=4,
        strategy="low_confidence_dynamic",
        mask_id=SDAR_MASK,
        threshold=0.5,
    )
    for use_cache in (True, False):
        tokens, forwards = engine_decode(model, tok, prompt, use_cache, max_tokens=gen, threshold=0.5)
        assert tokens == ref_tokens and forwards <= ref_forwards


@pytest.mark.parametrize("eb", [0.05, 2.0, 50.0])
def test_entropy_bound_budget(sdar, eb):
    model, tok = sdar
    prompt = PROMPTS[1]
    gen = whole_blocks(prompt)
    ref = sdar_reference(
        model,
        prompt,
        gen_length=gen,
        block_length=BLOCK,
        steps=4,
        strategy="entropy_bounded",
        mask_id=SDAR_MASK,
        eb_threshold=eb,
    )
    assert (
        engine_decode(model, tok, prompt, max_tokens=gen, steps=4, strategy="entropy_bounded", entropy_bound=eb) == ref
    )


def test_one_step_entropy_bounded_leaves_no_mask(sdar):
    """With one denoising step the reference runs two passes per block and can leave
    masks; the engine keeps committing (at least one per step) until the block is full."""
    model, tok = sdar
    prompt = PROMPTS[0]
    ref_tokens, _ = sdar_reference(
        model, prompt, gen_length=11, block_length=BLOCK, steps=1, strategy="entropy_bounded", mask_id=SDAR_MASK
    )
    tokens, _ = engine_decode(model, tok, prompt, max_tokens=11, steps=1, strategy="entropy_bounded")
    assert SDAR_MASK in ref_tokens and SDAR_MASK not in tokens


def test_generate_stream_batch_and_eos(sdar):
    model, tok = sdar
    text = api.generate(model, tok, "Hello", max_tokens=12)
    responses = list(api.stream_generate(model, tok, "Hello", max_tokens=12))
    assert text == "".join(r.text for r in responses)
    assert [r.generation_tokens for r in responses] == list(range(1, len(responses) + 1))
    assert responses[-1].finish_reason in ("stop", "length") and SDAR_MASK not in [r.token for r in responses]
    a, b = PROMPTS[0], [80, 81, 82, 83, 84]
    rows = api.generate_batch(model, tok, [a, b], max_tokens=10, return_token_ids=True).token_ids
    for prompt, row in zip((a, b), rows):
        assert row == api.generate_batch(model, tok, [prompt], max_tokens=10, return_token_ids=True).token_ids[0]

    prompt = PROMPTS[1]  # 8 tokens: blocks start on the boundary

    def eos_at_2(tokens, logits):  # (mlx-lm's call: the tokens so far, the next position's logits)
        bias = mx.zeros(logits.shape)
        bias[:, SDAR_EOS] = 1e4 if len(tokens) == len(prompt) + 2 else 0.0  # the third generated token
        return logits + bias

    out = list(api.stream_generate(model, tok, prompt, max_tokens=32, logits_processors=[eos_at_2]))
    assert out[-1].finish_reason == "stop" and out[-1].token == SDAR_EOS and len(out) == 3
    assert out[-1].forwards <= BLOCK  # only the first block was decoded


def test_bad_input_and_cli(sdar, sdar_path):
    from cli_run import run_main

    model, tok = sdar
    with pytest.raises(ValueError, match="mask token"):
        api.generate(model, tok, "Say <|MASK|> now", max_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        api.generate(model, tok, [VOCAB + 1], max_tokens=4)
    with pytest.raises(ValueError, match="threshold applies"):
        api.generate(model, tok, "Hi", max_tokens=4, strategy="entropy_bounded", threshold=0.5)
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(sdar_path),
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--strategy",
        "low_confidence_static",
        "--steps",
        "2",
    )
    assert r.returncode == 0 and "forwards" in r.stdout, r.stderr


@pytest.mark.parametrize("bits", [None, 8])
def test_convert_and_quantize_reload(tmp_path, sdar_path, sdar, bits):
    from mlx.utils import tree_flatten

    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / f"q{bits}"
    convert(str(sdar_path), str(out), quantize=bits is not None, q_bits=bits or 4)
    model, tok = mld.load(str(out))
    ids = mx.array([PROMPTS[2]])
    if bits is None:
        assert float(mx.abs(model(ids) - sdar[0](ids)).max()) == 0.0
    else:
        assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
        q, f = np.array(model(ids)).ravel(), np.array(sdar[0](ids)).ravel()
        assert np.corrcoef(q, f)[0, 1] > 0.99
    weights = dict(tree_flatten(model.parameters()))
    assert set(model.sanitize(dict(weights))) == set(weights)
    assert isinstance(api.generate(model, tok, PROMPTS[0], max_tokens=8), str)
