"""`ignore_eos` (issue 52.2): a request that decodes past EOS says so in its options
(ResolvedOptions.eos_ids: none), not by clearing the adapter's EOS ids, which every row of
a running batch shares. The step-schedule protocol, which fills its target length, is its
user; Python callers may set it too (vLLM's name)."""

import mlx.core as mx
from protocol_requests import greedy_linear

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api import protocol
from mlx_lm_diffusion.decoding import DecodeOptions, Engine, RunningBatch, resolve
from mlx_lm_diffusion.demo import load_demo
from model_adapters import adapter_for

PROMPT = "357+468="


def test_a_decode_with_ignore_eos_runs_to_max_tokens():
    model, tokenizer = load_demo()
    stopped = list(mld.stream_generate(model, tokenizer, PROMPT, max_tokens=8))
    assert stopped[-1].finish_reason == "stop" and len(stopped) < 8
    full = list(mld.stream_generate(model, tokenizer, PROMPT, max_tokens=8, ignore_eos=True))
    assert len(full) == 8 and full[-1].finish_reason == "length"
    assert [r.token for r in full[: len(stopped) - 1]] == [r.token for r in stopped[:-1]]
    # what clearing the adapter's EOS ids gave (the protocol's way before): the same canvas
    ids = tokenizer.encode(PROMPT)
    cleared = adapter_for(model, tokenizer)
    cleared.eos_ids = frozenset()
    last = list(Engine(cleared, resolve(DecodeOptions(max_tokens=8), cleared, len(ids))).run(mx.array([ids])))[-1]
    assert last.canvas[0, len(ids) :].tolist() == [r.token for r in full]


def test_rows_that_stop_at_eos_and_rows_that_do_not_share_a_batch():
    model, tokenizer = load_demo()
    adapter = adapter_for(model, tokenizer)
    ids = tokenizer.encode(PROMPT)
    batch = RunningBatch(adapter)
    rows = {
        batch.add(ids, resolve(DecodeOptions(max_tokens=8, ignore_eos=flag), adapter, len(ids))).id: flag
        for flag in (False, True)
    }
    final = {}
    for _ in range(100):  # (bounded: both decodes are)
        for event in batch.step():
            if event.finished:
                final[rows[event.row.id]] = int(event.row.last.final[0])
        if not len(batch):
            break
    assert final[True] == 8 and final[False] < 8


def test_the_protocol_leaves_the_adapters_eos_ids_alone():
    model, tokenizer = load_demo()
    prompt = tokenizer.encode(PROMPT)
    request = greedy_linear(prompt)
    decode = protocol.prepare_request(model, tokenizer, request)
    assert decode.adapter.eos_ids and decode.options.eos_ids == frozenset()
    response = protocol.run_request(model, tokenizer, request)
    assert len(response["final_tokens"]) == len(prompt) + 8
