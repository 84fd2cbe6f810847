"""Greedy decode parity: the shared engine against independent oracles of LLaDA's
`generate` and Dream's `diffusion_generate`: identical tokens, identical forwards.

EOS stopping is switched off here (the references always fill the whole canvas);
it is tested on its own in test_generate.py.
"""

import oracles
import pytest

from mlx_lm_diffusion.testing.engine_runs import engine_decode

PROMPTS = [[72, 101, 108, 108, 111], [5, 17, 99, 200, 31, 7, 64, 250, 12], [33]]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("gen,block,steps", [(32, 8, 8), (32, 8, 4), (24, 24, 6), (20, 8, 3), (16, 16, 16)])
def test_llada_low_confidence_matches_reference(llada, prompt, gen, block, steps):
    model, tok = llada
    ref_tokens, ref_forwards = oracles.llada_generate(
        model, prompt, gen_length=gen, block_length=block, steps=steps, mask_id=260
    )
    tokens, forwards = engine_decode(
        model, tok, prompt, max_tokens=gen, block_length=block, steps=steps, strategy="low_confidence"
    )
    assert tokens == ref_tokens
    assert forwards == ref_forwards


def test_llada_more_steps_than_masks_skips_only_idle_forwards(llada):
    """With more steps than block positions the reference spends forwards on a full
    block; the engine stops the block when it is full: same tokens, fewer forwards."""
    model, tok = llada
    prompt = PROMPTS[0]
    ref_tokens, ref_forwards = oracles.llada_generate(model, prompt, gen_length=8, block_length=4, steps=6, mask_id=260)
    tokens, forwards = engine_decode(model, tok, prompt, max_tokens=8, block_length=4, steps=6)
    assert tokens == ref_tokens
    assert forwards == 8 < ref_forwards == 12


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("gen,steps", [(24, 24), (24, 8), (16, 5), (12, 20)])
def test_dream_matches_reference(dream, prompt, alg, gen, steps):
    model, tok = dream
    ref_tokens, ref_forwards = oracles.dream_generate(
        model, prompt, max_new_tokens=gen, steps=steps, alg=alg, mask_id=260
    )
    tokens, forwards = engine_decode(model, tok, prompt, max_tokens=gen, steps=steps, strategy=alg)
    assert tokens == ref_tokens
    assert forwards == ref_forwards == steps


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5, 1.0])
def test_fast_dllm_threshold_matches_reference(llada, threshold):
    model, tok = llada
    prompt = PROMPTS[1]
    ref_tokens, ref_forwards = oracles.fast_dllm_threshold(
        model, prompt, gen_length=24, block_length=8, threshold=threshold, mask_id=260
    )
    tokens, forwards = engine_decode(model, tok, prompt, max_tokens=24, block_length=8, threshold=threshold)
    assert tokens == ref_tokens
    assert forwards == ref_forwards


@pytest.mark.parametrize("editing_threshold,max_post_steps", [(0.3, 16), (0.1, 2), (0.0, 0)])
def test_editing_matches_reference_loop(llada, editing_threshold, max_post_steps):
    model, tok = llada
    prompt = PROMPTS[0]
    ref_tokens, ref_forwards = oracles.threshold_with_editing(
        model,
        prompt,
        gen_length=16,
        block_length=8,
        threshold=0.5,
        editing_threshold=editing_threshold,
        max_post_steps=max_post_steps,
        mask_id=260,
    )
    tokens, forwards = engine_decode(
        model,
        tok,
        prompt,
        max_tokens=16,
        block_length=8,
        threshold=0.5,
        editing_threshold=editing_threshold,
        max_post_steps=max_post_steps,
    )
    assert tokens == ref_tokens
    assert forwards == ref_forwards
