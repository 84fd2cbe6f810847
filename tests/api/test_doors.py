"""install() doors that cannot drive a diffusion model refuse saying what to call
instead (issue 12, part 8; next-token perplexity and training too); mlx_lm.batch_generate drives diffusion models through
generate_batch, which takes strings as well as token lists of any lengths (issue 15)."""

import importlib
import subprocess
import sys
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import llama

import mlx_lm_diffusion as mld

generate_module = importlib.import_module("mlx_lm.generate")
PROMPT = [72, 101, 108, 108, 111, 44, 32]


def test_batch_generate_after_install_drives_generate_batch(llada, installed):
    model, tok = llada
    prompts = [PROMPT, PROMPT[:3]]
    expected = mld.generate_batch(model, tok, prompts, max_tokens=6, return_token_ids=True)
    for batch_generate in (mlx_lm.batch_generate, generate_module.batch_generate):
        out = batch_generate(model, tok, prompts, max_tokens=6, return_token_ids=True)
        assert isinstance(out, generate_module.BatchResponse)
        assert out.texts == expected.texts and out.token_ids == expected.token_ids
        assert out.stats.generation_tokens == sum(len(t) for t in out.token_ids) + out.finish_reasons.count("stop")


def test_cache_prompt_after_install_says_there_is_no_kv_cache(llada, installed):
    model, _ = llada
    cache_prompt = importlib.import_module("mlx_lm.cache_prompt")
    with pytest.raises(ValueError, match="key/value cache.*keeps none"):
        next(cache_prompt.generate_step(mx.array(PROMPT), model))


def test_perplexity_after_install_refuses_a_diffusion_model(llada, installed):
    model, _ = llada
    data = mx.array([PROMPT * 2] * 2)
    with pytest.raises(ValueError, match="perplexity would mean nothing"):
        importlib.import_module("mlx_lm.perplexity").eval_ppl(model, data, batch_size=2)


def test_next_token_training_after_install_refuses_a_diffusion_model(llada, tmp_path, installed):
    model, _ = llada
    lora = importlib.import_module("mlx_lm.lora")
    trainer = importlib.import_module("mlx_lm.tuner.trainer")
    before = {name for name, _ in model.named_modules()}
    args = SimpleNamespace(
        adapter_path=str(tmp_path / "adapters"),
        seed=0,
        num_layers=1,
        fine_tune_type="lora",
        lora_parameters={"rank": 2, "dropout": 0.0, "scale": 1.0},
        batch_size=1,
        test_batches=1,
    )
    for call in (
        lambda: lora.train_model(args, model, [], []),
        lambda: lora.evaluate_model(args, model, []),
        lambda: trainer.train(model, None, []),
        lambda: trainer.evaluate(model, [], 1, 1),
        lambda: trainer.evaluate(model, [], 1, 1, loss=trainer.default_loss),
    ):
        with pytest.raises(ValueError, match="next-token loss"):
            call()
    # refused before anything was done: no LoRA layers, no adapter folder
    assert {name for name, _ in model.named_modules()} == before and not (tmp_path / "adapters").exists()

    class OwnLoss(Exception):
        pass

    def masked_diffusion_loss(model, batch, lengths):
        raise OwnLoss  # (reached: a caller's own loss is not refused)

    with pytest.raises(OwnLoss):
        trainer.evaluate(model, [[PROMPT, 0]], 1, 1, loss=masked_diffusion_loss)


def test_refusals_pass_autoregressive_models_through(installed):
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=128,
    )
    model = llama.Model(args)
    ppl, _ = importlib.import_module("mlx_lm.perplexity").eval_ppl(model, mx.array([PROMPT * 2] * 2), batch_size=2)
    assert 1.0 < ppl < 1e4


def test_stream_generate_bound_before_install_names_install(llada):
    model, tok = llada
    from mlx_lm import stream_generate  # bound first, as a script does at its top

    with pytest.raises(ValueError, match=r"install\(\)"):  # never installed: the TokenCache says so
        next(stream_generate(model, tok, PROMPT, max_tokens=4))
    mld.install()
    try:
        with pytest.raises(ValueError, match=r"bound before mlx_lm_diffusion\.install\(\)"):
            next(stream_generate(model, tok, PROMPT, max_tokens=4))
        # the names install() patched work: mlx_lm.stream_generate looked up now
        assert [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=4)] == [
            r.token for r in mld.stream_generate(model, tok, PROMPT, max_tokens=4)
        ]
    finally:
        mld.uninstall()


def test_refusals_leave_autoregressive_models_alone_and_uninstall_restores():
    originals = {
        (m, a): getattr(importlib.import_module(m), a)
        for m, a, _, _ in importlib.import_module("mlx_lm_diffusion.api.install").REFUSALS
    }
    mld.install()
    try:
        assert importlib.import_module("mlx_lm_diffusion.api.install").installed()
        for (m, a), original in originals.items():
            patched = getattr(importlib.import_module(m), a)
            assert patched is not original and patched.__wrapped__ is original
    finally:
        mld.uninstall()
    assert all(getattr(importlib.import_module(m), a) is f for (m, a), f in originals.items())


def test_cache_prompt_cli_after_install_is_one_clear_error(llada_path, tmp_path):
    script = (
        "import sys, mlx_lm_diffusion as mld; mld.install(); import mlx_lm.cache_prompt as cp; "
        "sys.argv = ['cache_prompt', '--model', sys.argv[1], '--prompt', 'Hello', "
        "'--prompt-cache-file', sys.argv[2]]; cp.main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(llada_path), str(tmp_path / "c.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "keeps none" in r.stderr and "update_and_fetch" not in r.stderr
    assert not (tmp_path / "c.safetensors").exists()


# ----------------------------------------------------------------------------- generate_batch


def test_generate_batch_takes_strings(llada):
    model, tok = llada
    a, b = "Hello", "World"
    kw = dict(max_tokens=8, block_length=4, return_token_ids=True, return_logprobs=True)
    out = mld.generate_batch(model, tok, [a, b, "Hello there"], **kw)  # different lengths
    for i, prompt in enumerate((a, b, "Hello there")):
        alone = list(mld.stream_generate(model, tok, prompt, max_tokens=8, block_length=4))
        tokens = [r.token for r in alone if r.finish_reason != "stop"]
        assert out.token_ids[i] == tokens and out.texts[i] == tok.decode(tokens)
        assert out.forwards[i] == alone[-1].forwards > 0
        assert out.finish_reasons[i] == alone[-1].finish_reason
        assert out.logprobs[i] == pytest.approx([r.logprobs[r.token].item() for r in alone][: len(tokens)], abs=1e-5)
    rows = out.token_ids[:2]
    ids = [list(tok.encode(a)), list(tok.encode(b))]
    assert mld.generate_batch(model, tok, ids, **kw).token_ids == rows
    assert mld.generate_batch(model, tok, [ids[0], b], **kw).token_ids == rows  # mixed
    assert mld.generate_batch(model, tok, mx.array(ids), **kw).token_ids == rows
    per_row = mld.generate_batch(model, tok, [a, b], max_tokens=[3, 8], block_length=4, return_token_ids=True)
    assert len(per_row.token_ids[0]) <= 3 and per_row.token_ids[1] == rows[1]


@pytest.mark.parametrize(
    "prompts,word",
    [
        ([[1, 2], [1, 2, 3]], "max_tokens has 1 entries"),
        ("Hello", "list of prompts"),
        ([1, 2, 3], "list of prompts"),
        ([], "one or more"),
    ],
)
def test_generate_batch_bad_prompts_are_clear_value_errors(llada, prompts, word):
    model, tok = llada
    with pytest.raises(ValueError, match=word):
        mld.generate_batch(model, tok, prompts, max_tokens=[4] if word.startswith("max_tokens") else 4)
