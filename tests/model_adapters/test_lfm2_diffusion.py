"""LFM2.5-Diffusion (model_adapters.families.lfm2_diffusion, decoding.decoders.duo_block; issue 53.4).

On a tiny random checkpoint in the released layout: a block's logits over the cached context
equal an independent torch forward of the whole [prompt | block] sequence (transformers' own
LFM2 layers inside the sigma conditioning and self-conditioning written here from the
reference's description, the prompt causal at sigma 0, the block bidirectional); the DUO step
equals a float64 numpy posterior with the same noise; a seeded decode equals an oracle of the
reference sampler's loop (lfm_diffusion/sampler.py `generate_ids`: the model run on the whole
canvas at every step, no cache); blocks end at the end token; the presets' forwards.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.decoders.duo_block import alpha, duo_posterior, reverse_step, temperature_at, time_grid
from mlx_lm_diffusion.testing.hybrid_checkpoints import LFM2_REAL_VOCAB, write_lfm2_diffusion
from model_adapters import adapter_for

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_lfm2_diffusion(tmp_path_factory.mktemp("lfm2") / "lfm2_diffusion")
    return path, mld.load(str(path))


# -- the forward


def _torch_forward(path, tokens: list, prompt_len: int, sigma_block: float, soft: np.ndarray = None) -> np.ndarray:
    """Block logits (block, real vocab) of [prompt | block] in one pass, in torch: transformers'
    Lfm2DecoderLayer for the layers; the adaLN shell, the sinusoid, self-conditioning and the
    attention layout from the reference's description (the prompt causal, the block seeing all)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2DecoderLayer, Lfm2RotaryEmbedding

    config = json.loads((path / "config.json").read_text())
    w = {k: torch.tensor(v.astype(np.float64)) for k, v in load_file(str(path / "model.safetensors")).items()}
    hf = Lfm2Config(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        norm_eps=config["norm_eps"],
        conv_L_cache=config["conv_L_cache"],
        layer_types=config["layer_types"],
        block_auto_adjust_ff_dim=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    hf._attn_implementation = "eager"

    def rms(x, weight, eps=config["norm_eps"]):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def linear(x, name, bias=True):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if bias and name + ".bias" in w else y

    L = len(tokens)
    sigma = torch.zeros(L, dtype=torch.float64)
    sigma[prompt_len:] = sigma_block
    half = config["sigma_freq_embedding_size"] // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    waves = torch.cat([torch.cos(sigma[:, None] * freqs), torch.sin(sigma[:, None] * freqs)], dim=-1)
    temb = linear(torch.nn.functional.silu(linear(waves, "model.sigma_embed.mlp.0")), "model.sigma_embed.mlp.2")
    base = linear(torch.nn.functional.silu(temb), "model.adaln_proj.1")
    h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    if soft is not None:
        sc = linear(
            torch.nn.functional.silu(
                linear(
                    rms(torch.tensor(soft, dtype=torch.float64), w["model.selfcond_norm.weight"]),
                    "model.selfcond_ffn.0",
                )
            ),
            "model.selfcond_ffn.2",
            bias=False,
        )
        h = h.clone()
        h[prompt_len:] += sc  # (the context gets nothing, not even the bias)
    rows, cols = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = (cols <= rows) | (rows >= prompt_len)
    mask = torch.where(allowed, 0.0, float("-inf")).to(torch.float64)[None, None]
    position_ids = torch.arange(L)[None]
    h = h[None]
    rotary = Lfm2RotaryEmbedding(hf).to(torch.float64)
    position_embeddings = rotary(h, position_ids)
    for i, kind in enumerate(config["layer_types"]):
        layer = Lfm2DecoderLayer(hf, i).to(torch.float64)
        prefix = f"model.layers.{i}."
        layer.load_state_dict({k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)})
        scale, shift, gate = (base + w["model.adaln_block_emb"][i]).chunk(3, dim=-1)
        h_mod = h * (1 + scale) + shift
        with torch.no_grad():
            out = layer(
                h_mod,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                attention_mask=mask if kind == "full_attention" else None,
            )
        h = h + (1 + gate) * (out - h_mod)
    h = rms(h[0], w["model.embedding_norm.weight"])
    logits = h @ w["model.embed_tokens.weight"].T
    return logits[prompt_len:, :LFM2_REAL_VOCAB].detach().numpy()


def test_a_block_over_the_cached_context_matches_a_torch_forward_of_the_whole_sequence(checkpoint):
    path, (model, tokenizer) = checkpoint
    adapter = adapter_for(model, tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    block = [7, 200, 13, 99, 5, 250, 31, 8]
    canvas = mx.array([prompt + block])
    rng = np.random.default_rng(0)
    soft = rng.standard_normal((len(block), model.args.text.hidden_size)).astype(np.float32)
    for sigma, with_soft in ((2.5, False), (0.7, True)):
        state = adapter.start(mx.array([prompt]))
        adapter.noise(state, sigma)
        state.block, state.soft = len(prompt), (mx.array(soft[None]) if with_soft else None)
        got = np.array(adapter.predict(state, canvas, len(prompt), len(prompt) + len(block))[0])
        expected = _torch_forward(path, prompt + block, len(prompt), sigma, soft if with_soft else None)
        assert got.shape == (len(block), LFM2_REAL_VOCAB)
        assert np.abs(got - expected).max() < TOL * max(1.0, np.abs(expected).max()), (sigma, with_soft)
        assert state.length == len(prompt)  # (the block never enters the cache)


def test_without_conditioning_it_is_transformers_lfm2(tmp_path):
    """The adaLN weights zeroed (scale = shift = gate = 0: h + (layer(h) - h)), the clean causal
    forward is transformers' own Lfm2ForCausalLM on the same weights (the real rows)."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Lfm2Config, Lfm2ForCausalLM

    path = write_lfm2_diffusion(tmp_path / "plain")
    weights = load_file(str(path / "model.safetensors"))
    for name in ("model.adaln_proj.1.weight", "model.adaln_proj.1.bias", "model.adaln_block_emb"):
        weights[name] = np.zeros_like(weights[name])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    hf = Lfm2Config(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        norm_eps=config["norm_eps"],
        conv_L_cache=config["conv_L_cache"],
        layer_types=config["layer_types"],
        block_auto_adjust_ff_dim=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
    )
    reference = Lfm2ForCausalLM(hf).eval()
    state = {
        k: torch.tensor(v)
        for k, v in weights.items()
        if k.startswith("model.") and "sigma" not in k and "adaln" not in k and "selfcond" not in k
    }
    reference.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    model, tokenizer = mld.load(str(path))
    tokens = tokenizer.encode("The quick brown fox jumps")
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, :, :LFM2_REAL_VOCAB].numpy()
    got = np.array(model(mx.array([tokens]))[0])
    assert np.abs(got - expected).max() < TOL * max(1.0, np.abs(expected).max())


def test_the_self_conditioning_input_is_the_expected_embedding(checkpoint):
    _, (model, _) = checkpoint
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 3, LFM2_REAL_VOCAB)), axis=-1))
    table = np.array(model.model.embed_tokens.weight)[:LFM2_REAL_VOCAB]
    expected = np.exp(np.array(logprobs)) @ table
    assert np.abs(np.array(model.soft_embedding(logprobs)) - expected).max() < 1e-5


# -- the DUO step


def test_the_duo_step_is_the_float64_posterior_with_the_same_noise():
    """The posterior against numpy's float64 transcription of the reference's `_duo_posterior`,
    and a step's tokens against the argmax of q / Gumbel(the same uniforms)."""
    rng = np.random.default_rng(1)
    V, L = 50, 6
    logits = rng.standard_normal((1, L, V)).astype(np.float32) * 3
    xt = rng.integers(0, V, (1, L))
    for alpha_t, alpha_s, temperature in ((0.05, 0.3, 0.8), (0.6, 0.95, 0.5), (0.4966, 1.0, 0.4)):
        z = logits / temperature
        z = z - z.max(-1, keepdims=True)
        x0 = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        x0 = x0.astype(np.float32).astype(np.float64)
        onehot = np.eye(V)[xt]
        ratio = alpha_t / alpha_s
        numer = (
            alpha_t * V * x0 * onehot
            + (ratio - alpha_t) * onehot
            + (alpha_s - alpha_t) * x0
            + (1 - ratio) * (1 - alpha_s) / V
        )
        q = numer / (alpha_t * V * np.take_along_axis(x0, xt[..., None], -1) + (1 - alpha_t))
        with mx.stream(mx.cpu):
            got = np.array(duo_posterior(mx.array(x0, dtype=mx.float64), mx.array(xt), alpha_s, alpha_t))
        assert np.abs(got - q).max() < 1e-12
        assert np.allclose(q.sum(-1), 1.0)
        mx.random.seed(5)
        tokens, _ = reverse_step(mx.array(logits), mx.array(xt), alpha_t, alpha_s, temperature, float64=True)
        mx.random.seed(5)
        u = np.array(mx.random.uniform(shape=(1, L, V))).astype(np.float64)
        expected = np.argmax(np.maximum(q, 1e-30) / (1e-10 - np.log(u + 1e-10)), axis=-1)
        assert np.array(tokens).tolist() == expected.tolist()


def test_the_time_grid_and_temperatures_are_the_references():
    grid = time_grid(4, 0.2)
    assert grid[0] == pytest.approx(1.0) and grid[-1] == pytest.approx(1e-3)
    assert grid[1] == pytest.approx(1e-3 + (1 - 1e-3) * 0.75**0.2)
    assert alpha(1.0) == pytest.approx(1e-3)
    assert [temperature_at(j, 4, 0.8, 0.5) for j in range(4)] == pytest.approx([0.8, 0.7, 0.6, 0.5])


# -- decoding: the reference's loop


def _oracle(
    adapter, prompt: list, max_tokens: int, steps: int, rho: float, t_start: float, t_end: float, block: int = 32
) -> tuple:
    """The reference sampler's loop (lfm_diffusion/sampler.py `generate_ids`), written here:
    uniform random block, `steps` ancestral steps on the rho grid with the linear temperature
    anneal and self-conditioning, a readout at sigma >= 0.7, stop after a block that holds an end
    token. The model forward is the project's (the block over the causal context cache, which
    the test above equals the reference's whole-sequence forward); draws in the decoder's
    order (the block's, then each step's uniforms)."""
    model, V = adapter.model, LFM2_REAL_VOCAB
    grid = 1e-3 + (1 - 1e-3) * np.linspace(1.0, 0.0, steps + 1) ** rho
    alphas = 1 - (1 - 1e-3) * grid
    readout = min(alphas[-1], math.exp(-0.7))
    state = adapter.start(mx.array([prompt]))
    canvas, forwards = list(prompt), 0
    for _ in range(-(-max_tokens // block)):
        start = len(canvas)
        if start > state.length:  # the last block, into the context (clean, causal)
            model(mx.array([canvas[state.length :]]), state.cache)
            state.length = start
        x = mx.random.randint(0, V, (1, block)).astype(mx.int32)
        plan = [(alphas[j], alphas[j + 1], t_start + j / max(steps - 1, 1) * (t_end - t_start)) for j in range(steps)]
        state.soft, state.block = None, start
        for a_t, a_s, temperature in plan + [(readout, 1.0, t_end)]:
            state.sigma = -math.log(max(a_t, 1e-30))
            logits = adapter.predict(state, mx.array([canvas + np.array(x)[0].tolist()]), start, start + block)
            forwards += 1
            x, logprobs = reverse_step(logits, x, a_t, a_s, temperature, float64=True)
            state.soft = model.soft_embedding(logprobs)
        canvas += np.array(x)[0].tolist()
        if any(t in adapter.eos_ids for t in canvas[start:]):
            break
    out = canvas[len(prompt) :][:max_tokens]
    stops = [i for i, t in enumerate(out) if t in adapter.eos_ids]
    return (out[: stops[0] + 1] if stops else out), forwards


@pytest.mark.parametrize("preset,steps,rho,t_end", [("nfe4", 4, 0.2, 0.5), ("nfe8", 8, 0.3, 0.4)])
def test_a_seeded_decode_is_the_reference_loop(checkpoint, preset, steps, rho, t_end):
    _, (model, tokenizer) = checkpoint
    adapter = adapter_for(model, tokenizer)
    for prompt_text, seed in (("Hello there", 0), ("abc", 3)):
        prompt = tokenizer.encode(prompt_text)
        mx.random.seed(seed)
        expected, oracle_forwards = _oracle(adapter, prompt, 80, steps, rho, 0.8, t_end)
        out = list(mld.stream_generate(model, tokenizer, prompt, max_tokens=80, preset=preset, seed=seed))
        assert [r.token for r in out] == expected, (preset, prompt_text)
        assert out[-1].forwards == oracle_forwards and oracle_forwards % (steps + 1) == 0


def test_blocks_end_at_the_end_token(checkpoint):
    """The decode stops after the first block holding an end token and the answer ends at it;
    each block costs steps + 1 forwards (the readout)."""
    _, (model, tokenizer) = checkpoint
    eos = adapter_for(model, tokenizer).eos_ids
    ended = 0
    for seed in range(6):
        out = list(mld.stream_generate(model, tokenizer, "Hello", max_tokens=160, seed=seed))
        tokens = [r.token for r in out]
        blocks = out[-1].forwards // 9
        assert out[-1].forwards == blocks * 9 and len(tokens) <= blocks * 32
        if tokens[-1] in eos:
            ended += 1
            assert not any(t in eos for t in tokens[:-1]) and len(tokens) > (blocks - 1) * 32
    assert ended >= 1


def test_refusals_and_presets(checkpoint):
    _, (model, tokenizer) = checkpoint
    with pytest.raises(ValueError, match="threshold does not apply to LFM2.5-Diffusion's DUO sampler"):
        mld.generate(model, tokenizer, "abc", max_tokens=8, threshold=0.9)
    with pytest.raises(ValueError, match="Unknown preset 'fast'"):
        mld.generate(model, tokenizer, "abc", max_tokens=8, preset="fast")
    for preset, per_block in (("nfe4", 5), ("nfe32", 33)):
        out = list(mld.stream_generate(model, tokenizer, "abc", max_tokens=32, preset=preset, seed=0))
        assert out[-1].forwards == per_block


def test_float32_posterior_runs_and_is_measured_elsewhere(checkpoint):
    """duo_float64=False draws in float32 on the default device (bench/bench_lfm2_diffusion.py
    measures how often its tokens differ from float64's)."""
    _, (model, tokenizer) = checkpoint
    text = mld.generate(model, tokenizer, "abc", max_tokens=32, duo_float64=False, seed=0)
    assert isinstance(text, str)


def test_convert_quantize_cli_and_server(checkpoint, tmp_path):
    from cli_run import run_main
    from server_runs import post_json, running_server

    from mlx_lm_diffusion.cli.convert import convert

    path, (model, tokenizer) = checkpoint
    convert(str(path), str(tmp_path / "mlx"))
    convert(str(path), str(tmp_path / "q4"), quantize=True, q_bits=4)
    expected = mld.generate(model, tokenizer, "abc", max_tokens=24, seed=2)
    copy = mld.load(str(tmp_path / "mlx"))
    assert type(copy[0]).__module__ == "model_adapters.families.lfm2_diffusion"
    assert mld.generate(*copy, "abc", max_tokens=24, seed=2) == expected
    assert isinstance(mld.generate(*mld.load(str(tmp_path / "q4")), "abc", max_tokens=24, seed=2), str)
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(path),
        "--prompt",
        "abc",
        "--max-tokens",
        "24",
        "--ignore-chat-template",
        "--seed",
        "2",
        "--verbose",
        "False",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected
    with running_server(["--model", str(path), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        status, body = post_json(
            httpd.server_address[1], "/v1/completions", {"prompt": "abc", "max_tokens": 24, "seed": 2}
        )
    assert status == 200 and body["choices"][0]["text"] == expected
