"""The routes: GET (models, stats, health) and POST (completions, chat completions, the
step-schedule protocol), on mlx_lm.server's handler."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, List
from urllib.parse import unquote

from mlx_lm.server import CompletionRequest, Response, ResponseGenerator

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.serving import (
    choices,
    memory,
    pictures,
    request_body,
    stream_batching,
    studio,
    template_sandbox,
    tool_choice,
)
from mlx_lm_diffusion.serving.errors import _CLIENT_ERRORS, ClientGone, RequestError, _param_of, error_body
from mlx_lm_diffusion.serving.openai_requests import DiffusionRequest
from mlx_lm_diffusion.serving.responses import json_safe

# The decoding fields are the options schema's named options, looked up per request (a
# family registered after this import adds its own): compat.DECODE_FIELDS.
PROTOCOL_PATH = "/v1/diffusion/generate"  # the step-schedule protocol (shared/seeds/004)
STATS_PATH = "/v1/stats"  # running decodes, queued requests, prompt cache occupancy
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
GET_PATHS = ("/v1/models", "/health", STATS_PATH)  # (the studio's files too, which no client POSTs to)
NO_BODY = object()  # _read_body's "no body to act on: the error was answered"


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

    def __init__(self, real: ResponseGenerator, handler: "Routes"):
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


class Routes:
    """The routes of DiffusionAPIHandler (a mixin over mlx_lm.server's APIHandler)."""

    def do_GET(self):
        self._request = None
        if not self._gate():
            return
        if self.path == STATS_PATH:
            return self._send_json(200, self.response_generator.stats())
        path = self.path.split("?", 1)[0]
        if path == "/":
            return self._send_static(200, studio.ROOT_PAGE, "text/html; charset=utf-8")
        if path in studio.FILES:
            return self._send_static(200, *studio.static_file(path))
        if path == studio.OPTIONS_PATH:
            provider = self.response_generator.model_provider
            generator = self.response_generator
            demo = str(provider.cli_args.model) == str(DEMO_MODEL_PATH)
            return self._send_json(
                200,
                studio.options_listing(
                    provider.model, provider.tokenizer, generator.defaults, provider.cli_args.max_tokens, demo=demo
                ),
            )
        if path in POST_PATHS or path in (PROTOCOL_PATH, pictures.RENDER_PATH):
            return self._method_not_allowed("POST")
        if not (self.path.startswith("/v1/models") or self.path == "/health"):
            return self._send_error(404, f"no such endpoint: GET {self.path[:200]}")
        if self.path == "/health":
            problem = self.response_generator.health_problem()
            if problem is not None:
                return self._send_json(503, {"status": "unavailable", "reason": problem})
        super().do_GET()

    def _method_not_allowed(self, allowed: str) -> None:
        """405 with Allow (RFC 9110), for a route that answers another method."""
        self._extra_headers = {"Allow": allowed}
        self._send_error(
            405,
            f"{self.command} is not allowed on {self.path.split('?', 1)[0][:200]}; use {allowed}",
            code="method_not_allowed",
        )

    # -- POST

    def do_POST(self):
        self._request = None
        self.request_body = None
        if not self._gate():
            return
        if self.path == pictures.RENDER_PATH:
            return self._render_picture()
        if self.path != PROTOCOL_PATH and self.path not in POST_PATHS:
            self.close_connection = True
            path = self.path.split("?", 1)[0]
            if path in GET_PATHS or path.startswith("/v1/models/"):
                return self._method_not_allowed("GET")
            return self._send_error(404, f"no such endpoint: POST {self.path[:200]}")
        body = self._read_body()
        if body is NO_BODY:
            return
        short = memory.shortage()
        if short is not None:  # (a decode now would crash or hang: serving.memory)
            return self._send_error(503, f"{short}; retry later", code="out_of_memory")
        if self.path == PROTOCOL_PATH:
            return self.handle_protocol(body)
        try:  # (the body's one reading: everything below is handed the RequestBody)
            parsed = request_body.parse_body(body, self.path, self.response_generator)
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        except (ValueError, TypeError) as e:
            return self._send_error(400, str(e), param=_param_of(str(e), request_body.known_fields()))
        self._adopt(parsed)
        try:
            if parsed.route == "chat":
                requests = self.handle_chat_completions(parsed)
            else:
                requests = self.handle_text_completions(parsed)
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        except Exception as e:
            message = str(e) or type(e).__name__
            return self._send_error(400, message, param=_param_of(message, request_body.known_fields()))
        if len(requests) == 1 and parsed.n == 1:
            return self.handle_completion(requests[0], list(parsed.stop))
        choices.answer_choices(self, parsed, requests)

    def _adopt(self, parsed: request_body.RequestBody) -> None:
        """This handler answers `parsed`: mlx_lm.server's APIHandler reads its fields off
        the handler (`self.temperature`, `self.stream`, ...), set here and nowhere else."""
        self.request_body = parsed
        for name, value in request_body.stock_attributes(parsed, self.response_generator.cli_args).items():
            setattr(self, name, value)

    def handle_chat_completions(self, parsed: request_body.RequestBody) -> List[DiffusionRequest]:
        generator = self.response_generator
        try:  # read in full here, before anything runs (mlx_lm_diffusion.media.images)
            pictures = images.check_served_messages(
                parsed.messages,
                images.server_policy(generator.cli_args),
                takes_images=lambda: generator.takes_images(parsed.model),
            )
        except images.ImageError as e:
            raise RequestError(str(e), status=e.status, param="messages") from None
        template_kwargs = parsed.chat_template_kwargs or {}
        if pictures and template_kwargs.get("chat_template") is not None:
            raise RequestError(
                "a client chat template cannot be combined with images (the processor renders "
                "those prompts in the server)",
                param="chat_template_kwargs",
            )
        request = self._diffusion_request(super().handle_chat_completions(), parsed)  # (reads self.body: _adopt)
        request.images = pictures
        tokenizer = generator.model_provider.tokenizer
        if tokenizer is not None and template_kwargs.get("chat_template") is not None:
            try:  # (here, on this request's thread: a render may take seconds)
                request.prompt_ids = generator.client_template_prompt(tokenizer, request, template_kwargs)
            except template_sandbox.TemplateError as e:
                raise RequestError(str(e), param="chat_template_kwargs") from e
        return [request]

    def handle_text_completions(self, parsed: request_body.RequestBody) -> List[DiffusionRequest]:
        """One request per prompt (one choice per prompt and n, in order: serving.choices)."""
        requests = []
        for one in parsed.prompts:
            self.body = {"prompt": one}  # (mlx_lm.server's handle_text_completions reads it)
            request = self._diffusion_request(super().handle_text_completions(), parsed)
            if not isinstance(one, str):
                request.prompt_ids = list(one)  # (taken as they are: generator._tokenize)
            requests.append(request)
        return requests

    def _diffusion_request(self, request: CompletionRequest, parsed: request_body.RequestBody) -> DiffusionRequest:
        stock = {f.name: getattr(request, f.name) for f in dataclasses.fields(CompletionRequest)}
        self._request = DiffusionRequest(
            **stock,
            options=dict(parsed.options),
            drafts=parsed.drafts,
            proposals=parsed.proposals,
            draft_sink=self._send_draft if parsed.drafts else None,
            connection=self.connection,
            peer_probe=self._interim_answer if not parsed.stream and self.request_version == "HTTP/1.1" else None,
        )
        if self.cancel.is_set():
            self._request.cancel_error = self.cancel_error
            self._request.cancel.set()
        return self._request

    def _interim_answer(self) -> None:
        """An interim `100 Continue` (HTTP/1.1 clients read and skip 1xx answers): written
        when the client's stream ended while its answer is decoded, to tell a client that
        half-closed (it reads on) from one that left (its system answers with a reset)."""
        self.connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")

    # -- completions

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

    def _render_picture(self) -> None:
        """The studio's picture of its frames (serving.pictures), as a download."""
        body = self._read_body()
        if body is NO_BODY:
            return
        try:
            data, content_type, name = pictures.render(body)
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Disposition", f'attachment; filename="{name}"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_static(self, status: int, body: bytes, content_type: str) -> None:
        """A studio file, under the page's Content-Security-Policy."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in studio.STATIC_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        self._stream_started = True

    def handle_models_request(self):
        """The served models only (mlx_lm.server lists the whole Hugging Face cache)."""
        ids = list(self.response_generator.model_ids)
        models = [{"id": i, "object": "model", "created": self.created, "owned_by": "operator"} for i in ids]
        path = self.path.split("?", 1)[0]
        parts = path.split("/")
        if len(parts) > 3 and "/".join(parts[3:]):
            wanted = unquote("/".join(parts[3:]))
            key = self.response_generator.served.get(wanted)
            found = [m for m in models if key is not None and m["id"] == self.response_generator.listed[key]]
            if not found:
                return self._send_error(
                    404, f"model {wanted[:200]!r} is not served here", param="model", code="model_not_found"
                )
            return self._send_json(200, found[0])
        self._send_json(200, {"object": "list", "data": models})

    def handle_protocol(self, body: Any) -> None:
        """POST /v1/diffusion/generate: an InferenceRequest in, an InferenceResponse out;
        a request that breaks the schema gets a 400 carrying the validation message."""
        try:
            response = self.response_generator.run_protocol(body, self.cancel)
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        except images.ImageError as e:  # (400, or 413 past the size limits)
            return self._send_error(e.status, str(e), param="images")
        except (ValueError, TypeError) as e:
            return self._send_error(400, str(e))
        except Exception as e:
            if memory.is_out_of_memory(e):
                logging.error(f"protocol request failed: {type(e).__name__}: {e}")
                self.response_generator.note_outcome(e)
                return self._send_error(503, f"out of memory: {e}; retry later", code="out_of_memory")
            logging.exception("protocol request failed")
            return self._send_error(500, f"{type(e).__name__}: {e}")
        self._send_bytes(200, json.dumps(json_safe(response)).encode())
