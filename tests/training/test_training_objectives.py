"""The families' training objectives (mlx_lm_diffusion.training.objectives) against an
independent computation: the same noise given, each row's logits read through the family's
DECODING path (its adapter's `predict` over the clean tokens before the noised block, one
row at a time, no padding), the masks, block choice, weights and normalization recomputed in
numpy from the rule each docstring names. Gradients against central finite differences."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lm_diffusion.evaluation.layout import bound_layout
from mlx_lm_diffusion.evaluation.likelihood import estimate_log_likelihood
from mlx_lm_diffusion.training.objectives import EPS, Noise, objective_for
from mlx_lm_diffusion.training.validation import ElboValidation
from model_adapters import adapter_for

# (offset, length) of each row: the first row with a prompt (SFT), the second trained whole
SPANS = [(5, 19), (0, 13)]
LONG_SPANS = [(7, 70), (0, 45)]  # several 32-token blocks (LLaDA2, Nemotron)


def _batch(spans, vocab, mask_id, seed=0):
    rng = np.random.default_rng(seed)
    width = max(e for _, e in spans) + 3  # padding after every row, as mlx-lm pads
    tokens = np.zeros((len(spans), width), np.int32)
    for row, (_, end) in enumerate(spans):
        choices = [t for t in range(min(vocab, 250)) if t != mask_id]
        tokens[row, :end] = rng.choice(choices, size=end)
    return tokens, np.array(spans, np.int32)


def _noise(rows, width, seed=1):
    rng = np.random.default_rng(seed)
    times = (1 - EPS) * rng.uniform(size=rows) + EPS
    return rng.uniform(size=(rows, width)), times, rng.uniform(size=rows)


def _oracle(adapter, tokens, spans, draws, times, blocks_u, normalize, first=0):
    """The objective from its definition, row by row through the adapter's predict."""
    layout = bound_layout(adapter)
    size = getattr(adapter.model.args, "block_size", None) if layout.kind == "prefix" else layout.block
    losses, counts = [], []
    for row, (offset, end) in enumerate(spans):
        start = max(offset, first)
        if layout.kind == "canvas":
            blocks = [(start, end)]
        elif layout.kind == "aligned":
            blocks = layout.blocks(start, end)
        else:
            blocks = [(s, min(s + size, end)) for s in range(start, end, size)]
        lo, hi = blocks[int(np.floor(blocks_u[row] * len(blocks)))]
        seq = tokens[row, :end].copy()
        masked = np.zeros(end, bool)
        masked[lo:hi] = draws[row, lo:hi] < times[row]
        canvas = np.where(masked, adapter.mask_id, seq)[None, :hi]
        state = adapter.start(mx.array(canvas[:, :lo]))
        logits = np.array(adapter.predict(state, mx.array(canvas), lo, hi).astype(mx.float32))[0]
        log_probs = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        picked = log_probs[np.arange(hi - lo), seq[lo:hi]]
        losses.append(-(picked * masked[lo:hi]).sum() / times[row] * len(blocks))
        counts.append(end - start)
    losses, counts = np.array(losses), np.array(counts)
    if normalize == "answer":
        return float((losses / counts).mean()), int(counts.sum())
    return float(losses.sum() / counts.sum()), int(counts.sum())


def _family(request, name):
    model, tokenizer = request.getfixturevalue(name)
    return model, adapter_for(model, tokenizer)


@pytest.mark.parametrize(
    "name,spans",
    [("llada", SPANS), ("dream", SPANS), ("sdar", SPANS), ("llada2", LONG_SPANS), ("nemotron", LONG_SPANS)],
)
@pytest.mark.parametrize("normalize", ["answer", "tokens"])
def test_the_objective_is_its_definition(request, name, spans, normalize):
    model, adapter = _family(request, name)
    objective = objective_for(adapter, "diffusion", normalize)
    tokens, lengths = _batch(spans, model.vocab_size, adapter.mask_id)
    draws, times, blocks_u = _noise(*tokens.shape)
    noise = Noise(mx.array(times, mx.float32), mx.array(draws, mx.float32), mx.array(blocks_u, mx.float32))
    loss, count = objective(model, mx.array(tokens), mx.array(lengths), noise)
    expected, expected_count = _oracle(adapter, tokens, spans, draws, times, blocks_u, normalize, objective.first)
    assert int(count) == expected_count
    assert float(loss) == pytest.approx(expected, rel=2e-4, abs=2e-4)


def test_dream_never_trains_its_first_position(dream):
    objective = objective_for(adapter_for(*dream))
    assert objective.first == 1 and objective.shift == 1  # (position 0 has no row before it)


def test_nemotron_autoregressive_objective_is_next_token_cross_entropy(nemotron):
    model, tokenizer = nemotron
    objective = objective_for(adapter_for(model, tokenizer), "ar")
    tokens, lengths = _batch(SPANS, model.vocab_size, objective.mask_id)
    loss, count = objective(model, mx.array(tokens), mx.array(lengths))
    total, n = 0.0, 0
    for row, (offset, end) in enumerate(SPANS):
        seq = tokens[row, :end]
        logits = np.array(model(mx.array(seq[None]), mask="causal").astype(mx.float32))[0]
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        for pos in range(max(offset, 1), end):  # logits at pos - 1 predict pos
            total -= log_probs[pos - 1, seq[pos]]
            n += 1
    assert int(count) == n
    assert float(loss) == pytest.approx(total / n, rel=2e-4)


def test_families_without_a_masked_objective_are_refused(gemma, llada, sdar):
    with pytest.raises(ValueError, match="uniform-noise"):
        objective_for(adapter_for(*gemma))
    with pytest.raises(ValueError, match="autoregressive mode"):
        objective_for(adapter_for(*sdar), "ar")
    with pytest.raises(ValueError, match="unknown objective"):
        objective_for(adapter_for(*llada), "bert")


@pytest.mark.parametrize("name", ["llada", "sdar"])
def test_gradients_match_finite_differences(request, name):
    model, adapter = _family(request, name)
    objective = objective_for(adapter, "diffusion", "answer")
    tokens, lengths = _batch(SPANS, model.vocab_size, adapter.mask_id)
    draws, times, blocks_u = _noise(*tokens.shape)
    noise = Noise(mx.array(times, mx.float32), mx.array(draws, mx.float32), mx.array(blocks_u, mx.float32))
    batch, spans = mx.array(tokens), mx.array(lengths)

    def loss_of(m):
        return objective(m, batch, spans, noise)[0]

    _, grads = nn.value_and_grad(model, loss_of)(model)
    flat_grads = dict(tree_flatten(grads))
    params = dict(tree_flatten(model.parameters()))
    step = 1e-2
    checked = 0
    for key in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
        name_ = next(k for k in params if k.endswith(key))
        grad = np.array(flat_grads[name_])
        for index in np.argsort(-np.abs(grad).ravel())[:2]:  # the largest entries: far above rounding
            original = params[name_]
            values = []
            for sign in (1, -1):
                moved = np.array(original).ravel().copy()
                moved[index] += sign * step
                model.update(_nested(name_, mx.array(moved.reshape(original.shape))))
                values.append(float(loss_of(model)))
            model.update(_nested(name_, original))
            numeric = (values[0] - values[1]) / (2 * step)
            assert numeric == pytest.approx(grad.ravel()[index], rel=3e-2, abs=2e-3), (name_, index)
            checked += 1
    assert checked == 4


def _nested(dotted: str, value):
    from mlx.utils import tree_unflatten

    return tree_unflatten([(dotted, value)])


def test_validation_is_the_likelihood_estimate_and_repeats(llada):
    model, tokenizer = llada
    adapter = adapter_for(model, tokenizer)
    objective = objective_for(adapter, "diffusion", "answer", validation=ElboValidation(adapter, 0, seed=7))
    tokens, lengths = _batch(SPANS, model.vocab_size, adapter.mask_id)
    model.eval()
    try:
        first = objective(model, mx.array(tokens), mx.array(lengths))
        again = objective(model, mx.array(tokens), mx.array(lengths))
    finally:
        model.train()
    nll = 0.0
    for row, (offset, end) in enumerate(SPANS):
        seq = tokens[row, :end].tolist()
        nll -= estimate_log_likelihood(
            adapter, seq[:offset], seq[offset:], samples=1, batch_size=1, seed=[7, *seq]
        ).log_likelihood
    count = sum(e - o for o, e in SPANS)
    assert int(first[1]) == count
    assert float(first[0]) == float(again[0]) == pytest.approx(nll / count, rel=1e-5)


@pytest.mark.parametrize("name", ["llada", "sdar"])
def test_sft_padding_is_eos_and_trained(request, name):
    """With pad_id (--mask-prompt) a row is trained as the same row written out with EOS to
    the batch's width (LLaDA's SFT padding), its answer length counting the EOS."""
    model, adapter = _family(request, name)
    eos = 3
    tokens, lengths = _batch(SPANS, model.vocab_size, adapter.mask_id)
    width = tokens.shape[1]
    draws, times, blocks_u = _noise(*tokens.shape)
    noise = Noise(mx.array(times, mx.float32), mx.array(draws, mx.float32), mx.array(blocks_u, mx.float32))
    padded = objective_for(adapter, "diffusion", "answer", pad_id=eos)
    loss, count = padded(model, mx.array(tokens), mx.array(lengths), noise)
    written = tokens.copy()
    for row, (_, end) in enumerate(SPANS):
        written[row, end:] = eos
    spans = [(offset, width) for offset, _ in SPANS]
    expected, expected_count = _oracle(adapter, written, spans, draws, times, blocks_u, "answer")
    assert int(count) == expected_count == sum(width - o for o, _ in SPANS)
    assert float(loss) == pytest.approx(expected, rel=2e-4, abs=2e-4)


def test_validation_batches_come_in_a_fixed_order_and_leave_numpy_alone():
    from mlx_lm_diffusion.training.batches import iterate_batches

    dataset = [([i + 1] * (3 + i % 5), 0) for i in range(40)]
    np.random.seed(123)
    state = np.random.get_state()[1].copy()

    def firsts():
        return [int(batch[0, 0]) for batch, _ in iterate_batches(dataset, 4, 64)]

    one, two = firsts(), firsts()
    assert one == two and sorted(one) != one  # (shuffled, the same way every time)
    assert np.array_equal(np.random.get_state()[1], state)  # the training order's generator is untouched
