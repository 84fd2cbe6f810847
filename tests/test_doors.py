"""install() doors that cannot drive a diffusion model refuse saying what to call
instead (issue 12, part 8); generate_batch takes strings as well as token lists."""

import importlib
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest

import mlx_lm_diffusion as mld

generate_module = importlib.import_module("mlx_lm.generate")
PROMPT = [72, 101, 108, 108, 111, 44, 32]


def test_batch_generate_after_install_names_generate_batch(llada, installed):
    model, tok = llada
    for batch_generate in (mlx_lm.batch_generate, generate_module.batch_generate):
        with pytest.raises(ValueError, match=r"mlx_lm_diffusion\.generate_batch"):
            batch_generate(model, tok, [PROMPT, PROMPT], max_tokens=4)


def test_cache_prompt_after_install_says_there_is_no_kv_cache(llada, installed):
    model, _ = llada
    cache_prompt = importlib.import_module("mlx_lm.cache_prompt")
    with pytest.raises(ValueError, match="key/value cache.*keeps none"):
        next(cache_prompt.generate_step(mx.array(PROMPT), model))


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
    originals = {(m, a): getattr(importlib.import_module(m), a) for m, a, _, _ in
                 importlib.import_module("mlx_lm_diffusion.install").REFUSALS}
    mld.install()
    try:
        assert importlib.import_module("mlx_lm_diffusion.install").installed()
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
    r = subprocess.run([sys.executable, "-c", script, str(llada_path), str(tmp_path / "c.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "keeps none" in r.stderr and "update_and_fetch" not in r.stderr
    assert not (tmp_path / "c.safetensors").exists()


# ----------------------------------------------------------------------------- generate_batch


def test_generate_batch_takes_strings(llada):
    model, tok = llada
    a, b = "Hello", "World"
    rows, forwards = mld.generate_batch(model, tok, [a, b], max_tokens=8, block_length=4)
    assert forwards > 0
    for prompt, row in zip((a, b), rows):
        assert row == [r.token for r in mld.stream_generate(model, tok, prompt, max_tokens=8, block_length=4)
                       if r.finish_reason != "stop"]
    ids = [list(tok.encode(a)), list(tok.encode(b))]
    assert mld.generate_batch(model, tok, ids, max_tokens=8, block_length=4)[0] == rows
    assert mld.generate_batch(model, tok, [ids[0], b], max_tokens=8, block_length=4)[0] == rows  # mixed
    assert mld.generate_batch(model, tok, mx.array(ids), max_tokens=8, block_length=4)[0] == rows


@pytest.mark.parametrize(
    "prompts,word",
    [
        (["Hi", "Hello"], "equal token length"),
        ([[1, 2], [1, 2, 3]], "equal token length"),
        ("Hello", "list of prompts"),
        ([1, 2, 3], "list of prompts"),
        ([], "one or more"),
    ],
)
def test_generate_batch_bad_prompts_are_clear_value_errors(llada, prompts, word):
    model, tok = llada
    with pytest.raises(ValueError, match=word):
        mld.generate_batch(model, tok, prompts, max_tokens=4)
