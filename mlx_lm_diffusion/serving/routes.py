"""The routes: GET (models, stats, health, the studio's files) and POST (completions, chat
completions, the step-schedule protocol, the studio's pictures): DiffusionAPIHandler, the
server's handler class."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, List
from urllib.parse import unquote

from mlx_lm.server import CompletionRequest

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.serving import choices, memory, pictures, request_body, studio, template_sandbox
from mlx_lm_diffusion.serving.answers import CompletionAnswers
from mlx_lm_diffusion.serving.errors import RequestError, _param_of
from mlx_lm_diffusion.serving.handler import NO_BODY
from mlx_lm_diffusion.serving.openai_requests import DiffusionRequest
from mlx_lm_diffusion.serving.responses import json_safe

PROTOCOL_PATH = "/v1/diffusion/generate"  # the step-schedule protocol (shared/seeds/004)
STATS_PATH = "/v1/stats"  # running decodes, queued requests, prompt cache occupancy
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
GET_PATHS = ("/v1/models", "/health", STATS_PATH)  # (the studio's files too, which no client POSTs to)


class DiffusionAPIHandler(CompletionAnswers):
    """The server's handler: its routes (GET, POST, the protocol, the studio's files),
    over the completions' answers (serving.answers) and the HTTP side (serving.handler).
    A completions or chat completions body is parsed once into a RequestBody
    (serving.request_body) and handed down from here."""

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
