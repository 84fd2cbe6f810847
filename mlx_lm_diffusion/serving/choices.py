"""Several choices in one answer: `n`, and a completion's list of prompts (OpenAI's order:
prompt by prompt, n choices each). Each choice is answered, as a one-choice request, by a
copy of the request's handler that writes into a ChoiceSink instead of the socket; the
copies run at once, so the scheduler decodes the choices as rows of one batch. Their
answers are merged here: one body with every choice (usage counts each prompt once and
every choice's tokens), or one stream whose chunks carry their choice's index, an error
event when any choice fails, one usage chunk and one [DONE]."""

from __future__ import annotations

import copy
import dataclasses
import json
import queue
import threading
from typing import Any, List, Optional

from mlx_lm_diffusion.serving.errors import _CLIENT_ERRORS, ClientGone
from mlx_lm_diffusion.serving.openai_requests import SEED_MAX

POLL_SECONDS = 0.1  # how often the merging thread looks at the handler's cancel event


class ChoiceSink:
    """One choice's output, as its handler writes it: the HTTP head (the status is read
    from its first line), then the body; a stream's events are handed on one by one."""

    def __init__(self, index: int, events: "queue.Queue", stream: bool):
        self.index, self.events, self.stream = index, events, stream
        self.head, self.body = b"", b""
        self.status: Optional[int] = None

    def write(self, data) -> int:
        data = bytes(data)
        size = len(data)
        if self.status is None:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return size
            head, _, data = self.head.partition(b"\r\n\r\n")
            self.status = int(head.split(b" ", 2)[1])
            self.events.put((self.index, "status", self.status))
        self.body += data
        if self.stream and self.status == 200:
            while b"\n\n" in self.body:
                event, _, self.body = self.body.partition(b"\n\n")
                self.events.put((self.index, "event", event))
        return size

    def flush(self) -> None:
        pass


@dataclasses.dataclass
class _Choice:
    index: int
    request: Any
    sink: ChoiceSink
    handler: Any = None
    done: bool = False


def _choice_handler(handler, parsed, choice: _Choice):
    """A copy of the handler that answers one choice into its sink: its own seed (the
    request's plus the choice's index, so sampled choices differ and repeat with a seed)
    and its own header buffer; the socket, cancel event and other fields are the request's."""
    twin = copy.copy(handler)
    twin.wfile = choice.sink
    twin._headers_buffer = []
    twin._adopt(dataclasses.replace(parsed, seed=(parsed.seed + choice.index) % (SEED_MAX + 1)))
    twin._request = choice.request
    return twin


def _cancel(choices: List[_Choice], error: BaseException) -> None:
    for choice in choices:
        if not choice.request.cancel.is_set():
            choice.request.cancel_error = error
            choice.request.cancel.set()


def answer_choices(handler, parsed, requests: list) -> None:
    """Answer `requests` (one per prompt of the RequestBody `parsed`) with its n choices each."""
    n, stop_words = parsed.n, list(parsed.stop)
    events: "queue.Queue" = queue.Queue()
    choices = []
    for p, request in enumerate(requests):
        for j in range(n):
            index = p * n + j
            mine = request if j == 0 else dataclasses.replace(request, cancel=threading.Event(), ctx=None)
            choices.append(_Choice(index, mine, ChoiceSink(index, events, parsed.stream)))

    def run(choice: _Choice) -> None:
        try:
            choice.handler.handle_completion(choice.request, stop_words)
        finally:
            events.put((choice.index, "done", None))

    for choice in choices:
        choice.handler = _choice_handler(handler, parsed, choice)
    for choice in choices:
        threading.Thread(target=run, args=(choice,), daemon=True, name=f"choice-{choice.index}").start()
    merge = _merge_stream if parsed.stream else _merge_body
    try:
        merge(handler, choices, events, n)
    except _CLIENT_ERRORS:
        handler.close_connection = True
        _cancel(choices, ClientGone("the client closed its connection"))
    finally:
        _cancel(choices, ClientGone("the response has ended"))


def _next_event(handler, choices: List[_Choice], events: "queue.Queue"):
    """The next event of any choice; the handler's cancellation (shutdown) reaches every choice."""
    while True:
        try:
            return events.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if handler.cancel.is_set():
                _cancel(choices, handler.cancel_error or ClientGone("cancelled"))


def _wait_all(handler, choices: List[_Choice], events: "queue.Queue", on_event=None) -> None:
    while not all(c.done for c in choices):
        index, kind, value = _next_event(handler, choices, events)
        if kind == "done":
            choices[index].done = True
        elif kind == "event" and on_event is not None:
            on_event(index, value)


def _first_failure(choices: List[_Choice]) -> Optional[_Choice]:
    return next((c for c in choices if c.sink.status != 200), None)


def _usage(answers: List[dict], n: int) -> Optional[dict]:
    """Each prompt's tokens once (its first choice's count), every choice's completion."""
    usages = [a.get("usage") for a in answers]
    if any(u is None for u in usages):
        return None
    prompt = sum(u["prompt_tokens"] for u in usages[::n])
    completion = sum(u["completion_tokens"] for u in usages)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usages[::n]]
    if all(c is not None for c in cached):
        usage["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return usage


def _merge_body(handler, choices: List[_Choice], events: "queue.Queue", n: int) -> None:
    _wait_all(handler, choices, events)
    failed = _first_failure(choices)
    if failed is not None:  # (its error body, as a one-choice request gets it)
        return handler._send_bytes(failed.sink.status or 500, failed.sink.body)
    answers = [json.loads(c.sink.body) for c in choices]
    merged = {**answers[0], "choices": [{**a["choices"][0], "index": c.index} for c, a in zip(choices, answers)]}
    usage = _usage(answers, n)
    if usage is not None:
        merged["usage"] = usage
    handler._send_bytes(200, json.dumps(merged).encode())


def _merge_stream(handler, choices: List[_Choice], events: "queue.Queue", n: int) -> None:
    """Headers once every choice has its own (so a choice refused before decoding is the
    answer's 4xx), then each choice's chunks as they come, re-indexed."""
    held = []
    while not all(c.sink.status is not None or c.done for c in choices):
        index, kind, value = _next_event(handler, choices, events)
        if kind == "done":
            choices[index].done = True
        elif kind == "event":
            held.append((index, value))
    failed = _first_failure(choices)
    if failed is not None:
        _cancel(choices, ClientGone("another choice of the request failed"))
        _wait_all(handler, choices, events)
        return handler._send_bytes(failed.sink.status or 500, failed.sink.body)
    handler._set_stream_headers(200)
    handler.end_headers()
    usages: List[Optional[dict]] = [None] * len(choices)
    failure = []

    def forward(index: int, event: bytes) -> None:
        if failure or not event.startswith(b"data: "):
            if event.startswith(b":") and not failure:  # (keepalives)
                handler.wfile.write(event + b"\n\n")
            return
        payload = event[len(b"data: ") :]
        if payload == b"[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:  # one choice failed: the answer ends with its error
            failure.append(chunk)
            _cancel(choices, ClientGone("another choice of the request failed"))
            handler.wfile.write(event + b"\n\n")
        elif not chunk.get("choices") and "usage" in chunk:
            usages[index] = chunk
        else:
            for c in chunk["choices"]:
                c["index"] = index
            handler.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        handler.wfile.flush()

    for index, event in held:
        forward(index, event)
    _wait_all(handler, choices, events, forward)
    if not failure and all(u is not None for u in usages):
        chunk = usages[0]
        chunk["usage"] = _usage(usages, n)
        handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
    handler.wfile.write(b"data: [DONE]\n\n")
    handler.wfile.flush()
