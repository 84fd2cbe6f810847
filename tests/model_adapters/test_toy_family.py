"""A family added from outside the package (tests/helpers/toy_family.py: a logit shift and an
option of its own) decodes through generate, the CLI and the server, with no change
to the engine, the options or the front doors."""

import json

import openai
import pytest
import toy_family  # noqa: F401  (registers the family: the one registry line)
from cli_run import run_main
from server_runs import running_server

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.options import named_options
from mlx_lm_diffusion.testing.checkpoints import write_dream

PROMPT = [72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The same weights as a Dream checkpoint and as a toy one."""
    dream = write_dream(tmp_path_factory.mktemp("dream"))
    toy = tmp_path_factory.mktemp("toy")
    for f in dream.iterdir():
        (toy / f.name).write_bytes(f.read_bytes())
    config = json.loads((toy / "config.json").read_text())
    (toy / "config.json").write_text(json.dumps({**config, "model_type": toy_family.MODEL_TYPE}))
    return dream, toy


def test_generate_with_the_family_option(paths):
    dream, toy = (mld.load(str(p)) for p in paths)
    assert type(toy[0]).__module__ == "toy_family"
    kw = dict(max_tokens=16, block_length=8, strategy="low_confidence")
    shifted = mld.generate(*toy, PROMPT, **kw)
    assert shifted == mld.generate(*dream, PROMPT, **kw)  # Dream's shift, Dream's tokens
    assert mld.generate(*toy, PROMPT, logit_shift=1, **kw) == shifted
    unshifted = list(mld.stream_generate(*toy, PROMPT, logit_shift=0, **kw))
    assert len(unshifted) >= 1
    with pytest.raises(ValueError, match="logit_shift"):
        mld.generate(*toy, PROMPT, logit_shift=2, **kw)
    with pytest.raises(ValueError, match="logit_shift does not apply to Dream"):
        mld.generate(*dream, PROMPT, logit_shift=1, **kw)


def test_the_cli_has_the_family_flag(paths):
    _, toy = paths
    base = ["--model", str(toy), "--prompt", "Hi", "--ignore-chat-template", "--max-tokens", "8"]
    ok = run_main("mlx_lm_diffusion.generate", *base, "--logit-shift", "0")
    assert ok.returncode == 0, ok.stderr
    bad = run_main("mlx_lm_diffusion.generate", *base, "--logit-shift", "5")
    assert bad.returncode == 2 and "logit_shift" in bad.stderr


def test_the_server_takes_the_family_field(paths, tmp_path):
    import huggingface_hub.constants as hf_constants

    assert "logit_shift" in named_options()
    _, toy = paths
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        with running_server(["--model", str(toy), "--port", "0"]) as (httpd, _):
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="unused", max_retries=0, timeout=120
            )
            model, tok = mld.load(str(toy))
            want = mld.generate(model, tok, "Hi", max_tokens=8, logit_shift=0)
            got = client.completions.create(
                model="default_model", prompt="Hi", max_tokens=8, extra_body={"logit_shift": 0}
            )
            assert got.choices[0].text == want
            with pytest.raises(openai.BadRequestError, match="logit_shift"):
                client.completions.create(
                    model="default_model", prompt="Hi", max_tokens=8, extra_body={"logit_shift": 7}
                )
