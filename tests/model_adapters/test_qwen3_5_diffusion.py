"""Trida2.0 / FLARE (model_adapters.families.qwen3_5_diffusion; issue 53.3): the Qwen3.5 hybrid decoded by
self-speculation, on tiny random checkpoints in the released layouts.

The forward is transformers' own Qwen3_5ForCausalLM (the causal rows); the mask rows' layout
(the whole window in attention, the gated-delta state at the window's end) matches a float64
per-token loop written here from the reference's description; the state a round keeps equals
mlx-lm's own cache after an autoregressive pass over the accepted prefix; greedy decoding is
token for token mlx-lm's greedy generate on the same weights (loaded as a stock Qwen3.5), with
random drafts, drafts made right by an oracle (whole acceptances) and drafts right only in part;
sampled, the autoregressive distribution (a bigram checkpoint). Only a checkpoint with the
evidence (the sidecar, FLARE's architecture) is taken from mlx-lm.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from bigram import BIGRAM, distance, make_bigram, sequences
from oracles import check_converted_copies, check_ragged_batch, decoded, greedy_ar
from safetensors.numpy import load_file, save_file

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.testing.hybrid_checkpoints import HYBRID_MASK, trida_as_qwen3_5, write_trida
from model_adapters import adapter_for, evidence
from model_adapters.families.qwen3_5_diffusion import Recurrent, attention_mask, recurrent_window

TOL = 1e-4
PROMPTS = ["Hello there", "abc", "The quick brown fox jumps", "x"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import mlx_lm

    root = tmp_path_factory.mktemp("trida")
    loaded = {}
    for name, tied in (("tied", True), ("untied", False)):
        path = write_trida(root / name, tied=tied)
        loaded[name] = (path, mld.load(str(path)), mlx_lm.load(str(trida_as_qwen3_5(path, root / f"{name}-ar"))))
    return loaded


# -- the family choice


def test_only_a_checkpoint_with_the_evidence_is_taken_from_mlx_lm(checkpoints, tmp_path):
    """Trida's raw layout (qwen3_5_text + block_diffusion.json) and FLARE's (qwen3_5 with its
    architecture, no sidecar) load as the family, through mld.load and, after install(), through
    mlx-lm's own loader; the same weights without the evidence stay mlx-lm's qwen3_5."""
    import mlx_lm
    from mlx_lm.models import qwen3_5

    path, (model, _), (plain, _) = checkpoints["tied"]
    assert type(model).__module__ == "model_adapters.families.qwen3_5_diffusion"
    assert (model.args.mask_token_id, model.args.bd_size) == (HYBRID_MASK, 8)
    assert type(plain) is qwen3_5.Model
    flare = write_trida(tmp_path / "flare", layout="flare")
    assert json.loads((flare / "config.json").read_text())["model_type"] == "qwen3_5"
    # (FLARE's architecture alone is evidence too; its mask id is then Qwen3.5's <|mask|>)
    (flare / "block_diffusion.json").rename(tmp_path / "sidecar.json")
    assert evidence.family_overrides(flare, json.loads((flare / "config.json").read_text())) == {
        "model_type": "qwen3_5_diffusion",
        "mask_token_id": 248077,
    }
    (tmp_path / "sidecar.json").rename(flare / "block_diffusion.json")
    flare_model, _ = mld.load(str(flare))
    assert type(flare_model).__module__ == "model_adapters.families.qwen3_5_diffusion"
    ids = mx.array([[5, 6, 7, 8]])
    same = [adapter_for(m).verify(adapter_for(m).start(ids[:, :1]), ids[:, 1:]) for m in (model, flare_model)]
    assert mx.allclose(same[0], same[1], atol=1e-5)  # (the same weights under FLARE's names)
    mld.install()
    try:
        assert type(mlx_lm.load(str(path))[0]).__module__ == "model_adapters.families.qwen3_5_diffusion"
        assert type(mlx_lm.load(str(path.parent / "tied-ar"))[0]) is qwen3_5.Model
    finally:
        mld.uninstall()


def test_an_unreadable_sidecar_is_refused_in_one_line(tmp_path):
    path = write_trida(tmp_path / "broken")
    (path / "block_diffusion.json").write_text("{not json")
    with pytest.raises(ValueError, match="block_diffusion.json cannot be read"):
        mld.load(str(path))
    (path / "block_diffusion.json").write_text(json.dumps({"bd_size": 8, "mask_id": "x"}))
    with pytest.raises(ValueError, match="integer mask_id"):
        mld.load(str(path))


# -- the forward


def test_causal_rows_match_transformers_qwen3_5(checkpoints):
    """The prompt's logits and a window's clean rows (with mask rows after them, which a clean
    row never sees) are transformers' Qwen3_5ForCausalLM logits over the same tokens."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    for name in ("tied", "untied"):
        path, (model, tokenizer), _ = checkpoints[name]
        reference = Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        tokens = tokenizer.encode("The quick brown fox") + [40, 41, 42, 43]
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0].numpy()
        adapter = adapter_for(model, tokenizer)
        state = adapter.start(mx.array([tokens[:-4]]))
        got_prompt = np.array(
            adapter.model.window(mx.array([tokens[:-4]]), adapter.model.make_state(), 0, len(tokens) - 4)[0][0]
        )
        window = mx.array([tokens[-4:] + [HYBRID_MASK] * 3])
        got_window = np.array(adapter.verify(state, window, clean=4)[0])
        # (≤ 1e-4 of the logits' scale: float32 roundoff through the gated-delta recurrence; mlx-lm's
        # own qwen3_5 and transformers' float64 differ by 1.5e-4 on logits of magnitude 3 here)
        tol = TOL * max(1.0, float(np.abs(expected).max()))
        assert np.abs(got_prompt - expected[:-4]).max() < tol
        assert np.abs(got_window[:4] - expected[-4:]).max() < tol


def test_attention_lets_the_mask_rows_see_the_whole_window():
    mask = np.array(attention_mask(7, 3, 4))
    assert mask.shape == (7, 10) and mask[:, :3].all()
    for row in range(7):
        assert list(mask[row, 3:]) == [row >= 4 or col <= row for col in range(7)]
    assert attention_mask(5, 9, 5) == "causal" and attention_mask(1, 9, 1) is None


def _gated_delta_loop(lin, x: np.ndarray, conv: np.ndarray, ssm: np.ndarray, clean: int) -> np.ndarray:
    """One gated-delta layer over a window, token by token in float64 (the reference's
    description: causal conv, SiLU, L2-normalised q and k, the delta rule; rows from `clean`
    read the state after the whole window)."""
    f = {
        k: np.array(v, dtype=np.float64)
        for k, v in (
            ("qkv", lin.in_proj_qkv.weight),
            ("z", lin.in_proj_z.weight),
            ("b", lin.in_proj_b.weight),
            ("a", lin.in_proj_a.weight),
            ("conv", lin.conv1d.weight),
            ("dt", lin.dt_bias),
            ("A", lin.A_log),
            ("norm", lin.norm.weight),
            ("out", lin.out_proj.weight),
        )
    }
    L, K = x.shape[0], lin.conv_kernel_size
    hk, hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
    rows = np.concatenate([conv, x @ f["qkv"].T])
    mixed = np.stack([(rows[t : t + K] * f["conv"][:, :, 0].T).sum(0) for t in range(L)])
    mixed = mixed / (1 + np.exp(-mixed))
    q, k, v = mixed[:, : hk * dk], mixed[:, hk * dk : 2 * hk * dk], mixed[:, 2 * hk * dk :]
    q, k, v = q.reshape(L, hk, dk), k.reshape(L, hk, dk), v.reshape(L, hv, dv)
    q = q / np.sqrt((q**2).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k**2).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, hv // hk, 1), np.repeat(k, hv // hk, 1)
    beta = 1 / (1 + np.exp(-(x @ f["b"].T)))
    g = np.exp(-np.exp(f["A"]) * np.log1p(np.exp(x @ f["a"].T + f["dt"])))
    state, ys = ssm.astype(np.float64), []
    for t in range(L):
        state = state * g[t][:, None, None]
        delta = (v[t] - (state * k[t][:, None, :]).sum(-1)) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        ys.append((state * q[t][:, None, :]).sum(-1))
    for t in range(clean, L):
        ys[t] = (state * q[t][:, None, :]).sum(-1)
    y = np.stack(ys)  # (L, hv, dv)
    z = (x @ f["z"].T).reshape(L, hv, dv)
    normed = y / np.sqrt((y**2).mean(-1, keepdims=True) + lin.norm.eps) * f["norm"]
    return (normed * z / (1 + np.exp(-z))).reshape(L, -1) @ f["out"].T


def test_the_gated_delta_window_matches_a_per_token_loop(checkpoints):
    """Clean rows read the state at their own position, mask rows the state after the window's
    last row, from a nonzero state before the window."""
    _, (model, _), _ = checkpoints["untied"]
    lin = next(layer for layer in model.layers if layer.is_linear).linear_attn
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, lin.hidden_size)).astype(np.float32)
    conv = rng.standard_normal((lin.conv_kernel_size - 1, lin.conv_dim)).astype(np.float32)
    ssm = (0.3 * rng.standard_normal((lin.num_v_heads, lin.head_v_dim, lin.head_k_dim))).astype(np.float32)
    for clean in (1, 4, 7):
        out, _ = recurrent_window(lin, mx.array(x[None]), Recurrent(mx.array(conv[None]), mx.array(ssm[None])), clean)
        expected = _gated_delta_loop(lin, x.astype(np.float64), conv.astype(np.float64), ssm, clean)
        assert np.abs(np.array(out[0]) - expected).max() < TOL, clean


def test_the_state_a_round_keeps_is_the_autoregressive_state(checkpoints):
    """After a window [pending, 3 drafts, 3 masks] keeps n of its rows, every layer's state
    (keys and values, the convolution rows, the recurrence) equals mlx-lm's own cache after the
    prompt and those n tokens, and the next logits agree."""
    from mlx_lm.models.cache import make_prompt_cache

    _, (model, tokenizer), (plain, _) = checkpoints["untied"]
    adapter = adapter_for(model, tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    window = [50, 51, 52, 53]
    for n in (1, 2, 3, 4):
        state = adapter.start(mx.array([prompt]))
        adapter.verify(state, mx.array([window + [HYBRID_MASK] * 3]), clean=4)
        adapter.keep(state, len(prompt) + n)
        cache = make_prompt_cache(plain)
        plain(mx.array([prompt + window[:n]]), cache=cache)
        for ours, theirs in zip(state.cache, cache):
            if isinstance(ours, Recurrent):
                assert mx.allclose(ours.conv, theirs[0], atol=TOL) and mx.allclose(ours.ssm, theirs[1], atol=TOL)
            else:
                assert ours.offset == theirs.offset == len(prompt) + n
                length = ours.offset
                for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    assert mx.allclose(a[..., :length, :], b[..., :length, :], atol=TOL)
        nxt = adapter.verify(state, mx.array([[60]]))[0, -1]
        assert mx.allclose(nxt, plain(mx.array([[60]]), cache=cache)[0, -1], atol=TOL)
        adapter.keep(state, len(prompt) + n + 1)


# -- greedy decoding: greedy autoregressive decoding, whatever the drafts


@pytest.mark.parametrize("name", ["tied", "untied"])
@pytest.mark.parametrize("strides", [2, 4, 6])
def test_greedy_is_greedy_autoregressive(checkpoints, name, strides):
    _, pair, ar = checkpoints[name]
    for prompt in PROMPTS:
        ids = pair[1].encode(prompt)
        tokens, forwards = decoded(pair, ids, 24, block_length=strides)
        assert tokens == greedy_ar(ar, ids, 24), prompt
        assert forwards <= len(tokens) - 1


def _with_oracle_drafts(adapter, continuation: list, right) -> None:
    """The adapter's verify pass with its mask rows made to draft the true continuation
    (`continuation`: the prompt and the greedy answer), where `right(position)` says so, and a
    wrong token elsewhere: the rounds then accept what `right` allows."""
    verify = adapter.verify

    def oracle(state, window, clean=None):
        logits = verify(state, window, clean)
        if clean is None:  # (the prompt's pass)
            return logits
        if window.shape[1] > 1 and (window[0, 1:] == HYBRID_MASK).all().item():
            clean = 1  # (a cold round, [pending, masks]: its rows 1.. draft)
        rows = []
        for i in range(logits.shape[1]):
            target = state.length + i + 1  # (row i predicts the position after it)
            if i >= clean and target < len(continuation):
                token = continuation[target] if right(target) else (continuation[target] + 1) % 250
                rows.append(mx.where(mx.arange(logits.shape[-1]) == token, 100.0, 0.0))
            else:
                rows.append(logits[0, i])
        return mx.stack(rows)[None]

    adapter.verify = oracle


@pytest.mark.parametrize("strides", [2, 3, 4, 8])
def test_drafts_made_right_are_accepted_whole_and_change_nothing(checkpoints, strides):
    """With mask rows that draft the greedy continuation, every round after the cold one commits
    N tokens (forwards = 1 + ceil((T - 2) / N)) and the tokens stay greedy AR's; with drafts right
    only at some positions, rounds accept part and the tokens are still greedy AR's."""
    from mlx_lm_diffusion.decoding.engine import Engine
    from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve

    _, (model, tokenizer), ar = checkpoints["untied"]
    ids = tokenizer.encode("abc")
    expected = greedy_ar(ar, ids, 30)
    for right, whole in ((lambda p: True, True), (lambda p: p % 3 != 0, False)):
        adapter = adapter_for(model, tokenizer)
        _with_oracle_drafts(adapter, ids + expected, right)
        options = resolve(DecodeOptions(max_tokens=30, block_length=strides), adapter, len(ids))
        steps = list(Engine(adapter, options).run(mx.array([ids])))
        assert steps[-1].canvas[0, len(ids) :].tolist() == expected
        if whole:
            assert steps[-1].forwards == 1 + math.ceil((30 - 2) / strides)
        else:
            assert steps[-1].forwards < 29


def test_a_row_alone_equals_the_row_in_a_ragged_batch(checkpoints):
    check_ragged_batch(checkpoints["tied"][1])


def test_commit_rules_are_refused(checkpoints):
    _, (model, tokenizer), _ = checkpoints["tied"]
    with pytest.raises(ValueError, match="threshold does not apply"):
        mld.generate(model, tokenizer, "abc", max_tokens=4, threshold=0.9)
    with pytest.raises(ValueError, match="block_length >= 2"):
        mld.generate(model, tokenizer, "abc", max_tokens=4, block_length=1)


def test_sampled_decoding_draws_from_the_autoregressive_distribution(tmp_path):
    """A bigram hybrid (every layer's output zeroed): over 1,500 seeded decodes of 4 tokens the
    distribution of the 16 sequences is the chain's own within sampling noise."""
    from mlx_lm.sample_utils import make_sampler

    path = write_trida(tmp_path / "bigram", tied=False)
    save_file(
        make_bigram(load_file(str(path / "model.safetensors")), norm_one=0.0),
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    model, tokenizer = mld.load(str(path))
    mx.random.seed(3)
    batch = mld.generate_batch(
        model, tokenizer, ["abc"] * 1500, max_tokens=4, sampler=make_sampler(1.0), return_token_ids=True
    )
    counts: dict = {}
    for tokens in batch.token_ids:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    exact = sequences(4, BIGRAM["other"])
    assert set(counts) <= set(exact)
    assert distance(counts, exact) < 0.06, distance(counts, exact)
    assert sum(batch.forwards) < sum(len(t) - 1 for t in batch.token_ids)  # (drafts were accepted)


def test_convert_and_quantize_keep_it_the_family(checkpoints, tmp_path):
    """The MLX copy keeps the source's config (qwen3_5_text) and its sidecar, reloads as the
    family and decodes the same tokens; a 4-bit copy loads and decodes."""
    path, pair, _ = checkpoints["tied"]
    check_converted_copies(path, pair, tmp_path, "model_adapters.families.qwen3_5_diffusion")
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert (tmp_path / "q4" / "block_diffusion.json").exists()


def test_the_cli_and_the_server_decode_it(checkpoints):
    from cli_run import run_main
    from server_runs import post_json, running_server

    path, (model, tokenizer), _ = checkpoints["tied"]
    expected = mld.generate(model, tokenizer, "abc", max_tokens=10)
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(path),
        "--prompt",
        "abc",
        "--max-tokens",
        "10",
        "--ignore-chat-template",
        "--verbose",
        "False",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected
    with running_server(["--model", str(path), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        status, body = post_json(
            httpd.server_address[1], "/v1/completions", {"prompt": "abc", "max_tokens": 10, "temperature": 0}
        )
    assert status == 200 and body["choices"][0]["text"] == expected
