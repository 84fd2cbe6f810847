"""Client chat templates (--allow-client-chat-templates), rendered in a child process.

A template is a program: transformers renders it in Jinja's sandbox, which stops attribute
tricks but not `{{ 'x' * 10**10 }}` (memory) nor nested loops of a billion turns (time).
Rendered in the server, one such request took the process's memory or a thread forever.
Here each client template is rendered by `python -m mlx_lm_diffusion.serving.template_sandbox`
under a memory cap (RLIMIT_DATA) and a CPU-time cap (RLIMIT_CPU), killed past a wall-clock
limit, its output bounded, at most MAX_RENDERERS at once (a client past them waits, then gets
a 503); the server then tokenizes the text it returned. The child costs
about a second (transformers' renderer imports); only client templates pay it.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import threading
from typing import Any, Optional

# wall clock for one render, the child's start included (its imports take 1 s on a quiet
# machine, 8 s on a loaded 2-core one): the CPU cap is what normally stops a template
RENDER_SECONDS = 30
RENDER_CPU_SECONDS = 5
RENDER_MEMORY_BYTES = 512 * 1024 * 1024  # the child's data segment over its start (~120 MB)
MAX_RENDERED_BYTES = 4 * 1000 * 1000  # a prompt longer than this is no prompt a model takes
MAX_RENDERERS = 2  # renderer processes at once: more clients wait for one (up to RENDER_SECONDS), then a 503
_renderers = threading.BoundedSemaphore(MAX_RENDERERS)


class TemplateError(ValueError):
    """The client's template failed, or went past a limit (a 400)."""


class RenderersBusy(TemplateError):
    """Every renderer slot stayed taken for RENDER_SECONDS (a 503: try again)."""


def render(template: str, messages: list, tools: Optional[list], kwargs: dict, specials: dict) -> str:
    """The prompt text `template` renders for `messages` (as tokenizer.apply_chat_template
    with add_generation_prompt=True: the tokenizer's special tokens are variables)."""
    request = json.dumps({"template": template, "messages": messages, "tools": tools, "kwargs": {**specials, **kwargs}})
    if not _renderers.acquire(timeout=RENDER_SECONDS):
        raise RenderersBusy(f"{MAX_RENDERERS} client chat templates are rendering already; try again")
    try:
        return _render(request)
    finally:
        _renderers.release()


def _render(request: str) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__], input=request.encode(), capture_output=True, timeout=RENDER_SECONDS
        )
    except subprocess.TimeoutExpired:
        raise TemplateError(f"the chat template did not finish rendering within {RENDER_SECONDS} s") from None
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"the renderer was stopped (signal {-done.returncode})"
        if "MemoryError" in reason:
            reason = f"the chat template needed more than {RENDER_MEMORY_BYTES >> 20} MB"
        elif done.returncode < 0:  # (SIGXCPU, SIGKILL: the CPU-time cap)
            reason = f"the chat template ran past {RENDER_CPU_SECONDS} s of CPU time"
        raise TemplateError(f"the chat template failed: {reason}")
    if len(done.stdout) > MAX_RENDERED_BYTES:
        raise TemplateError(f"the chat template rendered more than {MAX_RENDERED_BYTES} bytes")
    return json.loads(done.stdout)["text"]


def _limit() -> None:
    """The caps, set by the child on itself once its imports are done, over what those
    imports used: RLIMIT_CPU counts the process's CPU time from its start, and the imports
    alone can take seconds (a cold start, a machine under load). (macOS does not enforce
    RLIMIT_DATA on large allocations: there the time limits bound a template.)"""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    spent = math.ceil(usage.ru_utime + usage.ru_stime)
    for kind, cap in (
        (resource.RLIMIT_DATA, _data_bytes() + RENDER_MEMORY_BYTES),
        (resource.RLIMIT_CPU, spent + RENDER_CPU_SECONDS),
    ):
        _, hard = resource.getrlimit(kind)
        try:
            resource.setrlimit(kind, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
        except (ValueError, OSError):
            pass


def _data_bytes() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> int:
    from transformers.utils.chat_template_utils import render_jinja_template

    request: Any = json.loads(sys.stdin.buffer.read())
    _limit()
    rendered, _ = render_jinja_template(
        [request["messages"]],
        tools=request["tools"],
        chat_template=request["template"],
        add_generation_prompt=True,
        **request["kwargs"],
    )
    text = rendered[0]
    out = json.dumps({"text": text}).encode()
    if len(out) > MAX_RENDERED_BYTES:
        out = b"x" * (MAX_RENDERED_BYTES + 1)  # (the parent refuses it by its length)
    sys.stdout.buffer.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
