"""Continuous batching in the server (issue 15, part 3), with the openai client: many
concurrent requests are all answered, each exactly as when sent alone; a client that
leaves frees its row; incompatible groups both progress; --no-batch serves one at a time."""

import concurrent.futures
import json
import socket
import threading
import time

import numpy as np
import openai
import pytest
from server_runs import running_server

from mlx_lm_diffusion.testing.checkpoints import EOS_ID, EOT_ID

TIMEOUT = 120  # seconds any client call may take
CONCURRENCY = 8  # --decode-concurrency of the test server: 16 clients queue for 8 rows


@pytest.fixture(scope="module")
def served(llada_path, tmp_path_factory):
    import huggingface_hub.constants as hf_constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf") / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        argv = ["--model", str(llada_path), "--port", "0", "--decode-concurrency", str(CONCURRENCY)]
        with running_server(argv) as served:
            yield served


@pytest.fixture(scope="module")
def client(served):
    port = served[0].server_address[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def request(i):
    """The i-th of 16 requests: prompt lengths, max_tokens, decoding fields and streaming all vary."""
    fields = [{"block_length": 4}, {"block_length": 8, "threshold": 0.5}, {"steps": 2, "block_length": 4}, {}][i % 4]
    return dict(
        messages=[{"role": "user", "content": "Tell me " + "more " * (i % 5) + f"about {i}."}],
        max_tokens=4 + i % 9,
        temperature=0.0,
        stream=i % 2 == 1,
        extra_body=fields,
    )


def ask(client, kw):
    """(text, finish_reason) of one chat request, streamed or not."""
    kw = dict(kw)
    if kw["stream"]:
        text, finish = "", None
        for chunk in client.chat.completions.create(model="default_model", **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish
    out = client.chat.completions.create(model="default_model", **kw)
    return out.choices[0].message.content, out.choices[0].finish_reason


def concurrently(fn, args, workers=16):
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, a) for a in args]
        return [f.result(timeout=TIMEOUT) for f in futures]


class RowWatch:
    """The most rows the scheduler ran at once, sampled while a test runs."""

    def __init__(self, scheduler):
        self.scheduler, self.most, self._stop = scheduler, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.wait(0.005):
            self.most = max(self.most, self.scheduler.stats()["running_rows"])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def wait_for(condition, within=60.0):
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sixteen_concurrent_clients_match_their_requests_alone(served, client, llada):
    import mlx_lm_diffusion as mld

    requests = [request(i) for i in range(16)]
    alone = [ask(client, kw) for kw in requests]
    scheduler = served[1].scheduler
    with RowWatch(scheduler) as watch:
        together = concurrently(lambda kw: ask(client, kw), requests)
    assert together == alone
    assert 1 < watch.most <= CONCURRENCY  # rows decoded together, never more than the bound
    model, tok = llada  # and alone on the server is the library's decode
    ids = tok.apply_chat_template(requests[0]["messages"], add_generation_prompt=True)
    responses = list(
        mld.stream_generate(model, tok, ids, max_tokens=requests[0]["max_tokens"], **requests[0]["extra_body"])
    )
    keep = responses[:-1] if responses[-1].finish_reason == "stop" else responses
    assert alone[0][0] == "".join(r.text for r in keep)
    wait_for(lambda: scheduler.stats()["running_rows"] == 0)


def test_fast_dllm_cache_rows_match_their_requests_alone(served, client):
    """Requests with Fast-dLLM's caches (dual and prefix: two groups by `cache`) decode in
    batches whose rows share forwards, each exactly as when sent alone. (A batched forward
    rounds differently from a single row's, by ~5e-6 in the logits, in every family's
    batched path: a rule's comparison at a near-tie can then go the other way. With the fast
    preset's threshold 0.9 in this list, one row of one run differed; the rows here, as in
    the test above, showed none in 14 runs.)"""
    fields = [
        {"cache": "dual", "block_length": 4},
        {"cache": "prefix", "block_length": 4},
        {"cache": "prefix", "block_length": 8, "threshold": 0.5},
        {"cache": "dual", "block_length": 8, "steps": 4},
    ]
    requests = [dict(request(i), extra_body=fields[i % 4]) for i in range(12)]
    alone = [ask(client, kw) for kw in requests]
    scheduler = served[1].scheduler
    with RowWatch(scheduler) as watch:
        together = concurrently(lambda kw: ask(client, kw), requests)
    assert together == alone
    assert watch.most > 1
    wait_for(lambda: scheduler.stats()["running_rows"] == 0)


def long_stream(port, extra=None):
    """A streaming request that cannot stop by itself, on a raw socket; returns it once its
    first token arrived."""
    body = {
        "messages": [{"role": "user", "content": "Go on."}],
        "stream": True,
        "max_tokens": 400,
        "logit_bias": {str(EOS_ID): -1e9, str(EOT_ID): -1e9},
        "block_length": 4,
        **(extra or {}),
    }
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = b""
    while b"data: " not in received:  # bounded by the socket timeout
        chunk = sock.recv(4096)
        assert chunk, "server closed the stream before the first token"
        received += chunk
    return sock


def test_disconnected_client_frees_its_row(served, client):
    scheduler, port = served[1].scheduler, served[0].server_address[1]
    sock = long_stream(port)
    assert scheduler.stats()["running_rows"] == 1
    short = ask(client, request(0))  # joins the running batch and finishes first
    assert short[1] in ("stop", "length") and scheduler.stats()["running_rows"] == 1
    sock.close()
    wait_for(lambda: scheduler.stats()["running_rows"] == 0)  # freed at the next step
    assert ask(client, request(1))[1] in ("stop", "length")


def test_incompatible_groups_both_progress(served, client):
    """A request whose family options differ (Fast-dLLM's dual cache) decodes in its own
    batch, taking turns with the running one: it finishes while the other still runs,
    and the other keeps streaming."""
    scheduler, port = served[1].scheduler, served[0].server_address[1]
    sock = long_stream(port)
    other = dict(request(2), extra_body={"cache": "dual", "block_length": 4})
    text, finish = ask(client, other)
    assert finish in ("stop", "length") and scheduler.stats()["running_rows"] == 1
    before = scheduler.batches and next(iter(scheduler.batches.values())).rows
    row = next(iter(before.values()))
    emitted = row.last.final[0]
    wait_for(lambda: row.last.final[0] > emitted)  # the first group still progresses
    sock.close()
    wait_for(lambda: scheduler.stats()["running_rows"] == 0)


def test_no_batch_serves_one_at_a_time(llada_path, client):
    port_kw = [request(i) for i in (0, 3, 5)]
    batched = [ask(client, kw) for kw in port_kw]
    with running_server(["--model", str(llada_path), "--port", "0", "--no-batch"]) as (httpd, generator):
        assert generator.scheduler is None
        serial = openai.OpenAI(
            base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
        )
        assert concurrently(lambda kw: ask(serial, kw), port_kw) == batched


def test_error_after_a_batched_stream_began_is_an_sse_event(served, monkeypatch):
    """A request whose decode fails mid-stream ends with an SSE error event and [DONE];
    the scheduler goes on serving."""
    from mlx_lm_diffusion.serving.jobs import Job

    take = Job.take

    def failing(self, step, eos_ids, tokenizer):
        if self.emitted >= 2:
            raise RuntimeError("the decode broke")
        return take(self, step, eos_ids, tokenizer)

    monkeypatch.setattr(Job, "take", failing)
    port = served[0].server_address[1]
    sock = long_stream(port)
    data = b""
    while b"[DONE]" not in data:  # bounded by the socket timeout
        chunk = sock.recv(4096)
        assert chunk, "the stream ended without [DONE]"
        data += chunk
    sock.close()
    events = [line[len("data: ") :] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert "the decode broke" in json.loads(events[-2])["error"]["message"]
    monkeypatch.setattr(Job, "take", take)
    wait_for(lambda: served[1].scheduler.stats()["running_rows"] == 0)


def test_sigterm_finishes_running_rows_within_grace_cancels_the_rest(slow_llada_path, tmp_path):
    """Batched shutdown: a short row running when SIGTERM comes is answered in full, a row
    still decoding when the grace period ends gets an SSE error and [DONE]; exit 0."""
    import signal

    from test_hardening import _events, _read_all, _start_server, _stop, request_bytes

    # The long row takes one forward per token over its whole ~1,620-position canvas: minutes
    # (conftest.slow_llada_path). (A long mask schedule would not make it longer: its
    # logit_bias runs as a logits processor, and under processors a step commits at least
    # the next token left to right.) The short row has 8 forwards to run when SIGTERM
    # comes, each as wide as the long row's canvas (the batch pads it to that): seconds,
    # more than the server takes to act on the signal (with a grace of 0 this test fails)
    # and well under the grace, on a loaded CPU too. (Its first event cannot mark its
    # start: a row's events reach its client in as few chunks as the HTTP thread reads,
    # here one for the whole answer.)
    grace = 30.0
    proc, port = _start_server(slow_llada_path, tmp_path, "--shutdown-grace", str(grace))
    try:
        long = long_stream(port, {"max_tokens": 1600})
        short = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        short.sendall(
            request_bytes(
                json.dumps(
                    {
                        "messages": [{"role": "user", "content": "Hi"}],
                        "stream": True,
                        "max_tokens": 8,
                        "block_length": 4,
                    }
                ).encode()
            )
        )
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        events = _events(_read_all(short))
        assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        events = _events(_read_all(long))
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
        assert proc.wait(timeout=grace + 30) == 0
        assert "Traceback" not in (tmp_path / "server.log").read_text()
    finally:
        long.close()
        _stop(proc)


def protocol_request(i):
    """Step-schedule requests of different lengths and schedules; odd ones sample (seeded)."""
    prompt = [72, 101, 108, 108, 111, 33, 44][: 3 + i % 5]
    steps = 2 + i % 3
    return {
        "prompt_tokens": prompt,
        "target_length": len(prompt) + 6 + i % 4,
        "num_steps": steps,
        "mask_schedule": ["cosine", "linear"][i % 2],
        "temperature_schedule": [0.7 * (i % 2)] * steps,
        "top_p": 0.9 if i % 2 else 1.0,
        "seed": 40 + i,
    }


def post_protocol(port, body):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/diffusion/generate", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_protocol_requests_join_the_scheduler(served, client, llada):
    """Concurrent step-schedule requests (beside chat requests) are batched rows, and each
    response is the one run_request gives alone (seeded sampling included)."""
    from mlx_lm_diffusion.api.protocol import run_request

    port, scheduler = served[0].server_address[1], served[1].scheduler
    before = scheduler.stats()
    bodies = [protocol_request(i) for i in range(6)]
    with RowWatch(scheduler) as watch:
        results = concurrently(lambda b: post_protocol(port, b), bodies, workers=6)
        chat = ask(client, request(0))
    assert [status for status, _ in results] == [200] * len(bodies)
    for (_, body), sent in zip(results, bodies):
        alone = run_request(*llada, sent)
        # (confidences: up to the float effect of a padded batched forward on the attention's sums)
        assert np.allclose(body.pop("confidence"), alone.pop("confidence"), atol=1e-5)
        assert body == alone, sent
    assert watch.most >= 2 and chat[0]  # batched, and chat went on beside it
    assert scheduler.stats()["running_rows"] == before["running_rows"] == 0


def test_a_group_keeps_its_adapter_and_compiled_forwards_across_its_batches(served, client, monkeypatch):
    """Eight rounds of three concurrent requests, each round's max_tokens another of four
    (its own lane: a new batch each round): the group's batches share one adapter, so its
    batched forward compiles once (one trace per input shape). A fresh adapter per batch
    compiled it again for every batch (8 here); the churn grew the server's resident memory
    by ~26 MB per 1,000 mixed requests, still rising (bench/soak_server.py, issue 55.8)."""
    import mlx.core as mx

    from mlx_lm_diffusion.serving.scheduler import MAX_ADAPTERS

    scheduler = served[1].scheduler
    compiled = []
    real = mx.compile
    monkeypatch.setattr(mx, "compile", lambda f, *a, **k: compiled.append(f) or real(f, *a, **k))
    for i in range(8):
        kw = dict(
            messages=[{"role": "user", "content": "Hi"}], max_tokens=[1, 4, 8, 12][i % 4], temperature=0.0, stream=False
        )
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda _: ask(client, kw), range(3)))
    adapters = list(scheduler.adapters.values())
    assert 1 <= len(adapters) <= MAX_ADAPTERS
    # (the commit functions are compiled per rule and quota, for every adapter alike)
    forwards = [f for f in compiled if "_pure_commit" not in getattr(f, "__qualname__", "")]
    assert len(forwards) <= 1, forwards  # (before: one per batch, 8)


def test_the_schedulers_adapters_are_bounded(llada):
    """At most MAX_ADAPTERS groups keep their adapter (least recently used dropped); a group
    gets the same adapter again."""
    from types import SimpleNamespace

    from mlx_lm_diffusion.serving.scheduler import MAX_ADAPTERS, Scheduler
    from mlx_lm_diffusion.serving.turns import TurnLock

    def job(i):  # (a job of group i whose Decode's adapter the group takes when it has none)
        return SimpleNamespace(group=("g", i), decode=SimpleNamespace(adapter=object()))

    scheduler = Scheduler(*llada, TurnLock())
    try:
        first = scheduler.adapter(job(0))
        for i in range(1, 3 * MAX_ADAPTERS):
            scheduler.adapter(job(i))
            assert len(scheduler.adapters) <= MAX_ADAPTERS
            if i < MAX_ADAPTERS - 1:  # (kept while it is among the most recent)
                assert scheduler.adapter(job(0)) is first
        assert ("g", 0) not in scheduler.adapters
        last = scheduler.adapter(job(3 * MAX_ADAPTERS - 1))
        assert scheduler.adapter(job(3 * MAX_ADAPTERS - 1)) is last
    finally:
        scheduler.stop()


def test_the_scheduler_driven_directly_decodes_each_request_as_alone(llada):
    """No HTTP: Decodes built by build_decode, submitted as Jobs to a Scheduler over the
    model; each row's tokens (the Responses on its queue) are those of its decode alone."""
    import queue

    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.api.decode import build_decode
    from mlx_lm_diffusion.serving.jobs import direct_job
    from mlx_lm_diffusion.serving.scheduler import Scheduler
    from mlx_lm_diffusion.serving.stream_batching import runs
    from mlx_lm_diffusion.serving.turns import TurnLock

    model, tokenizer = llada
    cases = [
        ([5, 17, 99], {"max_tokens": 12, "block_length": 4}),
        ([72, 101], {"max_tokens": 8, "block_length": 8}),
        ([33, 34, 35, 36], {"max_tokens": 10, "block_length": 4, "threshold": 0.3}),
    ]
    alone = [[r.token for r in mld.stream_generate(model, tokenizer, p, **o)] for p, o in cases]
    scheduler = Scheduler(model, tokenizer, TurnLock())
    try:
        queues = [queue.Queue() for _ in cases]
        for (prompt, options), q in zip(cases, queues):
            max_tokens = options.pop("max_tokens")
            scheduler.submit(direct_job(build_decode(model, tokenizer, prompt, max_tokens, **options), q))

        def tokens(q):
            items = iter(lambda: q.get(timeout=TIMEOUT), None)
            return [r.token for run in runs(items) for r in run]

        assert [tokens(q) for q in queues] == alone
    finally:
        scheduler.stop()


def test_rows_of_different_cache_modes_share_one_batch(llada, monkeypatch):
    """Issue 52.2, measured at the scheduler: requests that differ only in the family's own
    options (LLaDA's cache modes) join one running batch, where they took a batch (and a
    lane) each while the adapter held those options; each still decodes as alone."""
    import queue

    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.api.decode import build_decode
    from mlx_lm_diffusion.decoding.batch import RunningBatch
    from mlx_lm_diffusion.serving import scheduler as scheduler_module
    from mlx_lm_diffusion.serving.jobs import direct_job
    from mlx_lm_diffusion.serving.stream_batching import runs
    from mlx_lm_diffusion.serving.turns import TurnLock

    batches = []

    class Counted(RunningBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            batches.append(self)

    monkeypatch.setattr(scheduler_module, "RunningBatch", Counted)
    model, tokenizer = llada
    cases = [([5, 17, 99], {}), ([72, 101], {"cache": "prefix"}), ([33, 34, 35, 36], {"cache": "dual"})]
    options = {"block_length": 4}
    alone = [[r.token for r in mld.stream_generate(model, tokenizer, p, 8, **options, **o)] for p, o in cases]
    lock = TurnLock()
    scheduler = scheduler_module.Scheduler(model, tokenizer, lock)
    try:
        queues = [queue.Queue() for _ in cases]
        lock.acquire()  # (every job queued before the first admission: they may all join at once)
        for (prompt, extra), q in zip(cases, queues):
            scheduler.submit(direct_job(build_decode(model, tokenizer, prompt, 8, **options, **extra), q))
        lock.release()

        def tokens(q):
            items = iter(lambda: q.get(timeout=TIMEOUT), None)
            return [r.token for run in runs(items) for r in run]

        assert [tokens(q) for q in queues] == alone
        assert len(batches) == 1 and scheduler.peak_rows == 3  # (before: 3 batches of one row)
    finally:
        scheduler.stop()
