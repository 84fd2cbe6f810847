"""DiffusionGemma: forward parity against transformers' DiffusionGemmaForBlockDiffusion on a
checkpoint written with save_pretrained (prefill, a step with self-conditioning, a second
canvas over the encoded first); token parity with mlx-vlm's entropy-bound sampler under the
same seed; an independent oracle of transformers' generation loop in batch (rows that stop
are frozen); streaming, EOS, options, conversion and the CLI.
"""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, VOCAB
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma
from model_adapters import adapter_for
from model_adapters.families.diffusion_gemma import Adapter

torch = pytest.importorskip("torch")

CANVAS = 16  # the test checkpoint's canvas_length (256 in the released ones)
PROMPTS = [[72, 101, 108, 108, 111], [5, 17, 99, 200, 31, 7, 64, 250, 12]]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return write_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"))


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return mld.load(str(gemma_path))


# ---------------------------------------------------------------------------- forward


def test_forward_matches_transformers(gemma_path, gemma):
    """Prompts longer than the sliding window (8), batch 2, fp32: max |Δ| <= 1e-4."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    model, _ = gemma
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(gemma_path)).eval()
    rng = np.random.default_rng(0)
    prompt, canvas, canvas2 = (rng.integers(0, VOCAB, (2, n)) for n in (11, CANVAS, CANVAS))
    T = torch.from_numpy
    with torch.no_grad():  # prefill: the prompt encoded, a first step without self-conditioning
        first = ref(input_ids=T(prompt), decoder_input_ids=T(canvas)).logits.numpy()
    ours = np.array(model(mx.array(prompt), canvas=mx.array(canvas)))
    assert np.abs(ours - first).max() <= 1e-4
    sc = first / 0.7  # a step with self-conditioning (temperature-scaled logits)
    with torch.no_grad():
        theirs = ref(input_ids=T(prompt), decoder_input_ids=T(canvas), self_conditioning_logits=T(sc)).logits
    ours = np.array(model(mx.array(prompt), canvas=mx.array(canvas), self_conditioning=mx.array(sc)))
    assert np.abs(ours - theirs.numpy()).max() <= 1e-4
    with torch.no_grad():  # the next canvas, on top of the encoded first one
        cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
        ref.model.encoder(input_ids=T(prompt), cache=cache)
        ref.model.encoder(input_ids=T(canvas), cache=cache)
        theirs = ref(cache=cache, decoder_input_ids=T(canvas2), self_conditioning_logits=T(sc)).logits
    cache = model.make_kv_cache()
    model.encode(mx.array(prompt), cache)
    model.encode(mx.array(canvas), cache)
    ours = np.array(model.decode(mx.array(canvas2), cache, mx.array(sc)))
    assert np.abs(ours - theirs.numpy()).max() <= 1e-4


def test_released_config_layout_reads_the_same(gemma_path, gemma):
    """transformers 5.24 writes the global head size and KV heads only in per_layer_config;
    the released configs have them top-level: both give the same model."""
    from model_adapters.families.diffusion_gemma import ModelArgs

    cfg = json.loads((gemma_path / "config.json").read_text())
    text = dict(cfg["text_config"])
    layer = text.pop("per_layer_config")["1"]
    text.update(global_head_dim=layer["head_dim"], num_global_key_value_heads=layer["num_key_value_heads"])
    top = ModelArgs.from_dict({**cfg, "text_config": text}).text
    args = gemma[0].args.text
    assert (
        (top.global_head_dim, top.num_global_key_value_heads)
        == (args.global_head_dim, args.num_global_key_value_heads)
        == (32, 1)
    )


def test_sanitize_drops_tied_and_vision_weights_and_is_idempotent(gemma_path, gemma):
    from mlx.utils import tree_flatten

    model, _ = gemma
    params = dict(tree_flatten(model.parameters()))
    raw = mx.load(str(gemma_path / "model.safetensors"))
    assert any("vision_tower" in k for k in raw) and "model.encoder.language_model.layers.0.layer_scalar" in raw
    once = model.sanitize(raw)
    assert set(once) == set(params)
    assert set(model.sanitize(dict(once))) == set(params)
    # one tensor per expert (as some exports store them) stacks into the same weights
    per_expert = {k: v for k, v in once.items() if ".switch_glu." not in k}
    for k, v in once.items():
        if ".switch_glu." in k:
            base, rest = k.split(".switch_glu.")
            per_expert.update({f"{base}.{e}.{rest}": v[e] for e in range(v.shape[0])})
    restacked = model.sanitize(per_expert)
    assert set(restacked) == set(params)
    assert all(mx.array_equal(restacked[k], once[k]) for k in once)
    # the encoder keeps its own layer scalars, distinct from the decoder's
    assert float(once["model.encoder.language_model.layers.0.layer_scalar"][0]) != float(
        once["model.decoder.layers.0.layer_scalar"][0]
    )


def test_no_mask_token(gemma):
    model, tok = gemma
    adapter = adapter_for(model, tok)
    assert adapter.mask_id is None and EOS_ID in adapter.eos_ids
    assert adapter.defaults.block_length == CANVAS


# ---------------------------------------------------------------------------- decoding


def _engine_decode(model, tok, prompts, **options):
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()  # the references fill every canvas
    resolved = resolve(DecodeOptions(**options), adapter, len(prompts[0]))
    last = None
    for last in Engine(adapter, resolved).run(mx.array(prompts)):
        pass
    P, N = len(prompts[0]), options["max_tokens"]
    return last.canvas[:, P : P + N].tolist(), last.forwards


class _NoText:
    """The tokenizer surface mlx-vlm's loop touches, without stop tokens (as the engine here)."""

    class detokenizer:
        last_segment = ""

        @staticmethod
        def reset():
            pass

        @staticmethod
        def finalize():
            pass

        @staticmethod
        def add_token(token, skip_special_token_ids=None):
            pass

    @staticmethod
    def stopping_criteria(token):
        return False


@pytest.fixture(scope="module")
def mlx_vlm_model(gemma_path):
    from mlx_vlm.models import diffusion_gemma as ref

    cfg = json.loads((gemma_path / "config.json").read_text())
    cfg["vision_config"] = None
    layer = cfg["text_config"]["per_layer_config"]["1"]  # mlx-vlm reads these top-level only
    cfg["text_config"].update(
        global_head_dim=layer["head_dim"], num_global_key_value_heads=layer["num_key_value_heads"]
    )
    model = ref.Model(ref.ModelConfig.from_dict(cfg))
    model.load_weights(list(model.sanitize(mx.load(str(gemma_path / "model.safetensors"))).items()), strict=True)
    model.config.generation_config = {"stability_threshold": 1, "confidence_threshold": 0.005}
    return model


def _mlx_vlm_decode(model, prompt, max_tokens, seed):
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    mx.random.seed(seed)
    tokens, last = [], None
    for last in stream_diffusion_generate(
        model,
        _NoText,
        _NoText,
        mx.array([prompt]),
        None,
        None,
        max_tokens=max_tokens,
        temperature=1.0,  # the reference's draw: a sample of softmax(scaled logits)
        skip_special_token_ids=[],
        max_denoising_steps=48,
        diffusion_full_canvas=True,
        diffusion_sampler="entropy-bound",
    ):
        if not (last.is_draft or last.diffusion_block_complete or last.finish_reason):
            tokens.append(last.token)
    return tokens, last.diffusion_denoising_steps


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("canvases", [1, 3])
def test_tokens_match_mlx_vlm_entropy_bound_sampler(gemma, mlx_vlm_model, prompt, seed, canvases):
    """Same seed, same tokens and same denoising steps. Each canvas here stops on the
    stable-and-confident criterion before its last step, where mlx-vlm skips the draws the
    reference makes (so after a canvas that runs all 48 steps the random streams part)."""
    model, tok = gemma
    theirs, their_steps = _mlx_vlm_decode(mlx_vlm_model, prompt, CANVAS * canvases, seed)
    (tokens,), forwards = _engine_decode(model, tok, [prompt], max_tokens=CANVAS * canvases, seed=seed)
    assert tokens == theirs
    assert forwards == their_steps < 48 * canvases


def _entropy(z):
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


def diffusion_gemma_generate(
    model,
    prompts,
    *,
    max_new_tokens,
    canvas_length,
    steps=48,
    entropy_bound=0.1,
    t_min=0.4,
    t_max=0.8,
    confidence=0.005,
    seed=0,
):
    """transformers' DiffusionGemma `generate` (no EOS, stability threshold 1), batched, with
    MLX's PRNG drawn in the reference's order. Every canvas re-encodes the whole prefix into a
    fresh cache. Returns (tokens per row, decoder forwards)."""
    mx.random.seed(seed)
    x = np.array(prompts)
    B, V, forwards = len(prompts), model.vocab_size, 0
    for _ in range(math.ceil(max_new_tokens / canvas_length)):
        cache = model.make_kv_cache()
        model.encode(mx.array(x), cache)
        canvas = np.array(mx.random.randint(0, V, (B, canvas_length)))
        argmax, sc, previous = canvas, None, None
        finished = np.zeros(B, dtype=bool)
        for remaining in range(steps, 0, -1):
            logits = np.array(model.decode(mx.array(canvas), cache, None if sc is None else mx.array(sc)))
            forwards += 1
            z = logits / (t_min + (t_max - t_min) * remaining / steps)
            sample = np.array(mx.random.categorical(mx.array(z)))
            entropy = _entropy(z)
            order = np.argsort(entropy, axis=-1, kind="stable")
            ranked = np.take_along_axis(entropy, order, -1)
            accept = np.zeros_like(canvas, dtype=bool)
            np.put_along_axis(accept, order, np.cumsum(ranked, -1) - ranked <= entropy_bound, -1)
            noise = np.array(mx.random.randint(0, V, (B, canvas_length)))
            new_canvas = np.where(accept, sample, noise)
            new_argmax = z.argmax(-1)
            if sc is not None:  # rows that stopped keep everything
                new_argmax = np.where(finished[:, None], argmax, new_argmax)
                new_canvas = np.where(finished[:, None], canvas, new_canvas)
                z = np.where(finished[:, None, None], sc, z)
            stable = np.zeros(B, bool) if previous is None else (previous == new_argmax).all(-1)
            finished |= stable & (_entropy(z).mean(-1) < confidence)
            previous = argmax = new_argmax
            canvas, sc = new_canvas, z.astype(np.float32)
            if finished.all():
                break
        x = np.concatenate([x, argmax], axis=1)
    return x[:, len(prompts[0]) : len(prompts[0]) + max_new_tokens].tolist(), forwards


@pytest.mark.parametrize("seed", [0, 3])
def test_batch_follows_the_reference_loop(gemma, seed):
    """Two rows in one batch: a row that meets the stopping criterion is frozen while the
    other continues, over several canvases; max_tokens not a multiple of the canvas."""
    model, tok = gemma
    prompts = [PROMPTS[0], [80, 81, 82, 83, 84]]
    ref_tokens, ref_forwards = diffusion_gemma_generate(
        model, prompts, max_new_tokens=40, canvas_length=CANVAS, seed=seed
    )
    tokens, forwards = _engine_decode(model, tok, prompts, max_tokens=40, seed=seed)
    assert tokens == ref_tokens
    assert forwards == ref_forwards


def test_stream_contract(gemma):
    """Tokens are emitted only once their canvas is final, left to right; the draft (the
    argmax canvas, up to the current canvas) arrives after every forward."""
    model, tok = gemma
    prompt = PROMPTS[0]
    P = len(prompt)
    drafts = []
    responses = list(
        mld.stream_generate(
            model, tok, prompt, max_tokens=40, seed=0, draft_callback=lambda s: drafts.append(s.canvas.copy())
        )
    )
    assert len(drafts) == responses[-1].forwards
    reached = [d.shape[1] - P for d in drafts]  # drafts reach the end of the current canvas
    assert reached == sorted(reached) and set(reached) <= {16, 32, 48}
    tokens = [r.token for r in responses]
    assert tokens == drafts[-1][0, P : P + len(tokens)].tolist()
    groups = np.unique([r.forwards for r in responses], return_counts=True)[1]
    assert all(n == CANVAS for n in groups[:-1])  # a whole canvas at a time
    for i, r in enumerate(responses):
        for canvas in drafts[r.forwards - 1 :]:
            assert canvas[0, P + i] == r.token
    assert responses[-1].finish_reason in ("stop", "length")
    assert [r.generation_tokens for r in responses] == list(range(1, len(tokens) + 1))
    assert abs(float(mx.exp(responses[-1].logprobs).sum()) - 1) < 1e-4
    text = "".join(r.text for r in responses)
    assert text == mld.generate(model, tok, prompt, max_tokens=40, seed=0)


def test_eos_cuts_the_canvas_and_stops(gemma, monkeypatch):
    model, tok = gemma
    predict = Adapter.predict

    def eos_at_five(self, state, canvas, start, end):  # the model makes canvas position 5 EOS
        logits = predict(self, state, canvas, start, end)
        bias = mx.zeros(logits.shape)
        bias[:, 5, EOS_ID] = 1e4
        return logits + bias

    monkeypatch.setattr(Adapter, "predict", eos_at_five)
    responses = list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=48, seed=0))
    assert [r.finish_reason for r in responses][-1] == "stop" and len(responses) == 6
    assert responses[-1].token == EOS_ID and tok.decode([EOS_ID]) not in "".join(r.text for r in responses)
    assert responses[-1].forwards <= 48  # one canvas only


def test_options_and_seeds(gemma):
    model, tok = gemma
    kw = dict(max_tokens=16)
    out = mld.generate_batch(model, tok, [PROMPTS[0]], steps=3, seed=0, return_token_ids=True, **kw)
    rows, forwards = out.token_ids, out.forwards[0]
    assert forwards <= 3 and len(rows[0]) == 16
    a = mld.generate(model, tok, PROMPTS[0], seed=5, **kw)
    assert a == mld.generate(model, tok, PROMPTS[0], seed=5, **kw)
    assert a != mld.generate(model, tok, PROMPTS[0], seed=6, **kw)
    adapter = adapter_for(model, tok)
    resolved = resolve(DecodeOptions(entropy_bound=0.5, **kw), adapter, 5)
    assert resolved.rule.bound == 0.5  # (the rule holds the one entropy bound)
    resolved = resolve(DecodeOptions(**kw), adapter, 5)
    assert resolved.rule.bound == 0.1 and resolved.steps == 48 and resolved.block_length == CANVAS
    assert dict(resolved.family) == dict(
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        fast_self_conditioning=False,
        self_conditioning_k=256,
        fast_step=False,
    )  # (exact)
    capped = resolve(DecodeOptions(max_tokens=100000), adapter, 5)  # whole canvases that fit the context
    assert capped.max_tokens == (adapter.max_length - 5) // CANVAS * CANVAS


@pytest.mark.parametrize(
    "options,word",
    [
        (dict(editing_threshold=0.5), "uniform noise"),
        (dict(causal_context=True), "causal_context"),
        (dict(entropy_bound=-1.0), "entropy_bound"),
        (dict(max_tokens=8, block_length=4096), "context"),  # (a canvas larger than the context)
        (dict(steps=0), "steps"),
    ],
)
def test_bad_options(gemma, options, word):
    model, tok = gemma
    with pytest.raises(ValueError, match=word):
        next(mld.stream_generate(model, tok, PROMPTS[0], **(dict(max_tokens=8) | options)))
    with pytest.raises(ValueError, match="vocabulary"):
        mld.generate(model, tok, [VOCAB + 1], max_tokens=4)


def test_quantized_convert_and_reload(tmp_path, gemma_path, gemma):
    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / "q8"
    convert(str(gemma_path), str(out), quantize=True, q_bits=8, q_group_size=32)
    model, tok = mld.load(str(out))
    assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    prompt, canvas = mx.array([PROMPTS[1]]), mx.array([list(range(CANVAS))])
    sc = gemma[0](prompt, canvas=canvas)
    ours, full = (
        model(prompt, canvas=canvas, self_conditioning=sc),
        gemma[0](prompt, canvas=canvas, self_conditioning=sc),
    )
    # quantization noise (which also flips some expert choices), not a different model
    assert np.corrcoef(np.array(ours).ravel(), np.array(full).ravel())[0, 1] > 0.95
    assert isinstance(mld.generate(model, tok, PROMPTS[0], max_tokens=8, seed=0), str)


def test_cli_generates_and_shows_the_canvas(gemma_path):
    from cli_run import run_main

    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(gemma_path),
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--steps",
        "4",
        "--seed",
        "0",
        "--show-canvas",
    )
    assert r.returncode == 0, r.stderr
    assert "forwards" in r.stdout and "[forward 1]" in r.stderr and "Traceback" not in r.stderr


def test_a_sampler_returning_an_id_outside_the_vocabulary_is_a_clear_error(gemma):
    model, tok = gemma
    sampler = lambda logprobs: mx.full((logprobs.shape[0],), VOCAB, mx.int32)  # noqa: E731
    with pytest.raises(ValueError, match="sampler returned token ids"):
        mld.generate(model, tok, PROMPTS[0], max_tokens=8, sampler=sampler, seed=0)
