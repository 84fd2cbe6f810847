"""The step-schedule protocol's `seed_canvas` extension: pinned positions are kept, never
listed as unmasked, and the schedule counts the free positions only."""

import oracles
import pytest
from test_protocol import BASE

from mlx_lm_diffusion.api.protocol import run_request, validate_response
from mlx_lm_diffusion.decoding.schedules import quotas
from mlx_lm_diffusion.testing.checkpoints import MASK_ID


def seeded(pinned: dict):
    """BASE's canvas with tokens pinned at absolute positions."""
    P, total = len(BASE["prompt_tokens"]), BASE["target_length"]
    canvas = BASE["prompt_tokens"] + [MASK_ID] * (total - P)
    for position, token in pinned.items():
        canvas[position] = token
    return canvas


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("temperatures", [[0.0] * 5, [1.0, 0.7, 0.5, 0.0, 2.0]])
def test_pinned_positions_stay_and_are_never_unmasked(llada, schedule, temperatures):
    model, tok = llada
    pinned = {8: 40, 9: 41, 16: 42}  # inside the span and at its end
    request = dict(BASE, mask_schedule=schedule, temperature_schedule=temperatures, seed=3, seed_canvas=seeded(pinned))
    response = run_request(model, tok, request)
    validate_response(response)
    final = response["final_tokens"]
    assert all(final[i] == t for i, t in pinned.items()) and MASK_ID not in final
    seen = [i for s in response["per_step_unmasked"] for i in s["token_indices"]]
    P, total = len(BASE["prompt_tokens"]), BASE["target_length"]
    assert sorted(seen) == [i for i in range(P, total) if i not in pinned]
    free = total - P - len(pinned)
    counts = {s["step"]: len(s["token_indices"]) for s in response["per_step_unmasked"]}
    assert [counts.get(t, 0) for t in range(5)] == quotas(schedule, free, 5)
    for i in pinned:
        assert response["confidence"][i - P] == 1.0


def test_a_suffix_seed_matches_the_infill_oracle(llada):
    """A canvas whose tail is pinned is an infill: greedy, one block, an even quota per
    step is LLaDA's generate over the seeded canvas."""
    model, tok = llada
    suffix = [40, 41, 42, 43]
    P, total = len(BASE["prompt_tokens"]), BASE["target_length"]
    gen = total - P - len(suffix)
    canvas = seeded({total - len(suffix) + i: t for i, t in enumerate(suffix)})
    response = run_request(model, tok, dict(BASE, num_steps=gen, temperature_schedule=[0.0] * gen, seed_canvas=canvas))
    ref, _ = oracles.llada_generate(
        model, BASE["prompt_tokens"], gen_length=gen, block_length=gen, steps=gen, mask_id=MASK_ID, suffix=suffix
    )
    assert response["final_tokens"][P:] == ref


@pytest.mark.parametrize(
    "canvas,word",
    [
        (lambda: seeded({})[:-1], "target_length"),
        (lambda: [1] + seeded({})[1:], "begin with prompt_tokens"),
        (lambda: seeded({8: 10**6}), "outside the vocabulary"),
    ],
)
def test_bad_seed_canvases(llada, canvas, word):
    model, tok = llada
    with pytest.raises(ValueError, match=word):
        run_request(model, tok, dict(BASE, seed_canvas=canvas()))


def test_causal_models_refuse_pinned_positions(tmp_path):
    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.testing.causal_checkpoints import write_causal

    model, tok = mld.load(str(write_causal(tmp_path / "ar", "qwen3")), autoregressive=True)
    with pytest.raises(ValueError, match="cannot infill"):
        run_request(model, tok, dict(BASE, seed_canvas=seeded({9: 40})))
