"""`DiffusionLM`: lm-evaluation-harness's `LM` for every diffusion family (lm-eval required).

The model side of mlx_lm.evaluate's `MLXLM`, for diffusion models:

- `generate_until`: the engine (evaluation.generation: a running batch of at most
  `batch_size` rows, each stopped at its EOS, its `until` strings or `max_gen_toks`),
  with the decoding options given (threshold, cache, block_length, ...) and the sampler;
  the prompt is tokenized as mlx_lm.evaluate tokenizes it (no special tokens once a
  chat template rendered it).
- `loglikelihood`: the masked-diffusion bound by Monte Carlo (evaluation.likelihood:
  LLaDA's `get_log_likelihood`; BD3-LM's block bound for the block-causal families),
  `mc_samples` samples in batches of `batch_size`, seeded per request from `seed`, the
  context's tokens and the continuation's length, so a score repeats whatever the order
  or company of its request, and the choices of one question (continuations of one
  length) are scored over the same masks: common random numbers, so that the noise of
  the estimate cancels where choices are compared.
  is_greedy: every continuation token is the argmax when it alone is masked.
- `loglikelihood_rolling`: the same bound over a whole text, in lm-eval's rolling
  windows of the model's context (each window's context is the text before it; the
  first window's is empty, or the prefix token where the family cannot score a first
  token alone), summed.

Every request's cost is added to `speed` (evaluation.speed) under its task's name.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from mlx_lm_diffusion.api.loading import load
from mlx_lm_diffusion.evaluation.generation import generate_until
from mlx_lm_diffusion.evaluation.layout import bound_layout
from mlx_lm_diffusion.evaluation.likelihood import estimate_log_likelihood, greedy_match
from mlx_lm_diffusion.evaluation.speed import SpeedTally
from model_adapters import adapter_for

DEFAULT_MAX_TOKENS = 256  # lm-eval's max_gen_toks when a task sets none

log = logging.getLogger(__name__)


def request_seed(seed: int, context: Sequence[int], continuation: Sequence[int]) -> list:
    """A numpy seed from the run's seed, the context's tokens and the continuation's
    length: the same request draws the same masks in any run with that seed, and so do
    the choices of one question (the draws depend on the continuation's length only)."""
    data = np.asarray(list(context), dtype=np.int64).tobytes()
    return [int(seed), zlib.crc32(data), len(continuation)]


@register_model("mlx_diffusion")
class DiffusionLM(LM):
    """lm-eval's LM over a diffusion checkpoint: `path_or_hf_repo`, or `loaded` (the
    (model, tokenizer) `mlx_lm_diffusion.load` returned, shared by several settings).
    `options`: decoding options (DecodeOptions keywords) for every generation."""

    def __init__(
        self,
        path_or_hf_repo: Optional[str] = None,
        max_tokens: Optional[int] = None,
        batch_size: int = 8,
        use_chat_template: Optional[bool] = None,
        chat_template_args: Optional[dict] = None,
        trust_remote_code: bool = False,
        sampler: Optional[Callable] = None,
        mc_samples: int = 128,
        seed: int = 123,
        options: Optional[dict] = None,
        loaded: Optional[tuple] = None,
    ) -> None:
        super().__init__()
        if loaded is None:
            if path_or_hf_repo is None:
                raise ValueError("DiffusionLM needs a checkpoint (path_or_hf_repo) or a loaded (model, tokenizer)")
            loaded = load(path_or_hf_repo, trust_remote_code=trust_remote_code)
        self.model, self.tokenizer = loaded
        self.max_tokens = max_tokens
        self.batch_size = int(batch_size)
        self.use_chat_template = (
            self.tokenizer.chat_template is not None if use_chat_template is None else bool(use_chat_template)
        )
        self.chat_template_args = dict(chat_template_args or {})
        self.sampler = sampler
        self.mc_samples = int(mc_samples)
        self.seed = int(seed)
        self.options = dict(options or {})
        self.speed = SpeedTally()

    # -- chat templates and tokens (as mlx_lm.evaluate)

    def apply_chat_template(self, chat_history: list, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            **self.chat_template_args,
        )

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: Any = False) -> str:
        return self.tokenizer.chat_template or ""

    def _encode(self, text: str) -> list:
        # (a rendered chat template already holds its special tokens)
        return list(self.tokenizer.encode(text, add_special_tokens=not self.use_chat_template))

    def _prefix_token(self) -> int:
        """The token a text is conditioned on when nothing precedes it (lm-eval's prefix_token_id)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else int(self.tokenizer.eos_token_id)

    # -- generation

    def generate_until(self, requests: list) -> list:
        """Each task's requests decoded together (so that each task's speed is its own)."""
        by_task = defaultdict(list)
        for i, request in enumerate(requests):
            by_task[request.task_name].append(i)
        answers: list = [""] * len(requests)
        for task, indices in by_task.items():
            contexts, kwargs = zip(*[requests[i].args for i in indices])
            prompts = [self._encode(c) for c in contexts]
            limits = [self.max_tokens or int(k.get("max_gen_toks", DEFAULT_MAX_TOKENS)) for k in kwargs]
            until = [[k["until"]] if isinstance(k.get("until"), str) else list(k.get("until") or []) for k in kwargs]
            run = generate_until(
                self.model,
                self.tokenizer,
                prompts,
                limits,
                until,
                {**self.options, "sampler": self.sampler},
                self.batch_size,
            )
            speed = self.speed.task(task)
            speed.generated += len(indices)
            speed.tokens += run.tokens
            speed.forwards += run.forwards
            speed.seconds += run.seconds
            for i, generation in zip(indices, run.generations):
                answers[i] = self._without_thinking(generation.text)
        return answers

    def _without_thinking(self, text: str) -> str:
        """The answer after a thinking model's closing tag (as mlx_lm.evaluate strips it)."""
        if getattr(self.tokenizer, "has_thinking", False):
            end = self.tokenizer.think_end
            if end in text:
                return text[text.find(end) + len(end) :]
        return text

    # -- scoring

    def loglikelihood(self, requests: list) -> list:
        adapter = adapter_for(self.model, self.tokenizer)
        layout = bound_layout(adapter)  # (a family without a bound fails before any forward)
        out = []
        for request in tqdm(requests, desc="loglikelihood (diffusion bound)", disable=len(requests) < 2):
            tic = time.perf_counter()
            context, continuation = self._encode_pair(*request.args)
            context, continuation = self._fit(context, continuation, layout.needs_context, adapter.max_length)
            speed = self.speed.task(request.task_name)
            speed.scored += 1
            if continuation is None:
                out.append((-float("inf"), False))
                continue
            estimate = estimate_log_likelihood(
                adapter,
                context,
                continuation,
                self.mc_samples,
                self.batch_size,
                request_seed(self.seed, context, continuation),
            )
            greedy, forwards = greedy_match(adapter, context, continuation, self.batch_size)
            speed.scoring_forwards += estimate.forwards + forwards
            speed.scoring_seconds += time.perf_counter() - tic
            out.append((estimate.log_likelihood, bool(greedy)))
        return out

    def _encode_pair(self, context: str, continuation: str) -> tuple:
        """Context and continuation ids as lm-eval's HF model splits them: the whole text
        encoded at once, the context's trailing spaces moved to the continuation; an empty
        context: the continuation alone, without special tokens."""
        if not context:
            return [], list(self.tokenizer.encode(continuation, add_special_tokens=False))
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self._encode(context + continuation)
        start = len(self._encode(context))
        return whole[:start], whole[start:]

    def _fit(self, context: list, continuation: list, needs_context: bool, limit: Optional[int]) -> tuple:
        """The pair within the model's context (the context cut on the left, as
        mlx_lm.evaluate does); a continuation that cannot fit: (context, None)."""
        if needs_context and not context:
            context = [self._prefix_token()]
        if limit is None or len(context) + len(continuation) <= limit:
            return context, continuation
        keep = limit - len(continuation)
        if keep < int(needs_context):
            log.warning(
                "a continuation of %d tokens does not fit the context of %d: scored -inf", len(continuation), limit
            )
            return context, None
        return (context[len(context) - keep :] if keep else []), continuation

    def loglikelihood_rolling(self, requests: list) -> list:
        adapter = adapter_for(self.model, self.tokenizer)
        layout = bound_layout(adapter)
        window = (adapter.max_length or 1 << 30) - 1  # (the context plus the window's tokens fit the model)
        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling (diffusion bound)", disable=len(requests) < 2):
            tic = time.perf_counter()
            tokens = list(self.tokenizer.encode(request.args[0], add_special_tokens=False))
            total, forwards = 0.0, 0
            windows = get_rolling_token_windows(tokens, self._prefix_token(), window, context_len=1)
            for n, pair in enumerate(map(make_disjoint_window, windows)):
                context, continuation = pair
                if n == 0 and not layout.needs_context:
                    context = []  # the text's first tokens scored on nothing at all
                estimate = estimate_log_likelihood(
                    adapter,
                    context,
                    continuation,
                    self.mc_samples,
                    self.batch_size,
                    request_seed(self.seed, context, continuation),
                )
                total += estimate.log_likelihood
                forwards += estimate.forwards
            speed = self.speed.task(request.task_name)
            speed.scored += 1
            speed.scoring_forwards += forwards
            speed.scoring_seconds += time.perf_counter() - tic
            out.append(total)
        return out
