"""Contract tests: every mlx-lm name the server, chat, compat and install rely on.

When mlx-lm changes one of these, a test here names what broke before the server
tests fail in less obvious ways. Private names (leading underscore) and source-level
behaviours are pinned exactly; public ones by their signatures.
"""

import dataclasses
import importlib
import inspect
from http.server import ThreadingHTTPServer

import mlx_lm
import mlx_lm.chat
import mlx_lm.cli_ui
import mlx_lm.sample_utils
import mlx_lm.server as server
import mlx_lm.tokenizer_utils
import mlx_lm.utils
import pytest

generate_module = importlib.import_module("mlx_lm.generate")  # `import mlx_lm.generate` gives the function
cache_module = importlib.import_module("mlx_lm.models.cache")


def params(fn):
    return list(inspect.signature(fn).parameters)


def source(fn):
    return inspect.getsource(fn)


def test_mlx_lm_version_is_the_one_pinned():
    assert mlx_lm.__version__.startswith("0.32.")


# ----------------------------------------------------------------- module globals install() rebinds


@pytest.mark.parametrize(
    "module,name",
    [
        ("mlx_lm", "stream_generate"),
        ("mlx_lm.generate", "stream_generate"),
        ("mlx_lm.server", "stream_generate"),
        ("mlx_lm.chat", "stream_generate"),
    ],
)
def test_install_targets_exist(module, name):
    assert callable(getattr(importlib.import_module(module), name))


def test_callers_look_the_targets_up_at_call_time():
    # mlx_lm.generate() calls its module's stream_generate
    assert "stream_generate(model, tokenizer, prompt, **kwargs)" in source(generate_module.generate)
    serve = source(server.ResponseGenerator._serve_single)
    assert "make_prompt_cache(self.model_provider.model)" in serve
    assert "for gen in stream_generate(" in serve
    assert "make_prompt_cache(model)" in source(server.ModelProvider._load)
    chat_main = source(mlx_lm.chat.main)
    assert "make_prompt_cache(model, args.max_kv_size)" in chat_main
    assert "stream_generate(" in chat_main


# ----------------------------------------------------------------- generation signatures


def test_stream_generate_signature():
    assert params(generate_module.stream_generate)[:6] == [
        "model",
        "tokenizer",
        "prompt",
        "max_tokens",
        "draft_model",
        "stream",
    ]
    assert params(generate_module.generate)[:4] == ["model", "tokenizer", "prompt", "verbose"]
    fields = [f.name for f in dataclasses.fields(generate_module.GenerationResponse)]
    assert fields == [
        "text",
        "token",
        "logprobs",
        "from_draft",
        "prompt_tokens",
        "prompt_tps",
        "generation_tokens",
        "generation_tps",
        "peak_memory",
        "finish_reason",
    ]


def test_load_and_samplers():
    assert {"adapter_path", "tokenizer_config", "trust_remote_code"} <= set(params(mlx_lm.utils.load))
    assert mlx_lm.load is mlx_lm.utils.load
    assert {"temp", "top_p", "xtc_probability", "xtc_threshold", "xtc_special_tokens"} <= set(
        params(mlx_lm.sample_utils.make_sampler)
    )
    wrapper = mlx_lm.tokenizer_utils.TokenizerWrapper
    for name in ("detokenizer", "eos_token_ids"):
        assert isinstance(inspect.getattr_static(wrapper, name), property), name


# ----------------------------------------------------------------- caches


def test_base_cache_interface():
    base = cache_module._BaseCache  # private: TokenCache subclasses it
    for name in ("state", "nbytes"):
        assert isinstance(inspect.getattr_static(base, name), property)
    for name in ("is_trimmable", "size", "empty", "from_state"):
        assert callable(getattr(base, name))
    assert params(cache_module.make_prompt_cache) == ["model", "max_kv_size"]
    # diffusion models get their TokenCache through model.make_cache(), unpatched
    make = source(cache_module.make_prompt_cache)
    assert 'if hasattr(model, "make_cache"):' in make and "return model.make_cache()" in make
    # trimming goes through is_trimmable() and trim(n)
    assert "c.is_trimmable()" in source(cache_module.can_trim_prompt_cache)
    assert "c.trim(num_tokens)" in source(cache_module.trim_prompt_cache)


def test_lru_prompt_cache_interface():
    lru = cache_module.LRUPromptCache
    assert server.LRUPromptCache is lru
    assert params(lru.__init__)[:2] == ["self", "max_size"]
    assert params(lru.fetch_nearest_cache) == ["self", "model", "tokens"]
    assert params(lru.insert_cache)[:4] == ["self", "model", "tokens", "prompt_cache"]
    fetch = source(lru.fetch_nearest_cache)
    assert "copy.deepcopy" in fetch and "trim_prompt_cache(cache, num_to_trim)" in fetch
    assert "c.nbytes" in source(lru.insert_cache)


def test_server_batches_only_caches_with_merge():
    assert 'hasattr(c, "merge")' in source(server.ModelProvider._load)


# ----------------------------------------------------------------- mlx_lm.server machinery


def test_server_classes_and_signatures():
    assert params(server.APIHandler.__init__) == ["self", "response_generator", "args", "system_fingerprint", "kwargs"]
    assert params(server.ResponseGenerator.__init__) == ["self", "model_provider", "prompt_cache"]
    assert params(server.ResponseGenerator.generate) == ["self", "request", "generation_args", "progress_callback"]
    assert params(server.ResponseGenerator._tokenize) == ["self", "tokenizer", "request", "args"]
    assert params(server.ResponseGenerator._serve_single) == ["self", "request", "stream"]
    assert params(server.APIHandler._set_completion_headers) == ["self", "status_code"]
    assert params(server.APIHandler.handle_completion) == ["self", "request", "stop_words"]
    assert isinstance(inspect.getattr_static(server.ResponseGenerator, "cli_args"), property)
    for name in (
        "stop_and_join",
        "validate_model_parameters",
        "handle_chat_completions",
        "handle_text_completions",
        "handle_models_request",
        "do_GET",
        "do_POST",
    ):
        owner = server.ResponseGenerator if name == "stop_and_join" else server.APIHandler
        assert callable(getattr(owner, name)), name
    assert params(server.ModelProvider.__init__) == ["self", "cli_args"]
    assert callable(server.get_system_fingerprint)
    assert issubclass(server.APIHandler, server.BaseHTTPRequestHandler)
    assert server.ThreadingHTTPServer is ThreadingHTTPServer


def test_request_dataclasses():
    assert [f.name for f in dataclasses.fields(server.CompletionRequest)] == [
        "request_type",
        "prompt",
        "messages",
        "tools",
        "role_mapping",
    ]
    names = {f.name for f in dataclasses.fields(server.GenerationArguments)}
    assert {"model", "max_tokens", "seed"} <= names
    assert "model" in {f.name for f in dataclasses.fields(server.ModelDescription)}


def test_serve_single_contract():
    """What the diffusion server builds on in `_serve_single`."""
    src = source(server.ResponseGenerator._serve_single)
    assert "rqueue, request, args = request" in src
    # the prompt is built (and may fail) before the context is handed to the handler
    assert src.index("self._tokenize(") < src.index("rqueue.put(ctx)")
    assert "prompt_cache=cache" in src
    assert "prompt_progress_callback=progress" in src
    assert "rqueue.put((tokens_processed, tokens_total))" in src
    assert "cache_key.append(gen.token)" in src  # the cache is kept as prompt + yielded
    assert "if ctx._should_stop:" in src
    assert "except Exception as e:\n            rqueue.put(e)" in src


def test_generate_routes_tuples_to_progress_and_raises_errors():
    src = source(server.ResponseGenerator.generate)
    assert "isinstance(response, tuple)" in src and "progress_callback(*response)" in src
    assert "isinstance(ctx, Exception)" in src


def test_handler_error_paths():
    completion = source(server.APIHandler.handle_completion)
    assert "self.response_generator.generate(" in completion
    assert "self._set_completion_headers(404)" in completion  # remapped for request errors
    assert "ctx.stop()" in completion
    post = source(server.APIHandler.do_POST)
    assert post.index("self.validate_model_parameters()") < post.index("request_factories[self.path]()")
    assert "except ValueError as e:\n            self._set_completion_headers(400)" in post
    models = source(server.APIHandler.handle_models_request)
    assert "scan_cache_dir()" in models and "self.response_generator.cli_args.model" in models


def test_main_hands_its_arguments_to_run():
    src = source(server.main)
    assert "args = parser.parse_args()" in src
    assert src.rstrip().endswith("run(args.host, args.port, ModelProvider(args))")
    assert params(server.run)[:3] == ["host", "port", "model_provider"]


# ----------------------------------------------------------------- mlx_lm.chat


def test_chat_parser_and_ui():
    args = mlx_lm.chat.setup_arg_parser().parse_args([])
    for name in (
        "model",
        "adapter_path",
        "trust_remote_code",
        "temp",
        "top_p",
        "xtc_probability",
        "xtc_threshold",
        "seed",
        "max_kv_size",
        "max_tokens",
        "system_prompt",
    ):
        assert hasattr(args, name), name
    ui = mlx_lm.cli_ui.ChatUI
    assert params(ui.__init__) == ["self", "args", "rank"]
    for name in ("prompt", "say_bye", "say_reset", "say_help", "stream_token", "end_turn", "__enter__", "__exit__"):
        assert callable(getattr(ui, name)), name
    assert "input(" in source(mlx_lm.cli_ui.corridor_input)  # EOF raises EOFError


# ----------------------------------------------------------------- every private name, once

# (module, dotted name, why the project relies on it). mlx-lm may change any of these
# without notice: this list is the one place that says which ones we depend on.
PRIVATE_NAMES = [
    ("mlx_lm.models.cache", "_BaseCache", "prompt_cache.TokenCache subclasses it, so mlx-lm's cache helpers accept it"),
    ("mlx_lm.utils", "_download", "load() and convert resolve a path or Hub repo as mlx_lm.load does"),
    ("mlx_lm.utils", "_parse_size", "the server parses its size flags as mlx_lm.server does"),
    ("mlx_lm.server", "_image_parts", "the server refuses image content parts before mlx_lm.server reads them"),
    ("mlx_lm.server", "_image_url", "... and the URLs in them (never fetched)"),
    ("mlx_lm.server", "ResponseGenerator._generate", "overridden: the generation thread's loop, with cancellation"),
    (
        "mlx_lm.server",
        "ResponseGenerator._tokenize",
        "overridden: up-front checks of a decode (a 400, not a dropped stream)",
    ),
    ("mlx_lm.server", "ResponseGenerator._serve_single", "overridden: decoding options and drafts around one request"),
    ("mlx_lm.server", "APIHandler._set_completion_headers", "called and remapped: request errors keep their status"),
    ("mlx_lm.server", "APIHandler._set_stream_headers", "overridden: SSE headers with the server's CORS policy"),
    ("mlx_lm.server", "APIHandler._set_cors_headers", "overridden: CORS off unless the operator allows origins"),
]


@pytest.mark.parametrize("module,name,why", PRIVATE_NAMES, ids=[f"{m}:{n}" for m, n, _ in PRIVATE_NAMES])
def test_private_names_we_rely_on_exist(module, name, why):
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    assert target is not None, why


def test_batch_generate_signature_and_response():
    """generate_batch mirrors mlx_lm.batch_generate (install() routes diffusion models to it)."""
    from mlx_lm.generate_utils import BatchStats

    from mlx_lm_diffusion.api.batch_generate import generate_batch

    assert params(generate_module.batch_generate) == params(generate_batch)
    fields = [f.name for f in dataclasses.fields(generate_module.BatchResponse)]
    assert fields == ["texts", "stats", "caches", "token_ids", "logprobs"]
    stats = {f.name for f in dataclasses.fields(BatchStats)}
    assert {
        "prompt_tokens",
        "prompt_time",
        "generation_tokens",
        "generation_steps",
        "decode_time",
        "wall_time",
        "peak_memory",
    } <= stats
    assert mlx_lm.batch_generate is generate_module.batch_generate or hasattr(mlx_lm.batch_generate, "__wrapped__")
