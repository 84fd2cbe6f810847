"""The generate CLI's --suffix (infill) and --allowed-tokens, and their one-line errors."""

from cli_run import run_main

import mlx_lm_diffusion as mld


def test_suffix_prints_the_filled_middle(llada_path, llada):
    model, tok = llada
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(llada_path),
        "--prompt",
        "def f(x):",
        "--suffix",
        "\\n    return y",
        "--max-tokens",
        "8",
        "--block-length",
        "4",
        "--ignore-chat-template",
        "--verbose",
        "False",
    )
    assert r.returncode == 0, r.stderr
    want = mld.generate(model, tok, tok.encode("def f(x):"), max_tokens=8, block_length=4, suffix="\n    return y")
    assert r.stdout == want + "\n"


def test_allowed_tokens_flag(llada_path):
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(llada_path),
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--allowed-tokens",
        "97",
        "98",
        "--temp",
        "1.0",
        "--ignore-chat-template",
        "--verbose",
        "False",
    )
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.strip()) <= {"a", "b"}


def test_bad_suffix_and_allowed_tokens_are_one_line(llada_path):
    for flags, word in (
        (["--suffix", "<|mdm_mask|>"], "mask token"),
        (["--allowed-tokens", "260"], "mask token"),
        (["--allowed-tokens", "100000"], "outside the vocabulary"),
    ):
        r = run_main("mlx_lm_diffusion.generate", "--model", str(llada_path), "--prompt", "Hi", *flags)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and word in lines[0], r.stderr
