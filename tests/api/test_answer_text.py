"""An answer's text is what the model wrote, and OpenAI's log-probability entries add up to
it (issue 54.2): mlx-lm's streaming detokenizer dropped the answer's leading space, so the
model's " anshth" came back as "anshth" while the token's own text kept the space. The
model is tests/helpers/scripted_family.py, which writes a given answer."""

from __future__ import annotations

import json

import pytest
import scripted_family
from server_runs import post_json, running_server

from mlx_lm_diffusion.testing.checkpoints import write_dream

ANSWER = " anshth and"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = write_dream(tmp_path_factory.mktemp("scripted"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": scripted_family.MODEL_TYPE}))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(scripted_family, "SCRIPT", ANSWER)
        yield path


@pytest.mark.parametrize("mode", ["batched", "serial"])
def test_the_entries_add_up_to_the_answer_with_its_leading_space(scripted, mode):
    flags = [] if mode == "batched" else ["--no-batch"]
    with running_server(
        ["--model", str(scripted), "--port", "0", "--log-level", "WARNING", "--max-tokens", "16", *flags]
    ) as (httpd, _):
        port = httpd.server_address[1]
        status, body = post_json(port, "/v1/chat/completions", {"messages": USER, "logprobs": True})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["message"]["content"] == ANSWER
        assert "".join(e["token"] for e in choice["logprobs"]["content"]) == ANSWER
        status, body = post_json(port, "/v1/completions", {"prompt": "hi", "logprobs": 1})
        choice = body["choices"][0]
        assert choice["text"] == ANSWER and "".join(choice["logprobs"]["tokens"]) == ANSWER
        assert choice["logprobs"]["text_offset"][0] == 0


def test_the_python_api_keeps_it_too(scripted):
    from mlx_lm_diffusion import generate, load

    model, tokenizer = load(str(scripted))
    assert generate(model, tokenizer, "hi", max_tokens=16) == ANSWER
