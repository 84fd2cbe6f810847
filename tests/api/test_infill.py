"""Infilling with a suffix: parity with the reference loops started from the seeded
canvas (masks only in the middle span), pinned tokens that never change in any Step,
the middle as the output, and the families that cannot see a suffix refusing it."""

import mlx.core as mx
import numpy as np
import oracles
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.output.infill import suffix_seed
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, MASK_ID
from model_adapters import adapter_for

PROMPTS = [[72, 101, 108, 108, 111], [5, 17, 99, 200, 31, 7, 64, 250, 12], [33]]
SUFFIXES = [[40, 41, 42], [120, 7, 99, 13, 250, 61, 62, 63, 64, 65, 66]]


def infill_steps(model, tok, prompt, suffix, eos=False, **options):
    """Every Step of an infill of one prompt (EOS not stopping it unless `eos`)."""
    adapter = adapter_for(model, tok)
    if not eos:
        adapter.eos_ids = frozenset()  # the references fill the whole span
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt) + len(suffix))
    seed = suffix_seed(adapter, resolved, suffix, 1)
    return list(Engine(adapter, resolved).run(mx.array([prompt]), seed))


def assert_suffix_pinned(steps, prompt, suffix, gen):
    P = len(prompt)
    for step in steps:
        assert step.canvas[0, :P].tolist() == prompt
        assert step.canvas[0, P + gen :].tolist() == list(suffix)  # in every Step, unchanged


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("gen,block,steps", [(16, 8, 8), (16, 8, 4), (12, 12, 6), (10, 4, 2)])
def test_llada_infill_matches_reference(llada, prompt, suffix, gen, block, steps):
    model, tok = llada
    ref, ref_forwards = oracles.llada_generate(
        model, prompt, gen_length=gen, block_length=block, steps=steps, mask_id=MASK_ID, suffix=suffix
    )
    run = infill_steps(
        model, tok, prompt, suffix, max_tokens=gen, block_length=block, steps=steps, strategy="low_confidence"
    )
    assert run[-1].canvas[0, len(prompt) :].tolist() == ref
    assert run[-1].forwards == ref_forwards
    assert_suffix_pinned(run, prompt, suffix, gen)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("gen,steps", [(16, 16), (12, 5)])
def test_dream_infill_matches_reference(dream, prompt, suffix, alg, gen, steps):
    """Dream's shift at the suffix boundary: the middle's last position is read from
    the row before it; the suffix's rows are never read."""
    model, tok = dream
    ref, ref_forwards = oracles.dream_generate(
        model, prompt, max_new_tokens=gen, steps=steps, alg=alg, mask_id=MASK_ID, suffix=suffix
    )
    run = infill_steps(model, tok, prompt, suffix, max_tokens=gen, steps=steps, strategy=alg)
    assert run[-1].canvas[0, len(prompt) :].tolist() == ref
    assert run[-1].forwards == ref_forwards == steps
    assert_suffix_pinned(run, prompt, suffix, gen)


def test_the_suffix_conditions_the_middle(llada):
    """Against the reference without a suffix the tokens differ: the suffix is seen."""
    model, tok = llada
    prompt, gen = PROMPTS[1], 16
    with_suffix = [
        infill_steps(model, tok, prompt, s, max_tokens=gen, block_length=8, steps=8)[-1]
        .canvas[0, len(prompt) : len(prompt) + gen]
        .tolist()
        for s in SUFFIXES
    ]
    plain, _ = oracles.llada_generate(model, prompt, gen_length=gen, block_length=8, steps=8, mask_id=MASK_ID)
    assert with_suffix[0] != plain or with_suffix[1] != plain


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cached_and_editing_infill_keep_the_suffix(family, mode, request):
    model, tok = request.getfixturevalue(family)
    prompt, suffix = PROMPTS[0], SUFFIXES[1]
    run = infill_steps(model, tok, prompt, suffix, max_tokens=16, block_length=8, cache=mode, threshold=0.5)
    assert_suffix_pinned(run, prompt, suffix, 16)
    assert MASK_ID not in run[-1].canvas[0].tolist()
    run = infill_steps(
        model,
        tok,
        prompt,
        suffix,
        max_tokens=16,
        block_length=8,
        threshold=0.5,
        editing_threshold=0.0,
        max_post_steps=2,
    )
    assert_suffix_pinned(run, prompt, suffix, 16)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_stream_generate_yields_the_middle_only(family, request):
    model, tok = request.getfixturevalue(family)
    prompt, suffix = "def f(x):", " return y"
    responses = list(mld.stream_generate(model, tok, prompt, max_tokens=12, suffix=suffix, block_length=4))
    assert 1 <= len(responses) <= 12
    assert [r.generation_tokens for r in responses] == list(range(1, len(responses) + 1))
    ids = tok.encode(suffix, add_special_tokens=False)
    adapter = adapter_for(model, tok)
    resolved = resolve(DecodeOptions(max_tokens=12, block_length=4), adapter, 0)
    engine = Engine(adapter, resolved)
    seed = suffix_seed(adapter, resolved, ids, 1)
    last = list(engine.run(mx.array([tok.encode(prompt)]), seed))[-1]
    P = len(tok.encode(prompt))
    assert [r.token for r in responses] == last.canvas[0, P : P + len(responses)].tolist()
    text = mld.generate(model, tok, prompt, max_tokens=12, suffix=suffix, block_length=4)
    assert text == "".join(r.text for r in responses)


def test_eos_inside_the_span_ends_the_middle(llada):
    """An EOS the model puts inside the span ends the middle early (finish "stop")."""
    model, tok = llada
    prompt = PROMPTS[0]

    def eos_third(tokens, logits):  # mlx-lm's processor call: (1, V) for the next position
        if len(tokens) == len(prompt) + 3:
            return logits + mx.where(mx.arange(logits.shape[-1]) == EOS_ID, 1e4, 0.0)
        return logits

    responses = list(
        mld.stream_generate(
            model, tok, prompt, max_tokens=16, suffix=SUFFIXES[0], block_length=8, logits_processors=[eos_third]
        )
    )
    assert len(responses) == 4 and responses[-1].token == EOS_ID and responses[-1].finish_reason == "stop"


def test_bad_suffixes(llada):
    model, tok = llada
    with pytest.raises(ValueError, match="mask token"):
        list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=8, suffix=[MASK_ID]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=8, suffix=[10**6]))
    with pytest.raises(ValueError, match="suffix must be text or a list of token ids"):
        list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=8, suffix=["7"]))
    # the suffix takes room in the context: an error names it (it counted it as the prompt)
    room = adapter_for(model, tok).max_length
    with pytest.raises(ValueError, match=rf"the prompt \(5 tokens\) and suffix \({room - 5} tokens\) leave no room"):
        list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=8, suffix=[72] * (room - 5)))
    with pytest.raises(ValueError, match=r"and suffix \(\d+ tokens\) leave no room"):
        mld.generate_batch(model, tok, [PROMPTS[0]], max_tokens=8, suffix=[72] * (room - 5))
    # an empty suffix is no suffix (the OpenAI API's meaning)
    assert mld.generate(model, tok, PROMPTS[0], max_tokens=8, suffix="") == mld.generate(
        model, tok, PROMPTS[0], max_tokens=8
    )


def _load(writer, tmp_path, *args):
    return mld.load(str(writer(tmp_path, *args)))


def test_families_that_cannot_see_a_suffix_refuse_it(tmp_path):
    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
    from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron

    cases = {"block-causal": [write_sdar, write_llada2], "causal prefix": [write_nemotron]}
    for reason, writers in cases.items():
        for i, writer in enumerate(writers):
            model, tok = _load(writer, tmp_path / f"{reason}{i}")
            with pytest.raises(ValueError, match=f"cannot infill before a suffix.*{reason}"):
                list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=8, suffix=[40, 41]))
    model, tok = mld.load(str(write_causal(tmp_path / "ar", "qwen3")), autoregressive=True)
    with pytest.raises(ValueError, match="cannot infill before a suffix.*causal"):
        list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=8, suffix=[40, 41]))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma

    return mld.load(str(write_diffusion_gemma(tmp_path_factory.mktemp("gemma"))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diffusion_gemma_never_renoises_a_pinned_position(gemma, seed):
    """The suffix sits inside the canvas right after the middle; the noisy canvas the
    model sees holds it at every step, and the draft and output keep it."""
    model, tok = gemma
    prompt, suffix, gen = PROMPTS[0], [40, 41, 42, 43], 8
    adapter = adapter_for(model, tok)
    seen = []
    predict = adapter.predict

    def spy(state, canvas, start, end):
        seen.append(np.array(canvas[0, start:end]))
        return predict(state, canvas, start, end)

    adapter.predict = spy
    adapter.eos_ids = frozenset()
    resolved = resolve(DecodeOptions(max_tokens=gen, seed=seed), adapter, len(prompt) + len(suffix))
    steps = list(Engine(adapter, resolved).run(mx.array([prompt]), suffix_seed(adapter, resolved, suffix, 1)))
    assert len(seen) >= 2
    for noisy in seen:
        assert noisy[gen : gen + len(suffix)].tolist() == suffix
    for step in steps:
        assert step.canvas[0, len(prompt) + gen : len(prompt) + gen + len(suffix)].tolist() == suffix
    text = mld.generate(model, tok, prompt, max_tokens=gen, suffix=suffix, seed=seed)
    assert isinstance(text, str)


def test_diffusion_gemma_suffix_must_share_the_canvas(gemma):
    model, tok = gemma  # canvases of 16
    with pytest.raises(ValueError, match="must fit one canvas"):
        list(mld.stream_generate(model, tok, PROMPTS[0], max_tokens=14, suffix=[40, 41, 42]))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_generate_batch_infills_each_row_as_alone(family, request):
    from mlx_lm_diffusion.api.generation import generate_batch

    model, tok = request.getfixturevalue(family)
    prompts, suffix = [[72, 101, 108, 108], [5, 17, 99, 200]], SUFFIXES[0]
    rows = generate_batch(
        model, tok, prompts, max_tokens=12, block_length=4, threshold=0.5, suffix=suffix, return_token_ids=True
    ).token_ids
    for prompt, row in zip(prompts, rows):
        alone = [
            r.token
            for r in mld.stream_generate(
                model, tok, prompt, max_tokens=12, block_length=4, threshold=0.5, suffix=suffix
            )
        ]
        assert row == [t for t in alone if t not in adapter_for(model, tok).eos_ids]
