"""Tokens/s of the engine against mlx-vlm's own loops, same checkpoints, same run (a benchmark,
not a test): Nemotron-Labs Diffusion (mlx-vlm's `generate`, diffusion mode) and DiffusionGemma
(mlx-vlm's entropy-bound sampler, same seed). Both sides decode the same number of tokens
with EOS off; "same" says whether the tokens agree (DiffusionGemma: the first canvas; a
canvas that runs all its steps ends without mlx-vlm drawing the reference's last sample and
noise, so later canvases start from different random streams). Best of 3
alternating runs after a warm-up; the ratio is mlx-vlm's time over ours.

DiffusionGemma with an image: the same, on a checkpoint with its vision tower and processor
(the prompt holds an image's soft tokens; both sides get the processor's pixel values);
at the checkpoint's 288-token vocabulary, and at DiffusionGemma's released 262,144 on an
otherwise tiny model (hidden 128, 2 layers: the vocabulary's work dominates the step, as
the real model's head does; one 32-token canvas, 16 steps on both sides), where the goal's
ratios (ours exact and ours fast step against mlx-vlm's exact loop, ours fast against ours
exact) are printed by wall clock and CPU seconds, with the top-256 softmax mass of the
first step and the fast step's token agreement with our exact step, on the random
checkpoint and on the same one made flat (its final norm x 0.1).

The cheaper steps (--fast-self-conditioning: top-k self-conditioning; --fast-step: the whole
step on the top-k logits): on a checkpoint with a 65,536-token vocabulary, the time of one
denoising step (decoder forward with self-conditioning and the step's vocabulary work)
exact against each, the top-k softmax mass and the relative error of the top-k
self-conditioning vector; and (4,096-token vocabulary, to keep many whole decodes
affordable) the token agreement of whole seeded decodes with the exact path (positions
equal, decodes equal) over many seeds, next to a control: the exact path
with its self-conditioning logits scaled by (1 + 1e-4). CPU seconds are printed too: on a
shared machine the wall clock of one side can double while the other runs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_vs_mlx_vlm.py [--gemma-only] [--self-spec-only] [--quick] [--runs N]

Nemotron self-speculation (`self_spec`): tokens per forward and tok/s against our
block-length-1 autoregressive decode and mlx-vlm's `linear_spec_generate`, on a micro
Nemotron with random, partly and wholly predictable weights (--self-spec-only: just that).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.decoding.engine import Engine  # noqa: E402
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve  # noqa: E402
from mlx_lm_diffusion.testing.gemma_vision_checkpoints import make_image, write_gemma_with_vision  # noqa: E402
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma, write_nemotron  # noqa: E402
from model_adapters import adapter_for  # noqa: E402
from model_adapters.gemma_vision import VisionInputs  # noqa: E402

PROMPT = list(range(40, 72))
NEMOTRON_GEN, GEMMA_GEN, GEMMA_CANVAS = 128, 128, 64


def engine(model, tok, prompt=PROMPT, vision=None, perturb=None, **options):
    """The engine without EOS (both sides decode every token); returns (tokens, forwards).
    `perturb`: scale the self-conditioning logits by (1 + perturb) (a control)."""
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()
    if perturb is not None:
        condition = adapter.condition
        adapter.condition = lambda state, z: condition(state, z * (1.0 + perturb))
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    last = None
    for last in Engine(adapter, resolved, keep_logprobs=False, vision=vision).run(mx.array([prompt])):
        pass
    n = options["max_tokens"]
    return last.canvas[0, len(prompt) : len(prompt) + n].tolist(), last.forwards


RUNS = 1 if "--quick" in sys.argv[1:] else 3  # --quick: one timed run each, fewer seeds
if "--runs" in sys.argv[1:]:  # --runs N: N timed runs each, whatever --quick says
    RUNS = int(sys.argv[sys.argv.index("--runs") + 1])


CPU_TIMES: dict = {}  # name -> (our CPU seconds, theirs): the shared machine's wall clock is noisy


def alternate(ours, theirs, runs=None, name=None):
    """Warm both up, then time them in turn `runs` times (the machine is noisy); returns the
    best wall seconds of each and their last results (the best CPU seconds in CPU_TIMES)."""
    ours(), theirs()
    t_ours = t_theirs = c_ours = c_theirs = float("inf")
    for _ in range(runs or RUNS):
        tic, cpu = time.perf_counter(), time.process_time()
        a = ours()
        t_ours, c_ours = min(t_ours, time.perf_counter() - tic), min(c_ours, time.process_time() - cpu)
        tic, cpu = time.perf_counter(), time.process_time()
        b = theirs()
        t_theirs, c_theirs = min(t_theirs, time.perf_counter() - tic), min(c_theirs, time.process_time() - cpu)
    if name is not None:
        CPU_TIMES[name] = (c_ours, c_theirs)
    return t_ours, t_theirs, a, b


def nemotron_rows(tmp: Path):
    from mlx_vlm.models import nemotron_labs_diffusion as ref

    path = write_nemotron(tmp / "nemotron", hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, inter=512)
    model, tok = mld.load(str(path))
    vlm = ref.Model(ref.ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
    vlm.load_weights(list(vlm.sanitize(mx.load(str(path / "model.safetensors"))).items()))
    lm = vlm.language_model
    rows = []
    for threshold in (0.9, None):
        rule = {"threshold": threshold} if threshold is not None else {"strategy": "low_confidence"}
        ours = lambda: engine(model, tok, max_tokens=NEMOTRON_GEN, block_length=32, **rule)  # noqa: E731
        for parity in (True, False):

            def theirs(parity=parity):
                stats = {}
                out = lm.generate(
                    mx.array([PROMPT]),
                    block_length=32,
                    steps=32,
                    gen_length=NEMOTRON_GEN,
                    threshold=threshold,
                    eos_id=-1,
                    stats=stats,
                    transformers_parity=parity,
                )
                return out[0].tolist(), int(stats["diffusion_denoise_nfe"])

            t_ours, t_theirs, (a, fa), (b, fb) = alternate(ours, theirs)
            name = f"Nemotron {'threshold 0.9' if threshold else 'quota'}, vlm parity={parity}"
            rows.append((name, a == b, NEMOTRON_GEN, fa, fb, t_ours, t_theirs))
    return rows


SPEC_GEN = 128
SPEC_DIMS = dict(hidden=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, inter=1536)


def self_spec_rows(tmp: Path):
    """Self-speculation (`self_spec`, block 32) against our block-length-1 autoregressive
    decode and mlx-vlm's linear_spec_generate, on a micro Nemotron three ways: random weights
    (drafts almost never accepted: the worst case, two forwards per token), and made partly
    and wholly predictable (mlx_lm_diffusion.testing.nemotron_gemma_checkpoints.write_speculable_nemotron). Forwards exclude the prompt's
    causal pass on every side (mlx-vlm's nfe counts it: shown less one)."""
    from mlx_vlm.models import nemotron_labs_diffusion as ref

    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_speculable_nemotron

    writers = {
        "random": lambda p: write_nemotron(p, **SPEC_DIMS),
        "partial": lambda p: write_speculable_nemotron(p, attractors=tuple(range(40, 48)), strength=0.45, **SPEC_DIMS),
        "whole": lambda p: write_speculable_nemotron(p, attractors=(40,), strength=3.0, **SPEC_DIMS),
    }
    rows = []
    for kind, write in writers.items():
        path = write(tmp / f"spec_{kind}")
        model, tok = mld.load(str(path))
        vlm = ref.Model(ref.ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
        vlm.load_weights(list(vlm.sanitize(mx.load(str(path / "model.safetensors"))).items()))
        lm = vlm.language_model

        def theirs():
            out, nfe = lm.linear_spec_generate(
                mx.array([PROMPT]), max_new_tokens=SPEC_GEN, block_length=32, eos_token_id=-1
            )
            return out[0, len(PROMPT) :].tolist(), nfe - 1

        spec = lambda: engine(model, tok, max_tokens=SPEC_GEN, block_length=32, self_spec=True)  # noqa: E731
        ar = lambda: engine(model, tok, max_tokens=SPEC_GEN, block_length=1)  # noqa: E731
        t_spec, t_vlm, (a, fa), (b, fb) = alternate(spec, theirs)
        t_spec2, t_ar, _, (c, _) = alternate(spec, ar)
        t_spec = min(t_spec, t_spec2)
        # (our autoregressive decode counts no denoising forward: one causal pass a token)
        rows.append((kind, a == b == c, fa, fb, t_spec, t_ar, t_vlm))
    return rows


def show_self_spec(rows):
    print(
        f"\nself-speculation, micro Nemotron (hidden {SPEC_DIMS['hidden']}, {SPEC_DIMS['n_layers']} layers), "
        f"{SPEC_GEN} tokens, block 32; tok/fwd excludes the prompt pass"
    )
    print(
        f"{'weights':8} {'same':>5} {'fwd':>4} {'vlm fwd':>7} {'tok/fwd':>7} {'AR tok/fwd':>10} {'tok/s':>7} "
        f"{'AR tok/s':>8} {'vlm tok/s':>9} {'vs AR':>6} {'vs vlm':>6}",
        flush=True,
    )
    for kind, same, fa, fb, t_spec, t_ar, t_vlm in rows:
        print(
            f"{kind:8} {str(same):>5} {fa:4d} {fb:7d} {SPEC_GEN / fa:7.2f} {SPEC_GEN / (SPEC_GEN - 1):10.2f} "
            f"{SPEC_GEN / t_spec:7.1f} {SPEC_GEN / t_ar:8.1f} {SPEC_GEN / t_vlm:9.1f} {t_ar / t_spec:6.2f} "
            f"{t_vlm / t_spec:6.2f}",
            flush=True,
        )


GEMMA_DIMS = dict(
    canvas_length=GEMMA_CANVAS,
    sliding_window=64,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=2,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=128,
)


def mlx_vlm_gemma(path: Path, vision: bool):
    from mlx_vlm.models import diffusion_gemma as ref

    cfg = json.loads((path / "config.json").read_text())
    if not vision:
        cfg["vision_config"] = None
    full = cfg["text_config"]["layer_types"].index("full_attention")
    layer = cfg["text_config"]["per_layer_config"][str(full)]
    cfg["text_config"].update(
        global_head_dim=layer["head_dim"], num_global_key_value_heads=layer["num_key_value_heads"]
    )
    vlm = ref.Model(ref.ModelConfig.from_dict(cfg))
    vlm.load_weights(list(vlm.sanitize(mx.load(str(path / "model.safetensors"))).items()))
    vlm.config.generation_config = {"stability_threshold": 1, "confidence_threshold": 0.005}
    return vlm


class NoText:
    class detokenizer:
        last_segment = ""
        reset = finalize = staticmethod(lambda: None)
        add_token = staticmethod(lambda token, skip_special_token_ids=None: None)

    stopping_criteria = staticmethod(lambda token: False)


def mlx_vlm_decode(vlm, prompt, pixel_values=None, types=None, gen=GEMMA_GEN, steps=48):
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    mx.random.seed(0)
    tokens, last = [], None
    for last in stream_diffusion_generate(
        vlm,
        NoText,
        NoText,
        mx.array([prompt]),
        pixel_values,
        None,
        max_tokens=gen,
        temperature=1.0,
        skip_special_token_ids=[],
        max_denoising_steps=steps,
        diffusion_full_canvas=True,
        diffusion_sampler="entropy-bound",
        mm_token_type_ids=types,
    ):
        if not (last.is_draft or last.diffusion_block_complete or last.finish_reason):
            tokens.append(last.token)
    return tokens, last.diffusion_denoising_steps


def gemma_row(name, model, tok, vlm, prompt, vision=None, gen=GEMMA_GEN, canvas=GEMMA_CANVAS, steps=48, **fast):
    """One row, ours against mlx-vlm's exact loop; the row and our tokens (for agreement)."""
    pixels, types = (vision.pixel_values, vision.mm_token_type_ids) if vision is not None else (None, None)
    theirs = lambda: mlx_vlm_decode(vlm, prompt, pixels, types, gen, steps)  # noqa: E731
    ours = lambda: engine(model, tok, prompt, vision, max_tokens=gen, seed=0, steps=steps, **fast)  # noqa: E731
    t_ours, t_theirs, (a, fa), (b, fb) = alternate(ours, theirs, name=name)
    # after a canvas that runs all its steps, mlx-vlm skips the reference's last draws and
    # the random streams part: "same" compares the first canvas, which both start alike
    same = a[:canvas] == b[:canvas]
    TOKENS[name] = a
    return (name, same, gen, fa, fb, t_ours, t_theirs)


TOKENS: dict = {}  # row name -> our tokens


def gemma_rows(tmp: Path):
    path = write_diffusion_gemma(tmp / "gemma", **GEMMA_DIMS)
    model, tok = mld.load(str(path))
    vlm = mlx_vlm_gemma(path, vision=False)
    name = f"DiffusionGemma entropy-bound ({GEMMA_GEN // GEMMA_CANVAS} canvases)"
    return [gemma_row(name, model, tok, vlm, PROMPT)]


def image_prompt(processor):
    out = processor(text=["<|image|>Describe the picture in detail."], images=[make_image(40, 24)])
    vision = VisionInputs(mx.array(out["pixel_values"]), mx.array(out["mm_token_type_ids"]))
    return mx.array(out["input_ids"])[0].tolist(), vision


def gemma_image_rows(tmp: Path):
    path = write_gemma_with_vision(tmp / "gemma_vision", **GEMMA_DIMS)
    model, processor = mld.load(str(path))
    vlm = mlx_vlm_gemma(path, vision=True)
    prompt, vision = image_prompt(processor)
    return [
        gemma_row("DiffusionGemma + image, exact step", model, processor, vlm, prompt, vision),
        gemma_row(
            "DiffusionGemma + image, fast self-cond. k=256",
            model,
            processor,
            vlm,
            prompt,
            vision,
            fast_self_conditioning=True,
        ),
        gemma_row("DiffusionGemma + image, fast step k=256", model, processor, vlm, prompt, vision, fast_step=True),
    ]


# DiffusionGemma's released vocabulary (transformers' DiffusionGemmaConfig default, 262,144)
# on an otherwise tiny model (hidden 128, 2 layers, the tiny vision tower): the vocabulary's
# work (the tied head, softcap, softmax, entropy, sampling, self-conditioning) dominates the
# step, as it does the real model's head. One 32-token canvas, 16 steps on both sides.
WIDE_VOCAB, WIDE_CANVAS, WIDE_STEPS = 262144, 32, 16
WIDE_DIMS = dict(
    canvas_length=WIDE_CANVAS,
    sliding_window=WIDE_CANVAS,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    layer_types=["sliding_attention", "full_attention"],
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=64,
)
FLAT_SCALE = 0.1  # the decoder's final norm x 0.1: logits 10x narrower, a flat softmax


def wide_image_rows(tmp: Path):
    """DiffusionGemma + image at the released vocabulary: exact and fast step against
    mlx-vlm's exact loop; then the top-256 mass of the first step's tempered logits and the
    agreement of the fast step's tokens with our exact step's, on this random checkpoint
    and on the same one made flat (its final norm scaled, our side only: not timed)."""
    path = write_gemma_with_vision(tmp / "gemma_vision_wide", vocab_size=WIDE_VOCAB, **WIDE_DIMS)
    model, processor = mld.load(str(path))
    vlm = mlx_vlm_gemma(path, vision=True)
    prompt, vision = image_prompt(processor)
    same = dict(gen=WIDE_CANVAS, canvas=WIDE_CANVAS, steps=WIDE_STEPS)
    exact, fast = (f"DiffusionGemma + image @{WIDE_VOCAB}, {kind}" for kind in ("exact step", "fast step k=256"))
    rows = [
        gemma_row(exact, model, processor, vlm, prompt, vision, **same),
        gemma_row(fast, model, processor, vlm, prompt, vision, fast_step=True, **same),
    ]
    quality = {"random": head_quality(model, processor, prompt, vision, TOKENS[exact], TOKENS[fast])}
    norm = model.model.decoder.norm
    norm.weight = norm.weight * FLAT_SCALE
    quality[f"flat (final norm x {FLAT_SCALE})"] = head_quality(model, processor, prompt, vision)
    return rows, quality


def head_quality(model, processor, prompt, vision, exact=None, fast=None, k=256):
    """(top-k softmax mass of the first step's logits at its temperature, averaged over the
    canvas; the share of the fast step's tokens equal to the exact step's, same seed; the
    same share for two controls: the exact step with its self-conditioning logits x
    (1 + 1e-4), and the exact step under another seed (what a different random stream alone
    does: the fast step draws its samples over k, not V, so its stream parts at step one))."""
    cache = model.make_kv_cache()
    model.encode(mx.array([prompt]), cache, vision)
    noise = mx.random.randint(0, model.vocab_size, (1, WIDE_CANVAS))
    z = model.decode(noise, cache) / 0.8  # (t_max: the first step's temperature)
    mass = float(mx.sort(mx.softmax(z, axis=-1), axis=-1)[..., -k:].sum(axis=-1).mean())

    def run(seed=0, **options):
        return engine(model, processor, prompt, vision, max_tokens=WIDE_CANVAS, seed=seed, steps=WIDE_STEPS, **options)[
            0
        ]

    exact = run() if exact is None else exact
    fast = run(fast_step=True) if fast is None else fast
    share = lambda other: sum(x == y for x, y in zip(exact, other)) / len(exact)  # noqa: E731
    return mass, share(fast), share(run(perturb=1e-4)), share(run(seed=1))


STEP_VOCAB = 65536  # the time per step
AGREEMENT_VOCAB = 4096  # the agreement (many whole decodes: a smaller head keeps them affordable)
AGREEMENT_SEEDS = 8 if "--quick" in sys.argv[1:] else 24


def cheaper_step_rows(tmp: Path):
    """Per k: ms per denoising step (decoder forward with self-conditioning and the step's
    vocabulary work: softmax, entropy, argmax, sample) exact, top-k self-conditioning and
    the top-k step; the token agreement of whole seeded decodes with the exact path; and a
    control: the exact path with its self-conditioning logits scaled by (1 + 1e-4)."""
    path = write_diffusion_gemma(tmp / "gemma_big_vocab", vocab_size=STEP_VOCAB, **GEMMA_DIMS)
    model, tok = mld.load(str(path))
    cache = model.make_kv_cache()
    model.encode(mx.array([PROMPT]), cache)
    canvas = mx.random.randint(0, STEP_VOCAB, (1, GEMMA_CANVAS))
    sc = model.decode(canvas, cache) / 0.7
    mx.eval(sc)

    def vocabulary_work(z):
        logprobs = z - mx.logsumexp(z, axis=-1, keepdims=True)
        entropy = -mx.sum(mx.exp(logprobs) * logprobs, axis=-1)
        return mx.argmax(z, axis=-1), entropy, mx.random.categorical(z)

    def step(kind, k, ids_k=None):
        sc_k = None if ids_k is None else mx.take_along_axis(sc, ids_k, axis=-1)

        def run():
            for _ in range(5):
                if kind == "top-k step":
                    values, ids = model.decode_top_k(canvas, cache, (sc_k, ids_k), k)
                    mx.eval(vocabulary_work(values / 0.7), ids)
                else:
                    mx.eval(vocabulary_work(model.decode(canvas, cache, sc, k if kind == "top-k sc" else 0) / 0.7))

        return run

    small, small_tok = mld.load(str(write_diffusion_gemma(tmp / "gemma_4k", vocab_size=AGREEMENT_VOCAB, **GEMMA_DIMS)))

    def agreement(**fast):
        agree = positions = equal = 0
        for seed in range(AGREEMENT_SEEDS):
            a, _ = engine(small, small_tok, max_tokens=GEMMA_CANVAS, seed=seed)
            b, _ = engine(small, small_tok, max_tokens=GEMMA_CANVAS, seed=seed, **fast)
            agree += sum(x == y for x, y in zip(a, b))
            positions += len(a)
            equal += a == b
        return agree / positions, equal

    rows = []
    for k in (256,) if "--quick" in sys.argv[1:] else (256, 64):
        ids_k = mx.argpartition(-sc, kth=k - 1, axis=-1)[..., :k]
        t_exact, t_sc, _, _ = alternate(step("exact", k), step("top-k sc", k))
        _, t_step, _, _ = alternate(step("exact", k), step("top-k step", k, ids_k), runs=1)
        exact_soft = model._soft_embeddings(sc)
        error = float(mx.linalg.norm(model._soft_embeddings(sc, k) - exact_soft) / mx.linalg.norm(exact_soft))
        top = mx.sort(mx.softmax(sc, axis=-1), axis=-1)[..., -k:].sum(axis=-1)
        print(f"  (k={k}: timed; the agreement decodes run now)", flush=True)
        rows.append(
            (
                k,
                t_exact / 5,
                t_sc / 5,
                t_step / 5,
                float(top.mean()),
                error,
                agreement(fast_self_conditioning=True, self_conditioning_k=k),
                agreement(fast_step=True, self_conditioning_k=k),
            )
        )
    control = agreement(perturb=1e-4)
    return rows, control


def show_wide(rows, quality):
    """The goal's three ratios at the released vocabulary, by wall clock and CPU seconds."""
    (exact, *_, t_exact, t_vlm), (fast, *_, t_fast, t_vlm2) = rows
    (c_exact, c_vlm), (c_fast, c_vlm2) = CPU_TIMES[exact], CPU_TIMES[fast]
    t_vlm, c_vlm = min(t_vlm, t_vlm2), min(c_vlm, c_vlm2)  # mlx-vlm's exact loop, best of both rows
    print(
        f"\nV={WIDE_VOCAB} with an image (wall / CPU): ours exact vs mlx-vlm exact {t_vlm / t_exact:.2f} / "
        f"{c_vlm / c_exact:.2f}; ours fast step vs mlx-vlm exact {t_vlm / t_fast:.2f} / {c_vlm / c_fast:.2f}; "
        f"ours fast vs ours exact {t_exact / t_fast:.2f} / {c_exact / c_fast:.2f}"
    )
    print(
        f"  tokens equal to our exact step's (one {WIDE_CANVAS}-token canvas, seed 0): the fast step; controls: "
        "the exact step with self-conditioning x (1 + 1e-4), and with seed 1"
    )
    for kind, (mass, agree, control, reseeded) in quality.items():
        print(
            f"  {kind:26} top-256 mass {mass:.3f}; fast step {agree:6.1%}; x (1 + 1e-4) {control:6.1%}; "
            f"seed 1 {reseeded:6.1%}"
        )


def main():
    """Each table row is printed as soon as it is measured. --gemma-only: DiffusionGemma's
    rows (image, cheaper step; with the text row unless --quick)."""
    argv = sys.argv[1:]
    print(f"load (1, 5, 15 min) at start: {load()}")
    print(
        f"{'case':48} {'same':>5} {'tokens':>6} {'fwd':>5} {'vlm fwd':>7} {'tok/s':>8} {'vlm tok/s':>9} {'ratio':>6}",
        flush=True,
    )

    def show(rows):
        for name, same, tokens, fa, fb, t_ours, t_theirs in rows:
            print(
                f"{name:48} {str(same):>5} {tokens:6d} {fa:5d} {fb:7d} {tokens / t_ours:8.1f} "
                f"{tokens / t_theirs:9.1f} {t_theirs / t_ours:6.2f}",
                flush=True,
            )

    with tempfile.TemporaryDirectory() as tmp:
        if "--self-spec-only" in argv:
            show_self_spec(self_spec_rows(Path(tmp)))
            return
        if "--gemma-only" not in argv:
            show(nemotron_rows(Path(tmp)))
        if "--quick" not in argv:
            show(gemma_rows(Path(tmp)))
        show(gemma_image_rows(Path(tmp)))
        wide, quality = wide_image_rows(Path(tmp))
        show(wide)
        if CPU_TIMES:
            print("\nCPU seconds (process time, best of the runs; less noisy than the wall clock here)")
            for name, (c_ours, c_theirs) in CPU_TIMES.items():
                print(f"{name:48} ours {c_ours:7.2f}  mlx-vlm {c_theirs:7.2f}  ratio {c_theirs / c_ours:5.2f}")
        show_wide(wide, quality)
        print(
            f"\ncheaper step, canvas {GEMMA_CANVAS}: ms/step, top-k mass and self-conditioning error at "
            f"vocabulary {STEP_VOCAB}; agreement over {AGREEMENT_SEEDS} seeded decodes at vocabulary {AGREEMENT_VOCAB}"
        )
        print(
            f"{'k':>4} {'exact ms':>8} {'top-k sc ms':>11} {'top-k step ms':>13} {'top-k mass':>10} "
            f"{'sc rel err':>10} {'sc: agree / equal':>17} {'step: agree / equal':>19}",
            flush=True,
        )
        rows, control = cheaper_step_rows(Path(tmp))
        for k, t_exact, t_sc, t_step, mass, error, (a_sc, e_sc), (a_step, e_step) in rows:
            print(
                f"{k:4d} {t_exact * 1e3:8.2f} {t_sc * 1e3:11.2f} {t_step * 1e3:13.2f} {mass:10.5f} {error:10.2e} "
                f"{a_sc:10.1%} {e_sc:2d}/{AGREEMENT_SEEDS} {a_step:12.1%} {e_step:2d}/{AGREEMENT_SEEDS}",
                flush=True,
            )
        print(
            f"control: the exact path with its self-conditioning logits x (1 + 1e-4): "
            f"{control[0]:.1%} of tokens agree, {control[1]}/{AGREEMENT_SEEDS} decodes equal",
            flush=True,
        )
        if "--gemma-only" not in argv:
            show_self_spec(self_spec_rows(Path(tmp)))
    print(f"load (1, 5, 15 min) at the end: {load()}")


def load() -> str:
    """The machine's load averages (a shared machine: the times are loose when high)."""
    import os

    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
