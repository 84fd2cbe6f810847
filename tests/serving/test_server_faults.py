"""Faults and fairness of the server (issue 33): request-scoped resources are released and
nothing a client sends is checked while the decoder's lock is held."""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import time

import pytest
from server_runs import post_json, running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

PROTOCOL = {
    "prompt_tokens": [3, 4, 5],
    "target_length": 8,
    "num_steps": 4,
    "mask_schedule": "linear",
    "temperature_schedule": [0.0] * 4,
    "top_p": 1.0,
}


def protocol(port: int, body, timeout: float = 120):
    return post_json(port, "/v1/diffusion/generate", body, timeout)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module", params=["batched", "serial"])
def server(request):
    flags = [] if request.param == "batched" else ["--no-batch"]
    with running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", *flags]) as s:
        yield s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts native threads in /proc")
def test_protocol_requests_keep_no_thread(server):
    """Each connection's handler thread used to run the decode: MLX kept a stream and a
    native thread for each (400 requests: 415 threads; from the 693rd, every one a 500)."""
    httpd, _ = server
    port = httpd.server_address[1]
    first = [protocol(port, PROTOCOL) for _ in range(3)]  # (the worker's own threads start)
    before = native_threads()
    answers = [protocol(port, PROTOCOL) for _ in range(40)]
    assert all(status == 200 for status, _ in first + answers)
    assert answers[0][1]["final_tokens"] == answers[-1][1]["final_tokens"]
    assert native_threads() <= before + 2, (before, native_threads())


def test_a_bad_protocol_body_is_refused_without_the_decoders_lock(server):
    """The schema check runs before the decode lock: a body that ends in a 400 does not wait
    for (nor hold up) generation. Here the lock stays held until the answer came."""
    httpd, generator = server
    port = httpd.server_address[1]
    bad = {**PROTOCOL, "num_steps": "four"}
    answered = []
    with generator.decode_lock:
        client = threading.Thread(target=lambda: answered.append(protocol(port, bad, timeout=60)))
        client.start()
        client.join(timeout=60)
        held_throughout = client.is_alive() is False
    client.join(timeout=60)
    assert held_throughout and answered, "the 400 waited for the decode lock"
    status, body = answered[0]
    assert status == 400 and "num_steps" in body["error"]["message"]


def chat(port: int, body: dict, timeout: float = 120):
    return post_json(port, "/v1/chat/completions", body, timeout)


def test_stop_strings_are_bounded(server):
    """Each stop string is compiled into a matcher before decoding (400,000 of them held the
    server for 44-105 s and 1.2 GB): a count or a length past the limit is a 400."""
    from mlx_lm_diffusion.serving.openai_requests import MAX_STOP_CHARS, MAX_STOP_STRINGS

    port = server[0].server_address[1]
    base = {"messages": [{"role": "user", "content": "357+468="}], "max_tokens": 6}
    many = [f"#{i}" for i in range(MAX_STOP_STRINGS + 1)]
    for stop, words in ((many, "at most 16"), ("x" * (MAX_STOP_CHARS + 1), "at most 256")):
        status, body = chat(port, {**base, "stop": stop})
        assert status == 400 and words in body["error"]["message"] and body["error"]["param"] == "stop", body
    at_limit = [f"#{i}" + "x" * (MAX_STOP_CHARS - 4) for i in range(MAX_STOP_STRINGS)]
    status, body = chat(port, {**base, "stop": at_limit})
    assert status == 200 and body["choices"][0]["message"]["content"], body


def test_a_temperature_past_the_bound_is_a_400(server):
    """temperature_schedule 1e308 overflowed the scaled logits: the protocol answered all
    zeros with null confidences. Temperatures are bounded as the chat route's are."""
    port = server[0].server_address[1]
    status, body = protocol(port, {**PROTOCOL, "temperature_schedule": [1e308] * 4})
    assert status == 400 and "temperature_schedule" in body["error"]["message"], body
    status, body = protocol(port, {**PROTOCOL, "temperature_schedule": [100.0] * 4})
    assert status == 200 and None not in body["confidence"], body


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_a_fifo_in_the_allowed_image_directory_is_refused_not_read(tmp_path):
    from mlx_lm_diffusion.media import images

    os.mkfifo(tmp_path / "pipe.png")
    policy = images.ImagePolicy(allow_paths=False, allowed_dir=tmp_path)
    outcome = []

    def read():
        try:
            images.open_image(str(tmp_path / "pipe.png"), policy)
        except images.ImageError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # (release the blocked read: open the FIFO's writing end)
        with open(tmp_path / "pipe.png", "wb"):
            pass
    assert outcome and "not a regular file" in outcome[0], "the read blocked on the FIFO"


def test_long_requests_leave_rows_for_short_ones(llada_path):
    """Requests at the forward bound took every row of the batch (a normal request behind
    32 of them waited 429 s); long ones now hold at most half of a batch, and a short one
    behind them is admitted at once."""
    argv = [
        "--model",
        str(llada_path),
        "--port",
        "0",
        "--log-level",
        "WARNING",
        "--decode-concurrency",
        "4",
        "--long-request-forwards",
        "16",
    ]
    long_body = {**PROTOCOL, "target_length": 3 + 48, "num_steps": 48, "temperature_schedule": [0.0] * 48}
    with running_server(argv) as (httpd, generator):
        port = httpd.server_address[1]
        answers = []
        longs = [threading.Thread(target=lambda: answers.append(protocol(port, long_body))) for _ in range(8)]
        for thread in longs:
            thread.start()
        for _ in range(600):  # (until the long ones have been admitted: two rows of four)
            if generator.scheduler.stats()["running_rows"] >= 2:
                break
            threading.Event().wait(0.05)
        assert generator.scheduler.stats()["running_rows"] == 2
        status, _ = protocol(port, PROTOCOL)  # short: 4 forwards
        unfinished = sum(thread.is_alive() for thread in longs)
        for thread in longs:
            thread.join(timeout=300)
    assert status == 200 and unfinished >= 5, unfinished
    assert len(answers) == 8 and all(s == 200 for s, _ in answers)


def test_a_long_request_is_not_stuck_behind_much_longer_ones(llada_path):
    """32 requests of 16,384 forwards held every long row: a 300-forward request behind them
    waited 503.6 s. Each 4x heavier class of long requests now holds at most half the rows of
    the class below it: beside the heaviest (one row of two here), a request just over the
    long threshold is admitted at once and answers while they still decode."""
    argv = [
        "--model",
        str(llada_path),
        "--port",
        "0",
        "--log-level",
        "WARNING",
        "--decode-concurrency",
        "4",
        "--long-request-forwards",
        "16",
    ]
    steps = 80  # (5x the threshold: the class above the first)
    heavy = {**PROTOCOL, "target_length": 3 + steps, "num_steps": steps, "temperature_schedule": [0.0] * steps}
    medium = {**PROTOCOL, "target_length": 3 + 24, "num_steps": 24, "temperature_schedule": [0.0] * 24}
    with running_server(argv) as (httpd, generator):
        port, scheduler = httpd.server_address[1], generator.scheduler
        answers = []
        heavies = [
            threading.Thread(target=lambda: answers.append(protocol(port, heavy, timeout=600))) for _ in range(4)
        ]
        for thread in heavies:
            thread.start()
        for _ in range(600):  # (until they are queued and one decodes)
            stats = scheduler.stats()
            if stats["running_rows"] >= 1 and stats["queued_requests"] >= 3:
                break
            time.sleep(0.05)
        assert scheduler.stats()["running_rows"] == 1  # (the heaviest class: one row of the two long ones)
        status, _ = protocol(port, medium)  # 24 forwards: long, but of the first class
        waiting = scheduler.stats()["queued_requests"]
        for thread in heavies:
            thread.join(timeout=600)
    assert status == 200 and waiting >= 2, waiting
    assert len(answers) == 4 and all(s == 200 for s, _ in answers)


def test_a_short_request_does_not_step_with_the_long_ones(llada_path):
    """A short request beside requests at the forward bound shared every one of their steps
    (an 8-token answer behind 16 of them waited 55 s). Rows now decode in lanes by the size
    of their forward bound, and lanes share the time: while the short request decodes, the
    long lane takes a step or two, not one per short forward."""
    from mlx_lm_diffusion.serving.scheduler import lane_of

    argv = ["--model", str(llada_path), "--port", "0", "--log-level", "WARNING", "--decode-concurrency", "8"]
    steps = 48  # (each over a canvas of 500 positions: a step costs many of the short request's)
    long_body = {**PROTOCOL, "target_length": 3 + 500, "num_steps": steps, "temperature_schedule": [0.0] * steps}
    with running_server(argv) as (httpd, generator):
        port, scheduler = httpd.server_address[1], generator.scheduler
        answers = []
        longs = [threading.Thread(target=lambda: answers.append(protocol(port, long_body))) for _ in range(4)]
        for thread in longs:
            thread.start()
        for _ in range(600):  # (until the long ones decode)
            if scheduler.stats()["running_rows"] >= 4 and long_forwards(scheduler, steps) >= 2:
                break
            time.sleep(0.05)
        before = long_forwards(scheduler, steps)
        status, answer = protocol(port, PROTOCOL)  # short: 4 forwards
        during = long_forwards(scheduler, steps) - before
        lanes = {lane_of(row.payload) for batch in scheduler.batches.values() for row in batch.rows.values()}
        for thread in longs:
            thread.join(timeout=300)
    assert status == 200, answer
    assert during <= 3, f"the long lane took {during} steps while the short request took 4"
    assert len(lanes) == 1  # (only the long rows were left)
    assert len(answers) == 4 and all(s == 200 for s, _ in answers)


def long_forwards(scheduler, steps: int) -> int:
    """Forwards run by the batches whose rows are the long requests (`steps` forwards each)."""
    return sum(
        batch.forwards
        for batch in list(scheduler.batches.values())
        if any(row.payload.forwards >= steps for row in list(batch.rows.values()))
    )


def test_kernels_compile_in_a_private_directory_and_health_says_when_they_cannot(tmp_path):
    """MLX compiles its CPU kernels under $TMPDIR/mlx/<version>/ and loads what it finds
    there: under a shared TMPDIR a planted library was loaded into the server. The server
    now compiles into the user's own 0700 cache (kept across starts, so a later start finds
    its kernels compiled), never the shared TMPDIR; /health is a 503 when kernels cannot be
    written there (every generation failed while /health said ok)."""
    import shutil
    import stat

    from server_runs import console_server

    shared, cache = tmp_path / "shared", tmp_path / "cache"
    shared.mkdir()
    env = {**os.environ, "TMPDIR": str(shared), "XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1"}
    kernels = cache / "mlx_lm_diffusion" / "kernels"
    command = [sys.executable, "-m", "mlx_lm_diffusion.server", "--model", str(DEMO_MODEL_PATH)]
    with console_server(command, env, tmp_path / "log") as port:
        status, body = protocol(port, PROTOCOL)
        assert status == 200, body
        assert stat.S_IMODE(kernels.stat().st_mode) == 0o700
        assert list(shared.iterdir()) == [] and (kernels / "mlx").is_dir()  # (the kernels went there)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        shutil.rmtree(kernels)  # (kernels can no longer be written)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 503 and body["status"] == "unavailable" and str(cache) not in body["reason"]
    assert list(shared.iterdir()) == []


def _readable(sock) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def _refused(socks) -> int:
    """How many of `socks` have been answered (the 503 of a refused connection)."""
    return sum(1 for s in socks if _readable(s))


def test_one_client_cannot_take_every_connection(tmp_path):
    """One client holding --max-connections idle sockets made everyone's requests 503; with
    --max-client-connections it holds at most that many, and another address is served."""
    import socket

    argv = [
        "--model",
        str(DEMO_MODEL_PATH),
        "--port",
        "0",
        "--log-level",
        "WARNING",
        "--max-connections",
        "12",
        "--max-client-connections",
        "4",
    ]
    with running_server(argv) as (httpd, _):
        port = httpd.server_address[1]
        idle = []
        try:
            for _ in range(8):  # from 127.0.0.1
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=60))
            for _ in range(400):  # (until the server has taken all eight: four kept, four refused)
                if httpd.open_connections() == 4 and _refused(idle) == 4:
                    break
                threading.Event().wait(0.05)
            assert httpd.open_connections() == 4 and _refused(idle) == 4
            other = socket.socket()
            other.bind(("127.0.0.2", 0))  # another client address on the loopback
            other.settimeout(60)
            other.connect(("127.0.0.1", port))
            body = json.dumps(PROTOCOL).encode()
            other.sendall(
                b"POST /v1/diffusion/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            reply = b""
            while b"\r\n\r\n" not in reply:
                reply += other.recv(65536)
            assert reply.startswith(b"HTTP/1.0 200") or reply.startswith(b"HTTP/1.1 200"), reply[:200]
            other.close()
            refused = socket.create_connection(("127.0.0.1", port), timeout=60)
            assert b"--max-client-connections 4" in refused.recv(65536)
            refused.close()
        finally:
            for s in idle:
                s.close()


def test_a_lone_decode_takes_turns_with_the_batch(slow_llada_path):
    """A request decoded outside the batch (here an infill's suffix) held the model for its
    whole decode: everyone batched waited (33.9 s). It now hands the model on between its
    forwards, so a short batched request finishes while the long one is still decoding."""
    argv = ["--model", str(slow_llada_path), "--port", "0", "--log-level", "WARNING"]
    long_body = {"prompt": "Hello", "suffix": " world", "max_tokens": 256, "block_length": 32, "steps": 32}
    with running_server(argv) as (httpd, generator):
        port = httpd.server_address[1]
        long_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        long_conn.request("POST", "/v1/completions", json.dumps(long_body), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 60
        while not generator.decode_lock.locked() and time.monotonic() < deadline:  # (the lone decode began)
            time.sleep(0.05)
        started = time.monotonic()
        status, body = post_json(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 8})
        waited = time.monotonic() - started
        long_conn.sock.settimeout(0.0)
        try:
            long_done = long_conn.sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            long_done = False
        long_conn.close()  # (its decode is cancelled at the next forward)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    assert not long_done, f"the short request waited for the whole lone decode ({waited:.1f} s)"


def test_client_chat_templates_render_under_limits():
    """With --allow-client-chat-templates a template is code the server runs: one could
    take all memory ({{ 'x' * 10**10 }}) or loop for hours. Each renders in a child process
    with a memory cap and time limits; past them the request is a 400 and the server goes on."""
    argv = ["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", "--allow-client-chat-templates"]
    user = [{"role": "user", "content": "357+468="}]

    def with_template(port, template):
        return chat(port, {"messages": user, "chat_template_kwargs": {"chat_template": template}})

    with running_server(argv) as (httpd, _):
        port = httpd.server_address[1]
        status, body = with_template(port, "{{ messages[-1]['content'] }}")
        assert status == 200 and body["choices"][0]["message"]["content"] == "825", body
        started = time.monotonic()
        for template, reason in (
            ("{{ 'x' * 10**10 }}", "needed more than"),
            ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "CPU time"),
            ("{{ raise_exception('not this one') }}", "not this one"),
        ):
            status, body = with_template(port, template)
            assert status == 400 and reason in body["error"]["message"], body
            assert body["error"]["param"] == "chat_template_kwargs"
        assert time.monotonic() - started < 60
        assert chat(port, {"messages": user})[1]["choices"][0]["message"]["content"] == "825"


def test_a_client_template_renders_on_its_own_requests_thread():
    """A client template rendered inside the generation thread's tokenize step: a template
    that loops until its CPU limit (5 s) held every other request that long. It renders
    on its request's own thread now: a normal request sent meanwhile is answered first."""
    argv = ["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", "--allow-client-chat-templates"]
    user = [{"role": "user", "content": "357+468="}]
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    finished = []
    with running_server(argv) as (httpd, _):
        port = httpd.server_address[1]
        assert chat(port, {"messages": user})[0] == 200  # (warm)

        def looping():
            status, body = chat(port, {"messages": user, "chat_template_kwargs": {"chat_template": loop}})
            finished.append(("template", status))

        thread = threading.Thread(target=looping)
        thread.start()
        time.sleep(1.0)  # (its render is under way)
        status, body = chat(port, {"messages": user})
        finished.append(("normal", status))
        thread.join(timeout=120)
    assert finished == [("normal", 200), ("template", 400)], finished


def health(port: int):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


@pytest.mark.parametrize("mode", ["batched", "serial"])
def test_health_says_not_ready_after_running_out_of_memory(mode, monkeypatch):
    """/health said ok while every generation failed for want of memory; now it is a 503
    from a generation that ran out of memory until one completes again, and the request that
    ran out a 503 (the server's state, not the request: retry later), not a 500."""
    import mlx_lm.server

    from mlx_lm_diffusion.serving import scheduler

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[metal::malloc] Unable to allocate 34359738368 bytes")

    flags = [] if mode == "batched" else ["--no-batch"]
    with running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "CRITICAL", *flags]) as s:
        port = s[0].server_address[1]
        assert health(port)[0] == 200
        with monkeypatch.context() as m:
            m.setattr(scheduler.Scheduler, "_step", out_of_memory)
            m.setattr(mlx_lm.server, "stream_generate", out_of_memory)  # (the serial path's decode)
            status, body = chat(port, {"messages": [{"role": "user", "content": "1+2="}]})
            assert status == 503 and body["error"]["code"] == "out_of_memory", body
        status, body = health(port)
        assert status == 503 and "out of memory" in body["reason"], body
        assert chat(port, {"messages": [{"role": "user", "content": "1+2="}]})[0] == 200
        assert health(port)[0] == 200


def _half_closed_exchange(port: int, body: dict) -> bytes:
    """Send `body` to /v1/completions, shut down the sending side (a half-close), and read
    everything the server answers until it closes."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("mode", ["batched", "serial"])
def test_a_client_that_half_closes_gets_its_whole_answer(llada_path, mode):
    """A client that sends its request and shuts down its sending side still reads: it got
    no bytes (or a stream without [DONE]) while the log said 200, because the end of its
    stream was taken for its leaving."""
    flags = [] if mode == "batched" else ["--no-batch"]
    body = {"prompt": "Hello", "max_tokens": 64, "block_length": 64, "steps": 64, "temperature": 0}
    with running_server(["--model", str(llada_path), "--port", "0", "--log-level", "WARNING", *flags]) as s:
        port = s[0].server_address[1]
        expected = post_json(port, "/v1/completions", body)[1]["choices"][0]["text"]
        answer = _half_closed_exchange(port, body)
        while answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):  # (interim answers a client skips)
            answer = answer[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"200", answer[:300]
        assert json.loads(payload)["choices"][0]["text"] == expected
        streamed = _half_closed_exchange(port, {**body, "stream": True})
        assert streamed.split(b" ")[1] == b"200" and streamed.rstrip().endswith(b"data: [DONE]")
        text = "".join(
            json.loads(line[len(b"data: ") :])["choices"][0]["text"]
            for line in streamed.split(b"\n")
            if line.startswith(b"data: {") and json.loads(line[len(b"data: ") :])["choices"]
        )
        assert text == expected


def test_client_template_renderers_are_bounded(monkeypatch):
    """Issue 55.8: twelve clients with templates started twelve renderer processes; at most
    MAX_RENDERERS run at once, a client past them waits, and one that waits past the render
    limit is told to try again (the server answers it 503)."""
    import threading
    import time

    from mlx_lm_diffusion.serving import template_sandbox

    running, most, lock = [0], [0], threading.Lock()

    def slow_render(request):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return "text"

    monkeypatch.setattr(template_sandbox, "_render", slow_render)
    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.5)
    outcomes = []

    def client():
        try:
            outcomes.append(template_sandbox.render("t", [], None, {}, {}))
        except template_sandbox.RenderersBusy:
            outcomes.append("busy")

    threads = [threading.Thread(target=client) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most[0] == template_sandbox.MAX_RENDERERS
    assert outcomes.count("text") >= 2 and "busy" in outcomes and len(outcomes) == 12


def test_a_prompt_that_cannot_fit_is_refused_from_its_length(monkeypatch):
    """Issue 55.1: a 9.9 MB prompt (under the body limit) was tokenized in full before the
    context check, on the path every request waits on; it is a 400 from its length alone,
    the tokenizer never asked, and the next request is answered."""
    from server_runs import post_json, running_server

    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
    from mlx_lm_diffusion.serving.generator import DiffusionResponseGenerator

    tokenized = []
    real = DiffusionResponseGenerator._tokenize
    monkeypatch.setattr(
        DiffusionResponseGenerator, "_tokenize", lambda self, *a, **k: tokenized.append(1) or real(self, *a, **k)
    )
    with running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        port = httpd.server_address[1]
        for body in (
            {"messages": [{"role": "user", "content": "1" * 9_900_000}]},
            {"prompt": ["1+2=" * 400]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "9" * 5000}]}]},
        ):
            status, answer = post_json(port, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
            assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert tokenized == []
        status, answer = post_json(port, "/v1/completions", {"prompt": "357+468=", "max_tokens": 8})
        assert status == 200 and answer["choices"][0]["text"] == "825" and tokenized == [1]


def test_the_per_client_cap_is_on_by_default():
    """Issue 55.3: 520 idle sockets from one address locked everyone out because the
    per-client cap was off; by default one address holds at most 64 connections and another
    address is still answered (0 turns the cap off, for a server behind a reverse proxy)."""
    import socket

    from mlx_lm_diffusion.serving import startup
    from mlx_lm_diffusion.serving.http_server import DEFAULT_MAX_CLIENT_CONNECTIONS

    assert startup.parse_args(["--port", "0"]).max_client_connections == DEFAULT_MAX_CLIENT_CONNECTIONS == 64
    argv = ["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING"]
    with running_server(argv) as (httpd, _):
        port = httpd.server_address[1]
        idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(70)]
        try:
            for _ in range(400):
                if httpd.open_connections() == 64 and _refused(idle) == 6:
                    break
                threading.Event().wait(0.05)
            assert httpd.open_connections() == 64 and _refused(idle) == 6
            other = socket.socket()
            other.bind(("127.0.0.2", 0))
            other.settimeout(60)
            other.connect(("127.0.0.1", port))
            other.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert other.recv(65536).startswith(b"HTTP/1.0 200")
            other.close()
        finally:
            for s in idle:
                s.close()
    with running_server([*argv, "--max-client-connections", "0"]) as (httpd, _):
        assert httpd.max_client_connections is None
