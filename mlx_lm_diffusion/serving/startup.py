"""An OpenAI-compatible server for diffusion models, on mlx_lm.server's machinery.

    mlx_lm_diffusion.server [--model PATH] [--port 8080] [--block-length 32 --steps 32 ...]

(without --model: the embedded demo model, as the generate and chat CLIs)

Takes every mlx_lm.server flag (parsed by mlx_lm.server itself) plus the diffusion
defaults, and serves /v1/chat/completions, /v1/completions, /v1/models and /health
with mlx_lm.server's request and response shapes. On top of mlx_lm.server:

* per-request decoding fields in the JSON body: block_length, steps, strategy,
  threshold, factor, entropy_bound, alg_temp, editing_threshold, max_post_steps,
  checked before anything is generated;
* `"drafts": true` with `"stream": true` sends the canvas after every forward as an
  SSE comment line (`: draft {"forwards": 3, "committed": 1, "text": "He░░o"}`),
  which OpenAI clients ignore;
* every error has OpenAI's body, `{"error": {"message", "type", "param", "code"}}`:
  a 4xx for a bad request (malformed HTTP or JSON, an invalid field, a prompt the
  model cannot decode, a model this server does not serve), a 5xx for the server's
  own failures; an error found once a stream has begun ends the stream with an SSE
  `data: {"error": ...}` event and `data: [DONE]`;
* POST /v1/diffusion/generate takes a step-schedule InferenceRequest and returns its
  InferenceResponse (`protocol.run_request`); a schema violation is a 400 carrying
  the validation message.

What a client may do is bounded (mlx_lm.server leaves these open):

* bodies: at most --max-body-bytes (413), a Content-Length required (411) and
  well-formed (400), UTF-8 JSON without NaN/Infinity nested at most
  MAX_JSON_DEPTH deep (400); sampling fields finite and in range (400);
* connections: a listen backlog of 128, --read-timeout for the request line,
  headers and body, at most --max-connections open (503 beyond), RLIMIT_NOFILE
  restored after mlx_lm.utils lowers it; a client that goes away (streaming or not)
  cancels its decode at the next forward;
* models: only --model and the --allowed-models the operator named are served; any
  other "model" is a 404 that reads neither the filesystem nor the Hub; a request's
  draft_model, adapters and num_draft_tokens are refused (--adapter-path, the
  operator's, loads LoRA adapters as mlx_lm.server does), images (DiffusionGemma) are
  data: URLs or files under --allowed-image-dir (nothing is fetched; --max-images,
  --max-image-bytes: 400 / 413), a client's chat template is refused unless
  --allow-client-chat-templates;
* browsers: CORS is off unless --allowed-origins names origins; a request carrying an
  Origin not allowed, or a Host that is a domain name this server was not told of
  (--allowed-hosts; DNS rebinding), gets a 403;
* SIGTERM / SIGINT stop accepting, let in-flight requests finish for
  --shutdown-grace seconds, cancel the rest with an error, and exit 0; a stop that
  takes STOP_MARGIN seconds longer than that (a decode stuck in native code, as out of
  memory leaves one) ends the process anyway, exit 1. Before the server serves, either
  signal ends the start-up at once: exit 130 / 143, one line (serving.starting);
* the server fails at start (one line on stderr, exit 2, before binding the port)
  when --model cannot be loaded, a flag cannot apply to a diffusion model, or memory
  runs out (an import, a thread, less address space left than a decode needs);
* memory: under an address-space limit a generation request that would start with less
  than serving.memory.RESERVE_BYTES left gets a 503 and /health a 503 saying why (MLX
  and OpenBLAS crash or hang where their allocations fail); an allocation failure a
  request meets is a 503; a connection whose thread cannot start gets a 503.

Diffusion requests are batched continuously (mlx_lm_diffusion.serving.scheduler): one running
batch per group of requests with the same family options, rows joining at the next step
and leaving once done, at most --decode-concurrency rows a batch; each row gives the
tokens the request gives alone. --no-batch serves one request at a time, as mlx_lm.server
does for these models (their `compat.TokenCache` has no `merge`). The step-schedule
endpoint's requests join the same scheduler (a batch of protocol rows, which ignore EOS;
with --no-batch each decodes whole under the decode lock). For the families whose prompt
KV is exact, the prompt cache also holds the KV of its leading tokens: a request (batched
or not) that shares a prefix with an earlier one prefills only the rest; usage's
`prompt_tokens_details.cached_tokens` counts the positions the cache held, and GET
/v1/stats reports running and queued requests and the prompt cache's occupancy (kv_reuse).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx_lm.server as mlx_server
from mlx_lm.server import (
    LRUPromptCache,
    ModelProvider,
    ResponseGenerator,
)
from mlx_lm.utils import _parse_size

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.install import install
from mlx_lm_diffusion.api.loading import missing_adapter_files
from mlx_lm_diffusion.demo import MODEL_HELP, model_or_demo
from mlx_lm_diffusion.flags import one_line_errors
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.parallel import distributed, heartbeat
from mlx_lm_diffusion.serving import distributed_server, memory, starting
from mlx_lm_diffusion.serving.errors import StartupError
from mlx_lm_diffusion.serving.generator import DEFAULT_LONG_FORWARDS, DEFAULT_MAX_FORWARDS, DiffusionResponseGenerator
from mlx_lm_diffusion.serving.handler import DEFAULT_MAX_BODY_BYTES
from mlx_lm_diffusion.serving.http_server import (
    DEFAULT_MAX_CLIENT_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    DiffusionHTTPServer,
    make_http_server,
)
from mlx_lm_diffusion.serving.openai_requests import DEFAULT_MAX_CHOICES

PROG = starting.PROG
DEFAULT_SHUTDOWN_GRACE = 30.0
# seconds a stop may take beyond --shutdown-grace (and the cancelled requests' 5 s to end)
# before the process leaves without the threads that have not stopped
STOP_MARGIN = 15.0
# mlx_lm.server flags that cannot apply to a diffusion model: refused at start
INAPPLICABLE_FLAGS = {
    "draft_model": ("--draft-model", "speculative decoding does not apply to diffusion models"),
    "num_draft_tokens": ("--num-draft-tokens", "speculative decoding does not apply to diffusion models"),
    "kv_bits": ("--kv-bits", compat.NO_KV_QUANTIZATION),
    "kv_group_size": ("--kv-group-size", compat.NO_KV_QUANTIZATION),
    "quantized_kv_start": ("--quantized-kv-start", compat.NO_KV_QUANTIZATION),
    "prefill_step_size": ("--prefill-step-size", "a diffusion model has no prefill"),
    "pipeline": (
        "--pipeline",
        "pipeline parallelism is not supported for diffusion models; tensor "
        "parallelism is (mlx.launch without --pipeline)",
    ),
}


# the NOFILE limits this process started with, before mlx_lm.utils set (2048, 4096);
# known here when this module is imported before mlx_lm.utils, else read at start
_NOFILE_AT_IMPORT = None if "mlx_lm.utils" in sys.modules else resource.getrlimit(resource.RLIMIT_NOFILE)


def start(args: argparse.Namespace) -> Tuple[DiffusionHTTPServer, DiffusionResponseGenerator]:
    """Install the mlx-lm hooks, start the generation thread, wait for it to load
    --model (StartupError if it cannot), then bind the HTTP server; call
    `serve_forever()` on the first result. Stop with `httpd.shutdown();
    httpd.server_close(); generator.stop_and_join()` (or `shutdown(httpd, generator)`)."""
    model = getattr(args, "model", None)
    if isinstance(model, str) and model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        raise StartupError(f"cannot load --model {model!r}: no such directory")
    adapter = getattr(args, "adapter_path", None)  # (checked here, so the message names the flag at fault)
    missing = missing_adapter_files(adapter) if isinstance(adapter, str) else None
    if missing is not None:
        raise StartupError(f"cannot load --adapter-path {adapter!r}: {missing}")
    short = memory.shortage(memory.START_RESERVE_BYTES + memory.weights_bytes(model), "load the model")
    if short is not None:  # (MLX's loader hangs where its threads cannot start)
        raise StartupError(short)
    install()
    provider = ModelProvider(args)
    # mlx_lm.server bounds the bytes only when it batches; here always (the KV it holds)
    max_bytes = args.prompt_cache_bytes if getattr(args, "prompt_cache_bytes", None) is not None else 1 << 63
    prompt_cache = LRUPromptCache(args.prompt_cache_size, max_bytes)
    generator = DiffusionResponseGenerator(provider, prompt_cache, compat.decode_defaults(args))
    try:
        generator.wait_loaded()
        _first_matmul()
        short = memory.shortage()
        if short is not None:  # (its first decode would crash or hang)
            raise StartupError(short)
        if not distributed.is_leader(generator.group):
            return None, generator  # mlx.launch: rank 0 serves, this rank follows it
        try:
            httpd = make_http_server(args.host, args.port, generator)
            if generator.group is not None:  # (a rank that dies: every client gets an error, not a cut)
                distributed.on_failure(httpd.answer_all)
        except OSError as e:
            raise StartupError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    except BaseException:
        generator.stop_and_join()
        raise
    return httpd, generator


def _first_matmul() -> None:
    """Under an address-space limit, OpenBLAS's one-time set-up (memory.first_matmul) here,
    where running short is a start-up error: it retries an allocation that fails forever."""
    if memory.address_space_limit() is None:
        return
    short = memory.shortage(memory.START_RESERVE_BYTES, "set up the matrix library")
    if short is not None:
        raise StartupError(short)
    memory.first_matmul()


def shutdown(
    httpd: DiffusionHTTPServer, generator: ResponseGenerator, grace: float, hurry: Optional[threading.Event] = None
) -> int:
    """Graceful stop (see DiffusionHTTPServer.drain), then the generation thread is
    joined and the model released in it. Returns how many requests were cancelled."""
    cancelled = httpd.drain(grace, hurry=hurry)
    httpd.server_close()
    generator.stop_and_join()
    return cancelled


def restore_nofile(original: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """Undo mlx_lm.utils' RLIMIT_NOFILE of (2048, 4096): back to the limits this
    process started with (known when this module was imported first, else its
    parent's), as far as the process may raise them. Returns the limits now."""
    if original is None:
        original = _NOFILE_AT_IMPORT or _parent_nofile()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if original is None:
        return soft, hard
    want_soft, want_hard = original
    inf = resource.RLIM_INFINITY
    if want_hard == inf or (hard != inf and want_hard > hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, want_hard))
            hard = want_hard
        except (ValueError, OSError):
            pass
    target = want_soft if hard == inf or (want_soft != inf and want_soft <= hard) else hard
    if target == inf or target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _parent_nofile() -> Optional[Tuple[int, int]]:
    try:
        text = Path(f"/proc/{os.getppid()}/limits").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Max open files"):
            values = line.split()[3:5]
            return tuple(resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in values)
    return None


@contextmanager
def _patched(target: Any, **attrs: Any) -> Iterator[None]:
    saved = {name: getattr(target, name) for name in attrs}
    for name, value in attrs.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


class _FlagRecorder(argparse.ArgumentParser):
    """mlx_lm.server's parser, recording which flags the command line gave; its errors
    (an unknown flag, a bad value) are one line, as the server's own are."""

    given: set = set()

    def add_argument(self, *names, **kwargs):
        if "--model" in names:  # (what --model means here: no --model serves the demo)
            kwargs["help"] = MODEL_HELP
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> None:
        _fail(f"{message} (see {PROG} --help)")

    def parse_args(self, args=None, namespace=None):
        saved = [(a, a.default) for a in self._actions]
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        try:
            _FlagRecorder.given = set(vars(super().parse_args(args)))
        finally:
            for a, default in saved:
                a.default = default
        return super().parse_args(args, namespace)


def _server_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("serving limits")
    group.add_argument(
        "--allowed-models",
        type=lambda x: [m for m in x.split(",") if m],
        default=[],
        help="Models a request may name besides --model (comma-separated paths or repo ids); any other model is a 404",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="The id /v1/models lists for --model, which requests may name (default: the "
        'model directory\'s name, or the repo id as given); "default_model" and the '
        "path work too",
    )
    group.add_argument(
        "--allowed-hosts",
        type=lambda x: [h for h in x.split(",") if h],
        default=[],
        help="Host names the server answers under besides IP addresses and localhost "
        "(comma-separated; DNS rebinding protection)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=_parse_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="Largest request body (default 10MB; e.g. 1MB, 50MB)",
    )
    group.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        help="Seconds a client has to send its request line, headers and body (default 30)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"Open connections at most; more get a 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    group.add_argument(
        "--max-client-connections",
        type=int,
        default=DEFAULT_MAX_CLIENT_CONNECTIONS,
        help="Open connections one client address may hold; more get a 503 (default "
        f"{DEFAULT_MAX_CLIENT_CONNECTIONS}, so one address cannot take every connection; 0: no "
        "per-client cap, for a server behind a reverse proxy, where every client has the "
        "proxy's address)",
    )
    group.add_argument(
        "--allow-client-chat-templates",
        action="store_true",
        help="Let requests replace the chat template (chat_template_kwargs.chat_template)",
    )
    group.add_argument(
        "--no-batch",
        action="store_true",
        help="Serve one request at a time instead of continuous batching (the batch size "
        "is mlx_lm.server's --decode-concurrency)",
    )
    group.add_argument(
        "--max-forwards",
        type=int,
        default=DEFAULT_MAX_FORWARDS,
        help="Model forwards a request may take at most, from its settings (steps x blocks, "
        f"plus editing passes); a request over it gets a 400 (default {DEFAULT_MAX_FORWARDS})",
    )
    group.add_argument(
        "--max-choices",
        type=int,
        default=DEFAULT_MAX_CHOICES,
        help="Choices one answer may hold (n times the prompts of a completion); more get a 400 "
        f"(default {DEFAULT_MAX_CHOICES})",
    )
    group.add_argument(
        "--long-request-forwards",
        type=int,
        default=DEFAULT_LONG_FORWARDS,
        help="A request that could take more forwards than this is long: long requests hold at "
        f"most half of a batch's rows, the rest stay for short ones (default {DEFAULT_LONG_FORWARDS})",
    )
    group.add_argument(
        "--kernel-cache-dir",
        default=None,
        help="Where MLX compiles its kernels (default: ~/.cache/mlx_lm_diffusion/kernels, 0700, kept "
        "across starts; never the shared temporary directory; a directory others can write is "
        "refused)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE,
        help="Seconds SIGTERM/SIGINT let requests in flight finish before cancelling them (default 30)",
    )
    return parser


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """mlx_lm.server's flags, parsed by mlx_lm.server.main itself (which also sets up
    logging), plus the diffusion defaults and the serving limits. A flag that cannot
    apply, or a bad value, exits 2 with one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = one_line_errors(argparse.ArgumentParser(prog=PROG, add_help=False), prefix=f"{PROG}: error: ")
    compat.add_decode_arguments(ours)
    _server_arguments(ours)
    images.add_server_arguments(ours)
    dargs, rest = ours.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest):
        print("Diffusion and serving options (with every mlx_lm.server option below):")
        ours.print_help()
        print()
    captured: List[argparse.Namespace] = []
    recorder = SimpleNamespace(**{**vars(argparse), "ArgumentParser": _FlagRecorder})
    with (
        _patched(
            mlx_server,
            argparse=recorder,
            run=lambda host, port, provider: captured.append(provider.cli_args),
            ModelProvider=lambda cli_args: SimpleNamespace(cli_args=cli_args),
        ),
        _patched(sys, argv=[PROG, *rest]),
    ):
        mlx_server.main()
    args = captured[0]
    given = set(_FlagRecorder.given)
    for name, value in vars(dargs).items():
        setattr(args, name, value)
    for dest, (flag, why) in INAPPLICABLE_FLAGS.items():
        if dest in given:
            _fail(f"{flag} cannot apply: {why}")
    if "max_tokens" not in given:  # the model's own default, as the generate CLI (openai_requests)
        args.max_tokens = None
    if "allowed_origins" not in given:
        args.allowed_origins = []  # CORS off unless the operator names origins
    try:
        compat.decode_defaults(args)
    except ValueError as e:
        _fail(str(e))
    if args.max_body_bytes is None or args.max_body_bytes < 1:
        _fail("--max-body-bytes must be positive")
    if not args.read_timeout > 0:
        _fail("--read-timeout must be positive")
    if args.max_connections < 1:
        _fail("--max-connections must be at least 1")
    if args.max_client_connections is not None and args.max_client_connections < 0:
        _fail("--max-client-connections must be 0 (no cap) or more")
    if args.max_forwards < 1:
        _fail("--max-forwards must be at least 1")
    if args.max_choices < 1:
        _fail("--max-choices must be at least 1")
    if args.long_request_forwards < 1:
        _fail("--long-request-forwards must be at least 1")
    if not args.shutdown_grace >= 0:
        _fail("--shutdown-grace must be >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    args = parse_args(argv)
    args.model = model_or_demo(args.model)  # (as the generate and chat CLIs)
    saved_tmpdir = os.environ.get("TMPDIR")
    args.kernel_cache_dir, private = use_kernel_cache(args.kernel_cache_dir)
    if private:
        starting.at_end(lambda: shutil.rmtree(args.kernel_cache_dir, ignore_errors=True))
    restore_nofile()
    stop, serving = threading.Event(), threading.Event()
    signals: List[int] = []
    command_line = argv is None

    def on_signal(signum, frame):
        if command_line and not serving.is_set():
            starting.end(signum)  # (nothing to drain yet, and a model may take minutes to load)
        signals.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(args, stop, serving, signals, command_line=command_line)
    finally:
        _restore_signals(previous)  # (a caller in process, e.g. a test, keeps its Ctrl-C)
        if private:
            shutil.rmtree(args.kernel_cache_dir, ignore_errors=True)
        if saved_tmpdir is None:  # (a caller in process keeps its temporary directory)
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_tmpdir
        tempfile.tempdir = None


def use_kernel_cache(named: Optional[str]) -> tuple[str, bool]:
    """(the server's kernel and temporary directory, whether it is private: removed at the
    end). The per-user cache (mlx_lm_diffusion.kernel_cache: 0700, the user's own, kept across
    starts so a fresh server finds its kernels compiled), or the operator's --kernel-cache-dir
    (refused, one line, where others could write to it); TMPDIR points there from now on."""
    try:
        path, private, why = kernel_cache.prepare(named)
    except ValueError as e:
        _fail(str(e))
    if why:
        logging.warning("kernel cache: %s; using a private directory instead", why)
    kernel_cache.use(path)
    logging.info("kernel cache and temporary files: %s", path)
    return path, private


def _serve(args, stop: threading.Event, serving: threading.Event, signals: List[int], command_line: bool) -> int:
    """Start, serve (`serving` set) until `stop` (a signal) or the accept loop ends, then
    shut down in order."""
    try:
        httpd, generator = start(args)
    except StartupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        # (the generation thread that tried to load is still there: a normal interpreter
        # exit beside it aborted 1 of 6 starts with a missing --adapter-path, issue 55.4)
        return _exit_now(2) if command_line else 2
    if httpd is None:
        code = distributed_server.follow(generator)
        return _exit_now(code) if command_line else code
    if stop.is_set():  # (a signal during the start-up, in process: it never serves)
        shutdown(httpd, generator, 0.0)
        return 0
    serving.set()
    starting.started()
    if command_line:  # (started now: under memory pressure a thread may not start later)
        _leave_if_stuck(stop, args.shutdown_grace + 5.0 + STOP_MARGIN)
    host, port = httpd.server_address[:2]
    logging.info(f"Starting httpd at {host} on port {port}...")
    accepting = threading.Thread(target=httpd.serve_forever, name="http-accept", daemon=True)
    accepting.start()
    while not stop.wait(0.5):
        if not accepting.is_alive():
            break
        if generator.group is not None and not generator.generation_available():
            distributed.fail(
                generator.group,
                "the generation loop ended: the distributed group failed (a peer rank died or lost its connection)",
            )
    name = signal.Signals(signals[0]).name if signals else "stop"
    logging.info(f"{name}: no new connections; waiting up to {args.shutdown_grace:g} s for requests in flight")
    hurry = threading.Event()  # a second signal cancels what is left at once
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: hurry.set())
    shutdown(httpd, generator, args.shutdown_grace, hurry)
    accepting.join(timeout=5)
    logging.info("stopped")
    if command_line:  # leave without C++ static teardown (see _exit_now)
        _exit_now(0)
    return 0


def _leave_if_stuck(stop: threading.Event, seconds: float) -> None:
    """Once `stop` is set, give the stop `seconds`; past them end the process (exit 1): a
    thread stuck in native code (OpenBLAS retries an allocation that fails forever) would
    otherwise keep the server from ending, whatever signal it gets."""

    def watch() -> None:
        stop.wait()
        time.sleep(seconds)
        logging.error(
            f"the server did not stop within {seconds:g} s of the signal (a decode stuck in native "
            "code, as running out of memory leaves one); exiting without it"
        )
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="stop-deadline", daemon=True).start()


def _restore_signals(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def _exit_now(code: int) -> None:
    """End the process once the server has stopped in order (connections drained,
    generation thread joined, model released in it): flush what Python buffers, then
    os._exit, so that no native destructor runs after Python's (MLX's stream threads at
    interpreter teardown ended some exits with SIGABRT, "terminate called without an
    active exception")."""
    try:
        import mlx.core as mx

        mx.synchronize()
    except Exception:
        pass
    heartbeat.say_bye()  # (the other ranks stop watching this one: it ends normally)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
