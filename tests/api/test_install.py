"""install(): stock mlx-lm entry points drive diffusion models; autoregressive models
behave exactly as before; the prompt cache equals prompt + yielded tokens at every yield."""

import importlib
import json
import os
import subprocess
import sys
import threading

import mlx.core as mx
import mlx_lm
import openai
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.compat import TokenCache
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
from mlx_lm_diffusion.testing.checkpoints import VOCAB, write_dream, write_llada, write_tokenizer
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma, write_nemotron

install_module = importlib.import_module("mlx_lm_diffusion.api.install")
cache_module = importlib.import_module("mlx_lm.models.cache")
generate_module = importlib.import_module("mlx_lm.generate")

PROMPT = [72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def ar_path(tmp_path_factory):
    """A tiny random Llama checkpoint (mlx-lm layout) with the byte-level tokenizer."""
    path = tmp_path_factory.mktemp("llama")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "eos_token_id": 256,
    }
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (path / "config.json").write_text(json.dumps(config))
    write_tokenizer(path)
    return path


def ar_outputs(model, tok):
    text = mlx_lm.generate(model, tok, PROMPT, max_tokens=10)
    stream = [
        (r.token, r.text, r.finish_reason, r.logprobs.tolist())
        for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=10)
    ]
    cache = cache_module.make_prompt_cache(model)
    cached = [r.token for r in generate_module.stream_generate(model, tok, PROMPT, max_tokens=6, prompt_cache=cache)]
    return text, stream, cached, [type(c) for c in cache], cache[0].offset


def test_autoregressive_models_unchanged(ar_path):
    model, tok = mlx_lm.load(str(ar_path))
    before = ar_outputs(model, tok)
    assert before[3] == [KVCache, KVCache]
    mld.install()
    try:
        assert mlx_lm.load(str(ar_path))[0].args.model_type == "llama"
        during = ar_outputs(model, tok)
    finally:
        mld.uninstall()
    assert ar_outputs(model, tok) == before
    assert during == before


def test_stock_generate_and_stream_generate_drive_diffusion(llada, installed):
    model, tok = llada
    reference = list(mld.stream_generate(model, tok, PROMPT, max_tokens=16))
    stock = list(mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=16))
    assert [r.token for r in stock] == [r.token for r in reference]
    assert [r.finish_reason for r in stock] == [r.finish_reason for r in reference]
    assert mlx_lm.generate(model, tok, PROMPT, max_tokens=16) == mld.generate(model, tok, PROMPT, max_tokens=16)
    # mlx-lm's keyword-only calling style, as mlx_lm.server calls it
    kw = list(
        generate_module.stream_generate(
            model=model, tokenizer=tok, prompt=PROMPT, max_tokens=16, kv_bits=None, prefill_step_size=2048
        )
    )
    assert [r.token for r in kw] == [r.token for r in reference]


def test_stock_load_of_a_diffusion_checkpoint(llada_path, installed):
    model, tok = mlx_lm.load(str(llada_path))
    assert model.args.model_type == "llada"
    assert mlx_lm.generate(model, tok, PROMPT, max_tokens=8) == mld.generate(model, tok, PROMPT, max_tokens=8)


def _env_as_a_user_has_it() -> dict:
    """os.environ without the TRANSFORMERS_VERBOSITY=error (and no-advisory-warnings) that
    importing mlx_vlm sets in this process: a subprocess would inherit them and print no
    transformers warning at all (the positive control then failed in the full run)."""
    return {
        k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS")
    }


def test_loading_sdar_prints_no_config_warning(tmp_path):
    """transformers' "`rope_scaling` is deprecated", from AutoTokenizer reading SDAR's config."""
    path = write_sdar(tmp_path / "sdar")
    script = (
        "import sys, mlx_lm, mlx_lm_diffusion as mld; mld.load(sys.argv[1]); mld.install(); mlx_lm.load(sys.argv[1])"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env_as_a_user_has_it(),
    )
    assert r.returncode == 0 and "rope_scaling" not in r.stderr and "Warning" not in r.stderr, r.stderr


def test_stock_load_prints_no_unknown_model_type_warning(tmp_path):
    # (a fresh process: transformers' logging handler writes to the real stderr; a fresh
    # checkpoint: the session's may have gained files from other tests)
    llada_path = write_llada(tmp_path / "llada")
    script = (
        "import sys, mlx_lm, mlx_lm_diffusion as mld; mld.install(); mlx_lm.load(sys.argv[1]); "
        "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(sys.argv[1])"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(llada_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env_as_a_user_has_it(),
    )
    assert r.returncode == 0, r.stderr
    # the second load, outside mlx_lm.load, shows the warning still reaches other callers
    assert r.stderr.count("instantiate a model of type") == 1, r.stderr


@pytest.mark.parametrize("stop_after", [1, 5, None])
def test_prompt_cache_is_prompt_plus_yielded_at_every_yield(llada, installed, stop_after):
    model, tok = llada
    cache = cache_module.make_prompt_cache(model)
    assert [type(c) for c in cache] == [TokenCache]
    assert not any(hasattr(c, "merge") for c in cache)  # mlx_lm.server will not batch it
    yielded = []
    for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=16, prompt_cache=cache):
        yielded.append(r.token)
        assert cache[0].tokens == PROMPT + yielded
        if len(yielded) == stop_after:
            break  # as the server and chat do on stop strings and disconnects
    assert cache[0].tokens == PROMPT + yielded
    # the next turn continues the cached conversation: same as decoding it whole
    turn = [10, 65, 66]
    after = [r.token for r in mlx_lm.stream_generate(model, tok, turn, max_tokens=8, prompt_cache=cache)]
    whole = [r.token for r in mld.stream_generate(model, tok, PROMPT + yielded + turn, max_tokens=8)]
    assert after == whole
    assert cache[0].tokens == PROMPT + yielded + turn + after


def test_lru_prompt_cache_trims_token_caches_exactly():
    """mlx_lm.server's LRU prompt cache reuses TokenCaches by prefix, exactly."""
    lru = cache_module.LRUPromptCache(max_size=4)
    stored = list(range(10))
    lru.insert_cache("m", stored, [TokenCache(stored)])
    cache, rest = lru.fetch_nearest_cache("m", stored)  # exact
    assert (cache[0].tokens, rest) == (stored, [])
    cache[0].add([99])
    assert lru.fetch_nearest_cache("m", stored)[0][0].tokens == stored  # a copy was handed out
    query = stored[:6] + [50, 51]  # shares 6 tokens with a longer entry
    cache, rest = lru.fetch_nearest_cache("m", query)
    assert cache[0].tokens + rest == query
    cache, rest = lru.fetch_nearest_cache("m", stored[:4])  # a prefix of the entry
    assert cache[0].tokens + rest == stored[:4] and rest


def test_install_is_idempotent_and_uninstall_restores():
    targets = [(importlib.import_module(m), a) for m, a, _ in install_module.TARGETS]
    originals = [getattr(m, a) for m, a in targets]
    mld.install()
    mld.install()
    try:
        assert install_module.installed()
        for (module, attr), original in zip(targets, originals):
            current = getattr(module, attr)
            assert current is not original and current.__wrapped__ is original
    finally:
        mld.uninstall()
    mld.uninstall()
    assert not install_module.installed()
    assert [getattr(m, a) for m, a in targets] == originals


def test_compat_rejects_what_does_not_apply(llada):
    model, tok = llada
    with pytest.raises(ValueError, match="TokenCache"):
        compat.stream_generate(model, tok, PROMPT, prompt_cache=[KVCache(), KVCache()])
    with pytest.raises(ValueError, match="speculative"):
        compat.stream_generate(model, tok, PROMPT, draft_model=model)
    with pytest.raises(ValueError, match="max_tokens"):
        compat.stream_generate(model, tok, PROMPT, max_tokens=0)
    with pytest.raises(ValueError, match="context"):
        compat.stream_generate(model, tok, [65] * 600)
    # key/value-cache options a diffusion model cannot honour: refused when set, not ignored
    for name, value, word in (("kv_bits", 4, "unquantized"), ("max_kv_size", 64, "rotating key/value window")):
        with pytest.raises(ValueError, match=f"{name}: .*{word}"):
            next(compat.stream_generate(model, tok, PROMPT, max_tokens=4, **{name: value}))
        with pytest.raises(ValueError, match=word):
            mld.generate_batch(model, tok, [PROMPT], max_tokens=4, **{name: value})


def test_mlx_lm_defaults_for_cache_and_scheduling_options_pass(llada):
    """What mlx_lm.server, mlx_lm.benchmark and mlx_lm.evaluate pass with their defaults
    changes nothing here: accepted by stream_generate and generate_batch alike."""
    model, tok = llada
    plain = [r.token for r in compat.stream_generate(model, tok, PROMPT, max_tokens=8)]
    passed = dict(
        kv_bits=None,
        max_kv_size=None,
        kv_group_size=64,
        quantized_kv_start=5000,
        num_draft_tokens=3,
        prefill_step_size=2048,
    )
    assert [r.token for r in compat.stream_generate(model, tok, PROMPT, max_tokens=8, **passed)] == plain
    batched = mld.generate_batch(
        model,
        tok,
        [PROMPT],
        max_tokens=8,
        return_token_ids=True,
        completion_batch_size=32,
        prefill_batch_size=8,
        **passed,
    )
    assert batched.token_ids == mld.generate_batch(model, tok, [PROMPT], max_tokens=8, return_token_ids=True).token_ids


def test_max_tokens_fits_the_context(llada):
    model, tok = llada
    room = model.max_length - len(PROMPT)
    assert compat.fit_max_tokens(model, tok, len(PROMPT), -1) == room  # mlx-lm's "no limit"
    assert compat.fit_max_tokens(model, tok, len(PROMPT), 10**6) == room
    assert compat.fit_max_tokens(model, tok, len(PROMPT), 7) == 7


def test_request_options_apply_and_explicit_keywords_win(llada):
    model, tok = llada
    plain = [r.token for r in compat.stream_generate(model, tok, PROMPT, max_tokens=12)]
    small = [r.token for r in mld.stream_generate(model, tok, PROMPT, max_tokens=12, block_length=4, steps=2)]
    with compat.request_options(block_length=4, steps=2):
        scoped = [r.token for r in compat.stream_generate(model, tok, PROMPT, max_tokens=12)]
        explicit = [
            r.token for r in compat.stream_generate(model, tok, PROMPT, max_tokens=12, block_length=12, steps=12)
        ]
    assert scoped == small
    assert explicit == [
        r.token for r in mld.stream_generate(model, tok, PROMPT, max_tokens=12, block_length=12, steps=12)
    ]
    assert [r.token for r in compat.stream_generate(model, tok, PROMPT, max_tokens=12)] == plain


def test_stock_mlx_lm_server_drives_diffusion(llada, llada_path, installed):
    """mlx_lm.server's own ResponseGenerator and APIHandler, after install()."""
    import mlx_lm.server as stock

    from mlx_lm_diffusion.serving import startup as dserver

    args = dserver.parse_args(["--model", str(llada_path), "--port", "0"])
    generator = stock.ResponseGenerator(stock.ModelProvider(args), stock.LRUPromptCache(4))
    httpd = dserver.make_http_server("127.0.0.1", 0, generator, handler_class=stock.APIHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="x", max_retries=0, timeout=120
        )
        messages = [{"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(model="default_model", messages=messages, max_tokens=8)
        model, tok = llada
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        responses = list(mld.stream_generate(model, tok, ids, max_tokens=8))
        keep = responses[:-1] if responses[-1].finish_reason == "stop" else responses
        assert r.choices[0].message.content == "".join(x.text for x in keep)
        assert not generator.model_provider.is_batchable  # served one at a time
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        thread.join(timeout=60)


WRITERS = {
    "llada": write_llada,
    "dream": write_dream,
    "sdar": write_sdar,
    "llada2": write_llada2,
    "nemotron": write_nemotron,
    "diffusion_gemma": write_diffusion_gemma,
}


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_every_family_through_stock_mlx_lm(family, tmp_path, installed):
    """Stock mlx_lm.load / stream_generate with a prompt cache, for each family: the same
    tokens as the library, the cache = prompt + yielded at every yield, and a second
    turn equal to decoding the whole conversation."""
    model, tok = mlx_lm.load(str(WRITERS[family](tmp_path / family)))
    opts = dict(max_tokens=8, steps=4, seed=0)  # seeded: DiffusionGemma starts from noise
    cache = cache_module.make_prompt_cache(model)
    reference = [r.token for r in mld.stream_generate(model, tok, PROMPT, **opts)]
    yielded = []
    for r in mlx_lm.stream_generate(model, tok, PROMPT, prompt_cache=cache, **opts):
        yielded.append(r.token)
        assert cache[0].tokens == PROMPT + yielded
    assert yielded == reference
    turn = [10, 65, 66]
    after = [r.token for r in mlx_lm.stream_generate(model, tok, turn, prompt_cache=cache, **opts)]
    assert after == [r.token for r in mld.stream_generate(model, tok, PROMPT + yielded + turn, **opts)]


def test_batch_generate_keeps_autoregressive_models_on_mlx_lm(tmp_path):
    """After install(), mlx_lm.batch_generate still runs an autoregressive model itself."""
    from mlx_lm_diffusion.testing.causal_checkpoints import write_causal

    model, tok = mlx_lm.load(str(write_causal(tmp_path / "llama", "llama")))
    prompts = [[72, 101, 108], [5, 17, 99, 200, 31]]
    before = mlx_lm.batch_generate(model, tok, prompts, max_tokens=4, return_token_ids=True)
    mld.install()
    try:
        after = mlx_lm.batch_generate(model, tok, prompts, max_tokens=4, return_token_ids=True)
    finally:
        mld.uninstall()
    assert type(after) is type(before) and after.token_ids == before.token_ids


def test_stock_load_keeps_the_checkpoint_decoding_defaults(installed):
    """generation_config.json's defaults (the demo: block 8, 8 steps) hold through
    mlx_lm.load, hence through mlx_lm.generate and the server, as through mld.load."""
    from mlx_lm_diffusion.decoding import generation_defaults
    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    ours, tok = mld.load(str(DEMO_MODEL_PATH))
    stock, stock_tok = mlx_lm.load(str(DEMO_MODEL_PATH))
    attr = generation_defaults.GENERATION_DEFAULTS_ATTR
    assert dict(getattr(stock, attr)) == dict(getattr(ours, attr)) and dict(getattr(ours, attr))
    expected = list(mld.stream_generate(ours, tok, "357+468="))
    got = list(mlx_lm.stream_generate(stock, stock_tok, "357+468="))
    assert [r.token for r in got] == [r.token for r in expected]
    assert got[-1].forwards == expected[-1].forwards < 32  # (32: LLaDA's own block length and steps)


def test_the_server_decodes_with_the_checkpoint_defaults():
    import http.client

    from server_runs import running_server

    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    model, tok = mld.load(str(DEMO_MODEL_PATH))
    forwards = list(mld.stream_generate(model, tok, "357+468="))[-1].forwards
    with running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=120)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "357+468=", "stream": True, "drafts": True}),
            {"Content-Type": "application/json"},
        )
        lines = conn.getresponse().read().decode().splitlines()
    assert sum(line.startswith(": draft ") for line in lines) == forwards < 32
