"""A request is resolved once and handed down (issue 52.1): one Python `generate` and one
server chat request (batched and serial) each build one adapter and resolve their
options once (mlx_lm_diffusion.api.decode.build_decode); before, a server request built
five adapters and resolved its options three times."""

import collections
import sys

import pytest
from server_runs import demo_server, post_json

import mlx_lm_diffusion as mld
import model_adapters.base as adapter_base
from mlx_lm_diffusion.decoding import options as options_module
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH


@pytest.fixture
def counts(monkeypatch):
    """Counts of adapters built and option resolutions, wherever `resolve` was imported."""
    counted = collections.Counter()
    build, resolve = adapter_base.Adapter.__init__, options_module.resolve

    def counting_build(self, *args, **kwargs):
        counted["adapters"] += 1
        build(self, *args, **kwargs)

    def counting_resolve(*args, **kwargs):
        counted["resolutions"] += 1
        return resolve(*args, **kwargs)

    monkeypatch.setattr(adapter_base.Adapter, "__init__", counting_build)
    for name, module in list(sys.modules.items()):
        if name.startswith(("mlx_lm_diffusion", "model_adapters")) and getattr(module, "resolve", None) is resolve:
            monkeypatch.setattr(module, "resolve", counting_resolve)
    return counted


def test_a_python_generate_builds_one_adapter_and_resolves_once(counts):
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    counts.clear()
    assert mld.generate(model, tokenizer, "357+468=", max_tokens=8)
    assert counts == {"adapters": 1, "resolutions": 1}


@pytest.mark.parametrize("mode", ["batched", "serial"])
def test_a_server_chat_request_builds_one_adapter_and_resolves_once(counts, mode):
    with demo_server(mode) as (httpd, _):
        port = httpd.server_address[1]
        chat = {"messages": [{"role": "user", "content": "357+468="}], "max_tokens": 8}
        assert post_json(port, "/v1/chat/completions", chat)[0] == 200  # (a batch's lane and adapter exist now)
        counts.clear()
        status, answer = post_json(port, "/v1/chat/completions", chat)
        assert status == 200 and answer["choices"][0]["message"]["content"]
        assert counts == {"adapters": 1, "resolutions": 1}
