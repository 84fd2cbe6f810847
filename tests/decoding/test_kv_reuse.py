"""Prompt KV reused across requests (model_adapters.runtime.prefix_kv, mlx_lm_diffusion.decoding.kv_reuse).

For each family whose prompt KV is exact (SDAR and LLaDA2: block-causal; Nemotron-Labs
Diffusion: causal prefix; DiffusionGemma: causal encoder; the ar adapter), a decode that
starts from an earlier decode's exported KV gives the tokens and forward count of a cold
decode of the same prompt, while running fewer tokens through the model: exactly the
reused ones. Also when the cached prefix is trimmed (a prompt diverging in the middle of
it, or shorter than it). LLaDA and Dream reuse nothing, with or without Fast-dLLM's cache.
Through the server: a second chat turn and a shared system prompt report cached tokens
and give the cold request's tokens; LLaDA reports 0.
"""

from __future__ import annotations

import copy
import http.client
import json

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import LRUPromptCache
from server_runs import TIMEOUT, running_server

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.kv_reuse import PromptReuse
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma, write_nemotron
from model_adapters import adapter_for
from model_adapters.runtime.prefix_kv import CAUSAL, PrefixKV, block_causal
from model_adapters.runtime.prompt_cache import TokenCache

EXACT = ["sdar", "llada2", "nemotron", "gemma", "ar"]
# per family: decoding options (seeded: DiffusionGemma samples) and the first prompt's length
OPTIONS = {
    "sdar": dict(max_tokens=12),
    "llada2": dict(max_tokens=40),
    "nemotron": dict(max_tokens=16, block_length=8),
    "gemma": dict(max_tokens=16, seed=3),
    "ar": dict(max_tokens=8),
}
FIRST_LEN = {"sdar": 10, "llada2": 45, "nemotron": 13, "gemma": 13, "ar": 9}


@pytest.fixture(scope="module")
def sdar_path(tmp_path_factory):
    return write_sdar(tmp_path_factory.mktemp("kv_reuse_sdar"))


@pytest.fixture(scope="module")
def families(tmp_path_factory, sdar_path):
    root = tmp_path_factory.mktemp("kv_reuse")
    import mlx_lm

    return {
        "sdar": mld.load(str(sdar_path)),
        "llada2": mld.load(str(write_llada2(root / "llada2"))),
        "nemotron": mld.load(str(write_nemotron(root / "nemotron"))),
        "gemma": mld.load(str(write_diffusion_gemma(root / "gemma"))),
        "ar": mlx_lm.load(str(write_causal(root / "llama", "llama"))),
    }


class Counting:
    """The model, counting the token positions run through it (backbone, encoder,
    decoder, or an mlx-lm model's own call)."""

    def __init__(self, model):
        self.model, self.positions = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def backbone(self, inputs, mask=None, cache=None):
        self.positions += inputs.size
        return self.model.backbone(inputs, mask, cache)

    def encode(self, inputs, cache):
        self.positions += inputs.size
        return self.model.encode(inputs, cache)

    def decode(self, canvas, cache, self_conditioning=None):
        self.positions += canvas.size
        return self.model.decode(canvas, cache, self_conditioning)

    def __call__(self, inputs, cache=None, **kwargs):
        self.positions += inputs.size
        return self.model(inputs, cache=cache, **kwargs)


def decode(pair, ids, prefix=None, **options):
    """(generated tokens, forwards, positions run, PromptReuse) of one decode of `ids`
    starting from `prefix`, as generation.stream_generate runs it; EOS does not stop it."""
    model, tok = pair
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()  # decode every block: the export then covers generated ones
    adapter.model = counting = Counting(model)
    engine = Engine(adapter, resolve(DecodeOptions(**options), adapter, len(ids)))
    reuse = PromptReuse(prefix)
    prompt = mx.array([ids])
    steps = list(engine.run(prompt, reuse=reuse.plan(adapter, engine, prompt)))
    last = steps[-1]
    tokens = [int(t) for t in last.canvas[0, len(ids) : len(ids) + last.final[0]]]
    return tokens, last.forwards, counting.positions, reuse


def first_turn(families, family):
    """The first prompt, its generated tokens, and the KV the decode leaves for them."""
    pair = families[family]
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 250, FIRST_LEN[family])]
    tokens, _, _, reuse = decode(pair, ids, **OPTIONS[family])
    history = ids + tokens
    return history, reuse.export(history)


def check_exact(pair, ids, prefix, options):
    """A reused decode equals the cold one; returns how many positions it reused."""
    cold_tokens, cold_forwards, cold_work, cold = decode(pair, ids, **options)
    tokens, forwards, work, warm = decode(pair, ids, prefix, **options)
    assert cold.reused == 0
    assert tokens == cold_tokens
    assert forwards == cold_forwards
    assert cold_work - work == warm.reused  # the reused positions are not run again
    return warm.reused


@pytest.mark.parametrize("family", EXACT)
def test_follow_up_turn_prefills_only_its_new_tokens(families, family):
    history, prefix = first_turn(families, family)
    assert prefix is not None and 0 < prefix.length <= len(history)
    block = prefix.block
    if family in ("sdar", "llada2"):  # the prompt's full blocks and the finished generated ones
        assert prefix.kind == block_causal(block) and prefix.length % block == 0
        assert prefix.length >= FIRST_LEN[family] // block * block
    else:
        assert prefix.kind == CAUSAL
    follow_up = history + [int(t) for t in np.random.default_rng(8).integers(0, 250, 7)]
    reused = check_exact(families[family], follow_up, prefix, OPTIONS[family])
    assert reused == prefix.length  # everything cached lies before the new tokens


@pytest.mark.parametrize("family", EXACT)
def test_batched_row_starts_from_the_cached_prefix(families, family):
    """A running batch's row with a cached prefix (next to a cold row) gives the cold
    decode's tokens and forwards, reports the positions it reused, and leaves its KV."""
    from mlx_lm_diffusion.decoding.batch import RunningBatch

    history, prefix = first_turn(families, family)
    follow_up = history + [int(t) for t in np.random.default_rng(8).integers(0, 250, 7)]
    other = [int(t) for t in np.random.default_rng(9).integers(0, 250, 11)]
    expected = [decode(families[family], ids, **OPTIONS[family])[:2] for ids in (follow_up, other)]
    model, tok = families[family]
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()  # (as `decode`)
    batch = RunningBatch(adapter)
    rows = [
        batch.add(ids, resolve(DecodeOptions(**OPTIONS[family]), adapter, len(ids)), prefix=p)
        for ids, p in ((follow_up, prefix), (other, None))
    ]
    assert [row.prompt_kv.reused for row in rows] == [prefix.length, 0]
    results = {}
    for _ in range(1000):  # (bounded: each row's decode is)
        for event in batch.step():
            assert event.error is None, event.error
            if event.finished:
                P, last = event.row.prompt_len, event.row.last
                results[event.row.id] = ([int(t) for t in last.canvas[0, P : P + last.final[0]]], last.forwards)
        if not len(batch):
            break
    assert [results[row.id] for row in rows] == expected
    left = rows[0].prompt_kv.export(follow_up + results[rows[0].id][0])
    assert left is not None and left.length >= prefix.length


@pytest.mark.parametrize("family", EXACT)
def test_trimmed_prefix_is_exact(families, family):
    """The LRU trims a cache to the prefix a new prompt shares: a divergence in the middle
    of a block (block-causal: the partial block is not reused), or a prompt shorter than
    the cached tokens."""
    history, prefix = first_turn(families, family)
    pair, options = families[family], OPTIONS[family]
    block = prefix.block
    shared = prefix.length - block // 2 - 1  # inside the last cached block (off its boundary)
    cache = TokenCache(history)
    cache.hold_kv(lambda tokens: prefix.trimmed(len(tokens)))
    cache.trim(len(history) - shared)  # what LRUPromptCache.fetch_nearest_cache does
    assert cache.tokens == history[:shared]
    trimmed = cache.kv
    assert trimmed.length == shared // block * block
    diverged = history[:shared] + [(history[shared] + 1) % 250] + history[shared + 1 :]
    assert check_exact(pair, diverged, trimmed, options) == (shared // block * block if block > 1 else shared)
    shorter = history[: shared - 2]  # a prompt that is a prefix of the cached tokens
    reused = check_exact(pair, shorter, prefix, options)
    assert reused == ((shared - 2) // block * block if block > 1 else shared - 3)


def test_export_stops_where_the_canvas_differs_from_the_cached_tokens(families):
    """The KV left for a prompt cache covers only positions where the canvas holds the
    cache's tokens (a token revised after it was yielded would otherwise carry stale KV)."""
    pair = families["sdar"]
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 250, FIRST_LEN["sdar"])]
    tokens, _, _, reuse = decode(pair, ids, **OPTIONS["sdar"])
    history = ids + tokens
    assert reuse.export(history).length >= 8
    changed = history[:6] + [(history[6] + 1) % 250] + history[7:]
    assert reuse.export(changed).length == 4  # the block holding position 6 is not kept
    assert reuse.export([(history[0] + 1) % 250] + history[1:]) is None


def test_the_cached_prefix_is_never_written(families):
    """Reusing one PrefixKV twice gives the same decode, and its arrays keep their values."""
    history, prefix = first_turn(families, "sdar")
    before = [np.array(k) for k in prefix.keys]
    follow_up = history + [5, 6, 7]
    first = decode(families["sdar"], follow_up, prefix, **OPTIONS["sdar"])[:3]
    second = decode(families["sdar"], follow_up, prefix, **OPTIONS["sdar"])[:3]
    assert first == second
    assert all((np.array(k) == b).all() for k, b in zip(prefix.keys, before))


def test_a_prefix_of_another_layout_is_not_reused(families):
    """An SDAR prefix with another block size, a causal prefix for a block-causal model, and
    Nemotron without causal context (its prefix is encoded bidirectionally) reuse nothing."""
    history, prefix = first_turn(families, "sdar")
    other = PrefixKV(prefix.keys, prefix.values, block_causal(8), 8)
    causal = PrefixKV(prefix.keys, prefix.values, CAUSAL, 1)
    for wrong in (other, causal):
        assert decode(families["sdar"], history + [1], wrong, **OPTIONS["sdar"])[3].reused == 0
    n_history, n_prefix = first_turn(families, "nemotron")
    options = dict(OPTIONS["nemotron"], causal_context=False)
    tokens, forwards, _, reuse = decode(families["nemotron"], n_history + [1], n_prefix, **options)
    assert reuse.reused == 0 and reuse.export(n_history) is None
    assert (tokens, forwards) == decode(families["nemotron"], n_history + [1], **options)[:2]


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
@pytest.mark.parametrize("name", ["llada", "dream"])
def test_bidirectional_families_reuse_nothing(request, name, cache):
    """LLaDA and Dream (with or without Fast-dLLM's cache): their KV depends on the canvas,
    so they export nothing and take nothing, even a prefix offered in their own shapes."""
    pair = request.getfixturevalue(name)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 250, 12)]
    options = dict(max_tokens=8, block_length=8, steps=8, cache=cache)
    fake = PrefixKV((mx.zeros((1, 2, 8, 16)),), (mx.zeros((1, 2, 8, 16)),), CAUSAL)
    tokens, forwards, _, reuse = decode(pair, ids, fake, **options)
    assert reuse.reused == 0 and reuse.export(ids + tokens) is None
    assert (tokens, forwards) == decode(pair, ids, **options)[:2]


def test_token_cache_keeps_kv_within_its_tokens(families):
    """TokenCache: KV read from the decode once, trimmed with the tokens, counted in
    nbytes, shared (never copied) by deepcopy, dropped when its state is set."""
    history, prefix = first_turn(families, "sdar")
    calls = []
    cache = TokenCache(history)
    cache.hold_kv(lambda tokens: calls.append(len(tokens)) or prefix.trimmed(len(tokens)))
    assert cache.nbytes == 4 * len(history) + prefix.trimmed(len(history)).nbytes
    assert calls == [len(history)] and cache.kv is cache.kv and len(calls) == 1
    clone = copy.deepcopy(cache)
    assert clone.tokens == cache.tokens and clone.kv is cache.kv
    cache.trim(len(history) - 5)
    assert cache.kv.length == 4 and clone.kv.length == prefix.length
    cache.trim(5)
    assert cache.kv is None and cache.nbytes == 0
    clone.state = mx.array([1, 2, 3])
    assert clone.kv is None


def test_stream_generate_reuses_the_prompt_cache(families):
    """mlx-lm's calling convention (compat.stream_generate with a prompt cache, as the chat
    REPL and the server call it): the second call prefills only past the cached KV."""
    from mlx_lm_diffusion.api import compat

    model, tok = families["sdar"]
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 250, 14)]
    cache = compat.make_prompt_cache(model)
    reports = []
    first = [
        r.token
        for r in compat.stream_generate(
            model, tok, ids, max_tokens=8, prompt_cache=cache, cached_tokens_callback=reports.append
        )
    ]
    assert reports == [0] and cache[0].tokens == ids + first
    more = [11, 12, 13]
    second = [
        r.token
        for r in compat.stream_generate(
            model, tok, more, max_tokens=8, prompt_cache=cache, cached_tokens_callback=reports.append
        )
    ]
    cold = [r.token for r in mld.stream_generate(model, tok, ids + first + more, max_tokens=8)]
    assert second == cold
    assert reports[1] > 0 and reports[1] % 4 == 0 and reports[1] >= len(ids) // 4 * 4


def test_lru_prompt_cache_bounds_the_kv_bytes(families):
    """mlx-lm's LRUPromptCache counts a TokenCache's KV in its bytes and evicts past
    max_bytes; a fetch trims the KV with the tokens (to whole blocks)."""
    history, prefix = first_turn(families, "sdar")
    entry = TokenCache(history)
    entry.hold_kv(lambda tokens: prefix.trimmed(len(tokens)))
    lru = LRUPromptCache(max_size=10, max_bytes=entry.nbytes + 100)
    lru.insert_cache("m", list(history), [entry])
    assert lru.nbytes == entry.nbytes > prefix.nbytes
    cache, rest = lru.fetch_nearest_cache("m", history[:9] + [1, 2, 3])
    assert rest == [1, 2, 3] and cache[0].kv.length == 8  # a cache trimmed to 9 tokens: 2 blocks of 4
    other = TokenCache(history[::-1])
    other.hold_kv(lambda tokens: prefix.trimmed(len(tokens)))
    lru.insert_cache("m", history[::-1], [other])  # over the bound: the older entry goes
    assert len(lru) == 1 and lru.fetch_nearest_cache("m", history)[0] is None


def test_cache_occupancy_counts_entries_bytes_and_tokens(families):
    """kv_reuse.cache_occupancy reads mlx-lm's LRUPromptCache (its LRU order and trie: this
    pins the names it relies on)."""
    from mlx_lm_diffusion.decoding.kv_reuse import cache_occupancy

    history, prefix = first_turn(families, "sdar")
    lru = LRUPromptCache()
    assert cache_occupancy(lru) == {"entries": 0, "bytes": 0, "tokens": 0, "kv_tokens": 0}
    with_kv = TokenCache(history)
    with_kv.hold_kv(lambda tokens: prefix.trimmed(len(tokens)))
    lru.insert_cache("m", list(history), [with_kv])
    lru.insert_cache("m", [1, 2, 3], [TokenCache([1, 2, 3])])
    assert cache_occupancy(lru) == {
        "entries": 2,
        "bytes": with_kv.nbytes + 12,
        "tokens": len(history) + 3,
        "kv_tokens": prefix.length,
    }


# ----------------------------------------------------------------------------- server

MAX_TOKENS = 12
SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one line."}


@pytest.fixture(scope="module", params=["sdar", "llada", "sdar batched", "llada batched"])
def served(request, sdar_path, llada_path):
    """(family, port, response generator) of an in-process server: serving one request at
    a time (--no-batch: the serial path) or batched rows (the scheduler, the default)."""
    family, *batched = request.param.split()
    path = {"sdar": sdar_path, "llada": llada_path}[family]
    argv = ["--model", str(path), "--port", "0", "--max-tokens", str(MAX_TOKENS), "--prompt-cache-bytes", "64MB"]
    with running_server(argv + ([] if batched else ["--no-batch"])) as (httpd, generator):
        assert (generator.scheduler is not None) == bool(batched)
        yield family, httpd.server_address[1], generator


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1]}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def pair(served, request):
    """(model, tokenizer) of the served family, loaded in this process for cold decodes."""
    if served[0] == "llada":
        return request.getfixturevalue("llada")
    return request.getfixturevalue("families")["sdar"]


def cold_text(pair, ids, max_tokens=MAX_TOKENS):
    """What mlx_lm.server sends for a fresh decode of `ids` (it drops the EOS step's text)."""
    responses = list(mld.stream_generate(pair[0], pair[1], ids, max_tokens=max_tokens))
    keep = responses[:-1] if responses[-1].finish_reason == "stop" else responses
    return "".join(r.text for r in keep)


def stats(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("GET", "/v1/stats")
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def exact_kv(family):
    return family == "sdar"


def test_second_chat_turn_reuses_the_first(served, client, pair):
    family = served[0]
    turn = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="default_model", messages=turn)
    first_ids = pair[1].apply_chat_template(turn, add_generation_prompt=True)
    messages = turn + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another?"},
    ]
    ids = pair[1].apply_chat_template(messages, add_generation_prompt=True)
    second = client.chat.completions.create(model="default_model", messages=messages)
    assert second.choices[0].message.content == cold_text(pair, ids)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens == len(ids)
    if exact_kv(family):  # at least the first prompt's whole blocks (SDAR: blocks of 4)
        assert len(first_ids) // 4 * 4 <= cached < len(ids) and cached % 4 == 0
    else:  # LLaDA's KV depends on the canvas: nothing is reused
        assert cached == 0
    # streamed, with usage: the same text and count (the cache now holds this turn too)
    chunks = list(
        client.chat.completions.create(
            model="default_model", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == second.choices[0].message.content
    again = chunks[-1].usage.prompt_tokens_details.cached_tokens
    # mlx-lm's LRU leaves one prompt token to read; the KV is kept in whole blocks of 4
    assert again == ((len(ids) - 1) // 4 * 4 if exact_kv(family) else 0)


def test_shared_system_prompt_is_reused(served, client, pair):
    family = served[0]
    system = {"role": "system", "content": "Shared instructions: " + "be brief and exact. " * 6}
    client.chat.completions.create(model="default_model", messages=[system, {"role": "user", "content": "One"}])
    messages = [system, {"role": "user", "content": "Two"}]
    r = client.chat.completions.create(model="default_model", messages=messages)
    ids = pair[1].apply_chat_template(messages, add_generation_prompt=True)
    assert r.choices[0].message.content == cold_text(pair, ids)
    head = len(pair[1].apply_chat_template([system], add_generation_prompt=False))
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= head // 4 * 4 if exact_kv(family) else cached == 0


def test_text_completion_reuses_its_prefix(served, client, pair):
    family = served[0]
    prompt = "A long shared opening line of text, "
    client.completions.create(model="default_model", prompt=prompt + "then one.", max_tokens=6)
    r = client.completions.create(model="default_model", prompt=prompt + "then two.", max_tokens=6)
    assert r.choices[0].text == cold_text(pair, pair[1].encode(prompt + "then two."), max_tokens=6)
    streamed = list(
        client.completions.create(
            model="default_model",
            prompt=prompt + "then two.",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    for cached in (r.usage.prompt_tokens_details.cached_tokens, streamed[-1].usage.prompt_tokens_details.cached_tokens):
        assert cached >= len(pair[1].encode(prompt)) // 4 * 4 if exact_kv(family) else cached == 0


def test_stats_report_the_prompt_cache(served, client):
    family, port, generator = served
    client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Stats?"}])
    with generator.decode_lock:  # the generation thread stores the cache after the response ends
        pass
    status, body = stats(port)
    assert status == 200 and body["object"] == "stats"
    assert body["running"] == 0 and body["queued"] == 0  # nothing in flight between requests
    cache = body["prompt_cache"]
    assert cache["entries"] == len(generator.prompt_cache) >= 1
    assert cache["bytes"] == generator.prompt_cache.nbytes > 0
    assert cache["tokens"] > 0
    assert (cache["kv_tokens"] > 0) if exact_kv(family) else cache["kv_tokens"] == 0
    assert generator.prompt_cache.max_bytes == 64 * 1000 * 1000  # --prompt-cache-bytes 64MB
