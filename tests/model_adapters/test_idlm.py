"""I-DLM (model_adapters.families.idlm, decoding.decoders.introspective; issue 53.2).

On tiny random checkpoints in I-DLM's released layout (SDAR's files, `model_type "sdar"`,
`use_regular_causal`): the forward is transformers' Qwen3ForCausalLM; introspective strided
decoding is token for token mlx-lm's own greedy generate on the same weights (loaded as a stock
Qwen3), whether rounds reject at the first draft (random weights), later (a checkpoint built to
accept one draft then reject) or accept whole (a checkpoint whose masks predict the
continuation: then a round commits N tokens); sampled, the distribution of autoregressive
sampling (a bigram checkpoint whose distributions are known); a row alone equals the row in a
ragged batch; the CLI and the server decode it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from bigram import BIGRAM, distance, make_bigram, sequences
from cli_run import run_main
from oracles import check_converted_copies, check_ragged_batch, decoded, greedy_ar
from safetensors.numpy import load_file, save_file
from server_runs import post_json, running_server

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.testing.block_checkpoints import SDAR_MASK, idlm_as_qwen3, write_idlm
from model_adapters import adapter_for

TOL = 1e-4
FORCED, ANSWER = 100, 37  # the forced checkpoints' tokens
PROMPTS = ["Hello there", "abc", "The quick brown fox jumps", "x"]


def _accept_one_then_reject(path: Path) -> Path:
    """A forced checkpoint where FORCED is followed by ANSWER: every position predicts FORCED
    (masks too) except a FORCED token's, which predicts ANSWER; so the drafts [FORCED, ...]
    after a pending ANSWER have their first accepted and their second rejected."""
    write_idlm(path, forced=FORCED)
    w = load_file(str(path / "model.safetensors"))
    w["model.embed_tokens.weight"][:, 1] = 0.0
    w["model.embed_tokens.weight"][FORCED, 1] = 60.0
    w["lm_head.weight"][ANSWER, 1] = 1.0
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import mlx_lm

    root = tmp_path_factory.mktemp("idlm")
    paths = {
        "random": write_idlm(root / "random"),
        "forced": write_idlm(root / "forced", forced=FORCED),
        "alternating": _accept_one_then_reject(root / "alternating"),
    }
    loaded = {}
    for name, path in paths.items():
        loaded[name] = (path, mld.load(str(path)), mlx_lm.load(str(idlm_as_qwen3(path, root / f"{name}-qwen3"))))
    return loaded


def test_it_loads_as_idlm_from_its_sdar_config(checkpoints):
    path, (model, tokenizer), _ = checkpoints["random"]
    assert json.loads((path / "config.json").read_text())["model_type"] == "sdar"
    assert type(model).__module__ == "model_adapters.families.idlm"
    adapter = adapter_for(model, tokenizer)
    assert (adapter.family, adapter.mask_id, adapter.block_length) == ("I-DLM", SDAR_MASK, 4)  # N = block_size + 1


def test_forward_matches_transformers_qwen3(checkpoints):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path, (model, _), _ = checkpoints["random"]
    cfg = json.loads((path / "config.json").read_text())
    config = Qwen3Config(
        **{
            k: cfg[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "num_hidden_layers",
                "vocab_size",
                "rope_theta",
                "rms_norm_eps",
                "max_position_embeddings",
            )
        },
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    ref = Qwen3ForCausalLM(config).eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(str(path / "model.safetensors")).items()})
    ids = np.random.default_rng(0).integers(0, 256, (2, 19))
    ids[:, 12:] = SDAR_MASK  # (mask rows: the model reads them causally too)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(ids)).logits.numpy()
    ours = np.array(model(mx.array(ids)))
    assert np.abs(ours - theirs).max() <= TOL


@pytest.mark.parametrize("name", ["random", "alternating"])
@pytest.mark.parametrize("strides", [2, 4, 6])
def test_greedy_is_greedy_autoregressive(checkpoints, name, strides):
    _, pair, stock = checkpoints[name]
    tokenizer = pair[1]
    for prompt, max_tokens in zip(PROMPTS, (24, 9, 17, 5)):
        ids = tokenizer.encode(prompt)
        tokens, forwards = decoded(pair, ids, max_tokens, block_length=strides)
        assert tokens == greedy_ar(stock, ids, max_tokens), (prompt, strides)
        assert forwards <= max(len(tokens) - 1, 0)  # (a round commits one token at least)


def test_rounds_reject_where_the_drafts_go_wrong(checkpoints):
    """Random weights: the drafts are wrong at once, one token per round; the alternating
    checkpoint: a draft accepted, the next rejected, two tokens per round after the first."""
    _, pair, _ = checkpoints["random"]
    tokens, forwards = decoded(pair, pair[1].encode("abc"), 24)
    assert len(tokens) == 24 and forwards == 23
    _, pair, stock = checkpoints["alternating"]
    ids = pair[1].encode("abc")
    tokens, forwards = decoded(pair, ids, 24)
    assert tokens[:4] == [FORCED, ANSWER, FORCED, ANSWER] and tokens == greedy_ar(stock, ids, 24)
    assert forwards < len(tokens) - 1


@pytest.mark.parametrize("strides", [2, 3, 4, 8])
def test_a_checkpoint_whose_masks_predict_the_continuation_commits_n_per_round(checkpoints, strides):
    _, pair, stock = checkpoints["forced"]
    ids = pair[1].encode("abc")
    tokens, forwards = decoded(pair, ids, 24, block_length=strides)
    assert tokens == greedy_ar(stock, ids, 24) == [FORCED] * 24
    # the first token is the prompt's; the cold round adds one and drafts; every later round N
    assert forwards == 1 + math.ceil((24 - 2) / strides)


def test_a_row_alone_equals_the_row_in_a_ragged_batch(checkpoints):
    for name in ("random", "forced"):
        check_ragged_batch(checkpoints[name][1])


def test_commit_rules_and_temperature_schedules_are_refused(checkpoints):
    _, (model, tokenizer), _ = checkpoints["random"]
    with pytest.raises(ValueError, match="temperature_schedule does not apply to I-DLM"):
        mld.generate(model, tokenizer, "abc", max_tokens=4, temperature_schedule=[0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="threshold does not apply to I-DLM"):
        mld.generate(model, tokenizer, "abc", max_tokens=4, threshold=0.9)
    with pytest.raises(ValueError, match="block_length >= 2"):
        mld.generate(model, tokenizer, "abc", max_tokens=4, block_length=1)


def test_the_cli_and_the_server_decode_it(checkpoints):
    path, (model, tokenizer), _ = checkpoints["alternating"]
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
        sampled = post_json(
            httpd.server_address[1],
            "/v1/completions",
            {"prompt": "abc", "max_tokens": 10, "temperature": 0.8, "seed": 1},
        )
    assert status == 200 and body["choices"][0]["text"] == expected
    assert sampled[0] == 200 and sampled[1]["usage"]["completion_tokens"] > 0


# -- sampling: a bigram checkpoint whose distributions are known exactly (tests/helpers/bigram.py)


def _bigram(path: Path) -> Path:
    write_idlm(path)
    w = make_bigram(load_file(str(path / "model.safetensors")), norm_one=1.0)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_sampled_decoding_draws_from_the_autoregressive_distribution(tmp_path):
    """Each written token is a draw after the tokens before it: over 4,000 decodes of 5
    tokens (rounds of N = 4 whose drafts are accepted about half the time), the distribution
    of the 32 sequences is the chain's own within sampling noise, and far from what accepting
    the drafts unchecked would give."""
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mld.load(str(_bigram(tmp_path / "bigram")))
    mx.random.seed(3)
    runs = 4000
    batch = mld.generate_batch(
        model, tokenizer, ["abc"] * runs, max_tokens=5, sampler=make_sampler(1.0), return_token_ids=True
    )
    counts: dict = {}
    for tokens in batch.token_ids:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    exact = sequences(5, BIGRAM["other"])
    assert set(counts) <= set(exact)
    assert distance(counts, exact) < 0.06, distance(counts, exact)
    unchecked = {}  # (the first two tokens from the chain, then the masks' 0.5 / 0.5 drafts kept)
    for seq, p in sequences(2, BIGRAM["other"]).items():
        for tail, q in sequences(3, (0.5, 0.5)).items():
            unchecked[seq + tail] = p * 0.5**3
    assert 0.5 * sum(abs(unchecked.get(seq, 0) - p) for seq, p in exact.items()) > 0.15
    assert sum(batch.forwards) < sum(len(t) - 1 for t in batch.token_ids)  # (drafts were accepted)


def test_convert_and_quantize_keep_it_idlm(checkpoints, tmp_path):
    """mlx_lm_diffusion.convert writes the checkpoint's own config (model_type "sdar" and the
    switch): the MLX copy loads as I-DLM and decodes the same tokens; a 4-bit copy loads and
    decodes too."""
    path, pair, _ = checkpoints["random"]
    check_converted_copies(path, pair, tmp_path, "model_adapters.families.idlm")


def test_frames_show_the_drafts_as_drafts(checkpoints):
    """The studio's frames (serving.responses.draft_frame) mark the next round's drafts `d`
    and the accepted tokens `c`; a draft never lies inside the final prefix."""
    from mlx_lm_diffusion.decoding.engine import Engine
    from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
    from mlx_lm_diffusion.serving.responses import draft_frame

    _, (model, tokenizer), _ = checkpoints["forced"]
    adapter = adapter_for(model, tokenizer)
    prompt = tokenizer.encode("abc")
    frames, drafted = [], 0
    for step in Engine(adapter, resolve(DecodeOptions(max_tokens=16), adapter, len(prompt))).run(mx.array([prompt])):
        frame = draft_frame(tokenizer, step, adapter.mask_id, {})
        frames.append(frame)
        if step.drafted is not None:
            start, end = (p - len(prompt) for p in step.drafted)
            assert start >= int(step.final[0]) and frame["states"][start:end] == "d" * (end - start)
            drafted += 1
    assert drafted >= 3 and frames[-1]["states"] == "c" * 16  # (the last frame: all accepted, no draft)


# -- the LoRA flavour: a stock Qwen3 whose mask rows take a PEFT LoRA (model_adapters.idlm_lora)


@pytest.fixture(scope="module")
def lora_flavour(tmp_path_factory):
    import mlx_lm

    from mlx_lm_diffusion.testing.block_checkpoints import write_idlm_lora

    root = tmp_path_factory.mktemp("idlm-lora")
    base = idlm_as_qwen3(write_idlm(root / "idlm"), root / "qwen3")
    lora = write_idlm_lora(root / "lora", base)
    return base, lora, mld.load(str(base), adapter_path=str(lora)), mlx_lm.load(str(base))


def _torch_with_mask_row_lora(base: Path, lora: Path, tokens: list, mask_id: int):
    """transformers' Qwen3ForCausalLM on the base weights, each adapted projection's output plus
    scale * B(A x) on the rows whose input token is the mask (forward hooks): the reference's
    conditional LoRA, written here."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    config = json.loads((lora / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapter = {k: torch.tensor(v) for k, v in load_file(str(lora / "adapter_model.safetensors")).items()}
    rows = (torch.tensor(tokens) == mask_id).float()[None, :, None]
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in adapter:
            a, b = adapter[key], adapter[key.replace("lora_A", "lora_B")]
            module.register_forward_hook(lambda m, inp, out, a=a, b=b: out + scale * (inp[0] @ a.T @ b.T) * rows)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_the_lora_flavour_matches_a_torch_conditional_lora(lora_flavour):
    """A stock Qwen3 plus a PEFT LoRA loads as I-DLM (the tokenizer's mask token); a window's
    logits equal transformers' Qwen3 with the LoRA added on the mask rows only; the verify rows
    are the base model's, the mask rows are not."""
    base, lora, (model, tokenizer), _ = lora_flavour
    assert type(model).__module__ == "model_adapters.families.idlm" and model.args.mask_token_id == SDAR_MASK
    tokens = tokenizer.encode("The quick brown fox") + [40, 41, 42] + [SDAR_MASK] * 3
    got = np.array(model(mx.array([tokens]))[0])
    expected = _torch_with_mask_row_lora(base, lora, tokens, SDAR_MASK)
    assert np.abs(got - expected).max() < TOL * max(1.0, np.abs(expected).max())
    plain = _torch_with_mask_row_lora(base, lora, tokens, -1)  # (no row adapted: the base model)
    assert np.abs(got[:-3] - plain[:-3]).max() < TOL * max(1.0, np.abs(plain).max())
    assert np.abs(got[-3:] - plain[-3:]).max() > 1e-2


@pytest.mark.parametrize("strides", [2, 4])
def test_the_lora_flavour_decodes_as_the_base_models_greedy_decoding(lora_flavour, strides):
    base, lora, pair, ar = lora_flavour
    for prompt in PROMPTS[:3]:
        ids = pair[1].encode(prompt)
        tokens, forwards = decoded(pair, ids, 20, block_length=strides)
        assert tokens == greedy_ar(ar, ids, 20), prompt
        assert forwards <= len(tokens) - 1


def test_the_lora_flavour_through_the_cli_and_its_refusals(lora_flavour, tmp_path):
    base, lora, (model, tokenizer), _ = lora_flavour
    expected = mld.generate(model, tokenizer, "abc", max_tokens=10)
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(base),
        "--adapter-path",
        str(lora),
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
    sdar = write_idlm(tmp_path / "sdar-like")
    config = json.loads((sdar / "config.json").read_text())
    config.pop("use_regular_causal")
    (sdar / "config.json").write_text(json.dumps(config))  # (an SDAR checkpoint: not I-DLM)
    with pytest.raises(ValueError, match="PEFT LoRA adapter, read only as I-DLM's LoRA flavour"):
        mld.load(str(sdar), adapter_path=str(lora))
