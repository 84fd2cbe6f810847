"""A completion's answer: mlx_lm.server's handle_completion over the diffusion generator,
with stop strings matched on the text, OpenAI's log-probabilities, required tool calls,
usage counts and errors answered as OpenAI's. The fields are the request's RequestBody
(serving/request_body.py), which the routes hand the handler (`request_body`) before a
completion is answered."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

from mlx_lm.server import Response, ResponseGenerator

from mlx_lm_diffusion.serving import memory, stream_batching, tool_choice
from mlx_lm_diffusion.serving.errors import _CLIENT_ERRORS, ClientGone, RequestError, error_body
from mlx_lm_diffusion.serving.handler import HTTPHandler
from mlx_lm_diffusion.serving.openai_requests import DiffusionRequest
from mlx_lm_diffusion.serving.responses import json_safe


class _Answered(BaseException):
    """The error was answered already (passes mlx_lm.server's `except Exception`)."""


class _DecodeFailed(Exception):
    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _Guarded:
    """The response generator as one request's handler sees it: a failure of
    generate() is answered as an error here; a failure while iterating is marked as
    the decode's (not the client connection's)."""

    def __init__(self, real: ResponseGenerator, handler: "CompletionAnswers"):
        self._real = real
        self._handler = handler

    def __getattr__(self, name):
        return getattr(self._real, name)

    def generate(self, request, args, progress_callback=None):
        try:
            ctx, responses = self._real.generate(request, args, progress_callback)
        except Exception as e:
            self._handler._answer_failure(e)
            raise _Answered() from None
        return ctx, self._iterate(responses)

    def _iterate(self, responses):
        """The decode's responses, with the answer's stop strings matched on its text: the
        first that completes one ends the answer there (finish_reason "stop"), and text
        that could still begin one is held back until it cannot. mlx_lm.server matches stops
        as token ids (`tokenizer.encode(stop)`), which a tokenizer that encodes the string
        otherwise in context never meets: it cut the stop out of the text and went on
        decoding ("825" with stop "2" gave "85"). The last response is handed on as
        "length", the one mlx_lm.server keeps the text of; the answer's own finish reason
        is put back in generate_response."""
        handler = self._handler
        stops = handler._stop_texts
        hold = max((len(s) for s in stops), default=1) - 1
        text, sent = "", 0
        pending, produced = [], 0  # (responses whose token's text is not released yet: its text, where it ends)

        def release(limit: float) -> None:  # their log-probabilities go out with the text they made
            while pending and pending[0][2] <= limit:
                handler._generated.append(pending.pop(0)[:2])
                handler._count_answer_token(handler._generated[-1][0].token)

        try:
            for run in stream_batching.runs(responses):  # (the scheduler's tokens come in mailboxes)
                out = []
                for response in run:
                    if not isinstance(response, Response):  # (not a token: passed on as it is)
                        out.append(response)
                        continue
                    text += response.text
                    if response.finish_reason != "stop" or response.text:  # (an EOS adds no text: no entry)
                        # the token's text is what the detokenizer released with it, so the entries'
                        # texts add up to the answer (a character split over byte tokens comes with
                        # its last byte; decoding one token alone gave a replacement character)
                        produced += len(response.text)
                        pending.append((response, response.text, produced))
                    hits = [i for i in (text.find(stop, max(0, sent - hold)) for stop in stops) if i >= 0]
                    if hits or response.finish_reason is not None:
                        # (a generation completed: /health is ready again before the answer's last
                        # bytes reach its client, who may ask it next)
                        self._real.note_outcome(None)
                        end = min(hits) if hits else len(text)
                        handler._finish = "stop" if hits else response.finish_reason
                        release(end if hits else math.inf)  # (at the end: all of them)
                        if pending and pending[0][2] - len(pending[0][1]) < end:
                            # a token the stop begins inside: its entry keeps the text before the
                            # stop, so the entries still add up to the answer
                            first, first_text, first_end = pending[0]
                            pending[0] = (first, first_text[: len(first_text) - (first_end - end)], end)
                            release(end)
                        out.append(dataclasses.replace(response, text=text[sent:end], finish_reason="length"))
                        yield from stream_batching.merge_texts(out)
                        return  # (a decode still running is cancelled by the handler)
                    upto = max(sent, len(text) - hold)
                    release(upto)
                    out.append(dataclasses.replace(response, text=text[sent:upto]))
                    sent = upto
                yield from stream_batching.merge_texts(out)  # (one chunk for the run)
        except _CLIENT_ERRORS:  # writing keepalives or drafts to a gone client
            raise
        except Exception as e:
            raise _DecodeFailed(e) from e


class CompletionAnswers(HTTPHandler):
    """The handler's answering of one completion (DiffusionAPIHandler's base: the routes
    build the requests, these answer them)."""

    def handle_completion(self, request, stop_words):
        self._stream_started = False
        self._generated = []  # the tokens generated, not yet in a response (with their log-probs)
        self._stop_texts = list(stop_words or ())  # (matched on the text: _Guarded._iterate)
        self._finish = None
        self._made_tool_call = False
        self._tool_text = ""  # a required tool call's JSON so far (_answer_as_tool_call)
        self._text_offset = 0  # (legacy log-probs: where the next token starts in the text)
        self._answer_tokens = 0  # usage.completion_tokens: the answer's tokens (_count_answer_token)
        self._role_sent = False  # a stream's role goes in its first delta only, as OpenAI's
        real = self.response_generator
        self.response_generator = _Guarded(real, self)
        try:
            super().handle_completion(request, [])
            real.note_outcome(None)
        except _Answered:
            pass
        except _DecodeFailed as e:
            self._answer_failure(e.error)
        except _CLIENT_ERRORS:
            self.close_connection = True  # the client left; its decode is cancelled below
        except Exception as e:
            logging.exception("completion failed")
            self._answer_failure(e)
        finally:
            self.response_generator = real
            ctx = getattr(request, "ctx", None)
            if ctx is not None:
                ctx.stop()
            if isinstance(request, DiffusionRequest) and not request.cancel.is_set():
                request.cancel_error = ClientGone("the response has ended")
                request.cancel.set()  # a decode still running for it stops at the next forward

    def _answer_failure(self, error: BaseException) -> None:
        """Answer an error: a status and a JSON body before the response began, an SSE
        error event and [DONE] once a stream has."""
        if isinstance(error, ClientGone):
            self.close_connection = True
            return
        message = str(error) or type(error).__name__
        if isinstance(error, RequestError):
            status, param, code = error.status, error.param, error.code
        else:
            status, param, code = 500, None, None
            logging.error(f"request failed: {type(error).__name__}: {error}")
            self.response_generator.note_outcome(error)  # (out of memory: /health says so)
            if memory.is_out_of_memory(error):  # (the server's state, not the request: retry later)
                status, code, message = 503, "out_of_memory", f"out of memory: {message}; retry later"
        try:
            if self._stream_started:
                body = error_body(message, status, param, code)
                self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            else:
                self._headers_buffer = []  # a 200 may be buffered, never sent
                self._send_error(status, message, param=param, code=code)
        except _CLIENT_ERRORS:
            self.close_connection = True

    def generate_response(self, *args, **kwargs) -> dict:
        """mlx_lm.server's response or stream chunk; a chat's log-probabilities as OpenAI
        defines them (mlx_lm.server's entries were the first of an unsorted top-k, often
        not the generated token, and streams carried none): one entry per token the
        response or chunk adds."""
        parsed = self.request_body
        response = self._as_openai(super().generate_response(*args, **kwargs))
        self._made_tool_call = self._made_tool_call or bool(kwargs.get("tool_calls"))
        if response.get("choices"):
            choice = response["choices"][0]
            if choice.get("finish_reason") == "length" and self._finish:  # (handed on as "length": _Guarded._iterate)
                tool_call = self._finish == "stop" and self._made_tool_call  # (as mlx_lm.server reports one)
                choice["finish_reason"] = "tool_calls" if tool_call else self._finish
            if parsed.forced_tool_call:
                self._answer_as_tool_call(choice)
            choice["logprobs"] = None  # (OpenAI's answers carry the field, null when not asked)
            if isinstance(choice.get("message"), dict):
                choice["message"].setdefault("refusal", None)  # (required by OpenAI's schema; never one here)
                if choice["message"].get("content") is None and not choice["message"].get("tool_calls"):
                    choice["message"]["content"] = ""  # (a stop at the first character: empty, not null)
            delta = choice.get("delta")
            if isinstance(delta, dict) and "role" in delta:
                if self._role_sent:
                    del delta["role"]
                self._role_sent = True
            if parsed.route == "chat" and (parsed.logprobs or parsed.top_logprobs > 0):
                choice["logprobs"] = {"content": self._logprob_entries(), "refusal": None}
            elif parsed.route == "text" and parsed.legacy_logprobs is not None:
                choice["logprobs"] = self._legacy_logprobs()
        return json_safe(response)

    def _answer_as_tool_call(self, choice: dict) -> None:
        """A required tool call (serving.tool_choice): the answer's JSON, held back from a
        stream's deltas, comes back as the message's tool_calls once it is whole; an answer
        cut short stays text, with its finish reason."""
        stream = self.request_body.stream
        message = choice.get("delta") if stream else choice.get("message")
        if not isinstance(message, dict):
            return
        self._tool_text += message.pop("content", None) or ""
        if choice.get("finish_reason") is None:
            return
        calls = tool_choice.as_tool_calls(self._tool_text, stream) if choice["finish_reason"] == "stop" else None
        if calls is None:
            message["content"] = self._tool_text
        else:
            message["content"] = None
            message["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
        self._tool_text = ""

    def _legacy_logprobs(self) -> dict:
        """/v1/completions' shape: tokens, token_logprobs, top_logprobs (one dict of the
        alternatives per token; the token alone with logprobs 0) and text_offset (each
        token's start in the completion's text, counted across a stream's chunks)."""
        entries = self._logprob_entries()
        offset = self._text_offset
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        self._text_offset = offset
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} or {e["token"]: e["logprob"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def completion_usage_response(self, *args, **kwargs) -> dict:
        """A stream's usage chunk is a chunk (mlx_lm.server names it "chat.completion")."""
        response = self._as_openai(super().completion_usage_response(*args, **kwargs))
        if response.get("object") == "chat.completion":
            response["object"] = "chat.completion.chunk"
        return json_safe(response)

    def _as_openai(self, response: dict) -> dict:
        """The served model's id where the client named none ("default_model" is this
        server's alias), and usage.completion_tokens the answer's tokens: not its EOS, nor
        tokens without text (a diffusion canvas's padding, the demo's <blank>)."""
        if response.get("model") == "default_model":
            response["model"] = self.response_generator.listed.get("default_model", "default_model")
        usage = response.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["completion_tokens"] = self._answer_tokens
            usage["total_tokens"] = usage["prompt_tokens"] + self._answer_tokens
        return response

    def _count_answer_token(self, token: int) -> None:
        self._answer_tokens += not self.response_generator.textless(token)

    def _logprob_entries(self) -> list:
        """The pending generated tokens as OpenAI's log-probability entries: `token` the
        token's own text, its `logprob` (a diffusion token's log-probability at the step
        that committed it), `bytes` (UTF-8), and `top_logprobs` sorted by log-probability,
        descending; `id` is mlx_lm.server's. The pending tokens are the ones whose text was
        released (`_Guarded._iterate`: an EOS that ends the answer has no entry)."""
        decode = self.response_generator.model_provider.tokenizer.decode
        generated, self._generated = self._generated, []

        def entry(token: int, logprob: float, text: str) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "id": token}

        entries = []
        for gen, text in generated:
            top = (
                sorted(gen.top_tokens or (), key=lambda t: -t["logprob"]) if self.request_body.top_logprobs > 0 else []
            )
            alternatives = [
                entry(gen.token, gen.logprob, text)
                if t["id"] == gen.token
                else entry(t["id"], t["logprob"], decode([t["id"]]))
                for t in top
            ]
            entries.append({**entry(gen.token, gen.logprob, text), "top_logprobs": alternatives})
        return entries

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        self._stream_started = True
