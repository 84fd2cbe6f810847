"""What every decoder shares: the canvas, a block's state, queued steps, logit statistics.

A decoder is one decoding paradigm (a masked canvas denoised block by block, a
uniform-noise canvas re-decided whole at every step); the engine's driver walks the
blocks and hands each to the decoder the adapter chose (`Adapter.decoder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import TokenStats, block_ranges

# (x0, prob, entropy, logprobs) of processed logits in few, fast passes over the vocabulary
from mlx_lm_diffusion.decoding.decoders.vocab_stats import greedy_stats  # noqa: F401

# In a canvas seed (`Canvas(seed=...)`), a free position: the decoder fills it.
FREE = -1


class Canvas:
    """A decode's canvas (B, P + N): the tokens on the device, their latest host copy,
    and each row's progress (`done`, `final`), kept per row so that rows can differ.

    `seed` (B, W), optional: the tokens after the prompt, FREE where the decoder fills in
    and a token id where the position is pinned (an infill suffix, a seeded canvas);
    pinned tokens never change. W may exceed `generated`: the positions past it (a
    suffix) are context only, no block covers them. `pinned` is None without a seed."""

    def __init__(self, prompt: mx.array, generated: int, fill: int, seed: Optional[np.ndarray] = None):
        B, P = prompt.shape
        width = generated if seed is None else max(generated, seed.shape[1])
        tail = np.full((B, width), fill, dtype=np.int32)
        self.pinned: Optional[mx.array] = None  # (B, P + width) positions whose tokens never change
        if seed is not None:
            pinned = np.zeros((B, P + width), dtype=bool)
            pinned[:, P : P + seed.shape[1]] = seed != FREE
            tail[:, : seed.shape[1]] = np.where(seed != FREE, seed, tail[:, : seed.shape[1]])
            self.pinned = mx.array(pinned)
        self.tokens = mx.concatenate([prompt.astype(mx.int32), mx.array(tail)], axis=1)
        self.host = np.array(self.tokens)  # the host copy of the latest tokens read back
        self.synced = self.tokens  # ... which is this array
        self.prompt_len = P
        self.generated = generated  # positions after the prompt that blocks cover
        self.done = np.zeros(B, dtype=bool)  # rows that finished (EOS in their final prefix, or full)
        self.final = np.zeros(B, dtype=np.int64)  # per row: generated tokens that are final
        self.forwards = 0

    @property
    def rows(self) -> int:
        return self.host.shape[0]

    def sync(self) -> np.ndarray:
        """Read the latest tokens back to the host (waits for the steps queued so far)."""
        if self.synced is not self.tokens:
            self.host, self.synced = np.array(self.tokens), self.tokens
        return self.host

    def host_of(self, tokens: mx.array) -> np.ndarray:
        """The host copy of `tokens`, an array this canvas held (the latest or an earlier one)."""
        if tokens is self.tokens:
            return self.sync()
        return self.host if tokens is self.synced else np.array(tokens)

    def write(self, block: mx.array, start: int) -> None:
        """Put `block` at [start, start + width) (a new array: a queued step may still hold the old one)."""
        self.tokens = mx.slice_update(self.tokens, block, mx.array([0, start]), axes=(0, 1))

    def open_rows(self, start: int, end: int, mask_id: int) -> np.ndarray:
        """Masked positions of [start, end) in rows still decoding, from the host copy."""
        return (self.host[:, start:end] == mask_id) & ~self.done[:, None]

    def live_rows(self) -> mx.array:
        return mx.array(~self.done)[:, None]

    def unpinned(self, start: int, end: int) -> Optional[mx.array]:
        """(B, end - start) positions of [start, end) a decoder may change; None: all."""
        return None if self.pinned is None else ~self.pinned[:, start:end]


@dataclass
class BlockState:
    """One block's decoding state, passed explicitly through a decoder's steps."""

    start: int
    end: int
    confidence: mx.array  # (B, end - start) each token's confidence at commit
    kept: Any = None  # each token's log-probs at commit (kept_logprobs.KeptLogprobs), or None
    masked: Optional[np.ndarray] = None  # (B,) host count of masks per row still decoding
    first_open: Optional[np.ndarray] = None  # (B, end - start) the masks at the block's first step
    rule_state: Any = None  # the commit rule's state for this block (CommitRule.start_block)
    step: int = 0
    post_steps: int = 0  # editing passes once the block had no masks


@dataclass
class Queued:
    """A step whose arrays may still be computing (a Step's fields, tokens on device)."""

    tokens: mx.array
    kept: Any  # a KeptLogprobs, a (B, width, V) array (uniform canvases, self-speculation) or None
    confidence: mx.array
    forwards: int
    block: tuple[int, int]
    step: int
    block_over: bool
    ran_forward: bool
    edits: Any = None  # a step's structural edits (BlockEdits), from a decoder that makes them
    # (B, width) the block positions whose drawn token the step accepted (a uniform canvas:
    # kept, not noised again), from a decoder that accepts some; None otherwise
    accepted: Any = None


@dataclass
class BlockEdits:
    """What a step's DELETE / SPLIT edits did to its block: `deleted` (B, W) the
    positions dropped, in the block before the scan; `inserted` (B, W) the masks SPLIT put
    in, in the block after it. For drafts (draft_callback, the studio), never for text."""

    deleted: np.ndarray
    inserted: np.ndarray


@dataclass
class Forward:
    """A decoder's request for the logits (B, end - start, V) of positions [start, end) of
    `canvas` (`Adapter.predict`'s arguments). Decoders yield it and receive the logits
    back (generator `send`), so that a driver can answer the requests of many decodes
    with one batched forward (mlx_lm_diffusion.decoding.batch) or one decode's at once (Engine)."""

    state: Any
    canvas: mx.array
    start: int
    end: int
    # (B, K) block positions (start-relative) whose logits the step reads: the reply is then
    # (B, K, V), `Adapter.predict_rows`; None: every position, `Adapter.predict`.
    rows: Optional[mx.array] = None
    # False: a diffusion forward (Adapter.predict / predict_rows). True: a Verify.
    verify: ClassVar[bool] = False


@dataclass
class Verify(Forward):
    """Self-speculation's verify pass: the causal logits (B, end - start, V) of
    canvas[:, start:end], the positions right after the state's kept keys and values, which
    the state then keeps too (`Adapter.verify`). A Forward, so that every driver passes it on as
    one: a running batch answers its rows' verify passes with one call (`predict_batch`)."""

    verify: ClassVar[bool] = True
    # the window's leading rows that are ordinary causal rows (the pending token and the drafts);
    # the rows after them are masks, which a family may let see the whole window (Trida2.0's
    # self-speculation); None: every row
    clean: Optional[int] = None


@dataclass
class ReadBack:
    """A decoder is about to read `arrays` back to the host. A driver of many decodes
    evaluates every row's together (one wait instead of one per row); one decode's
    driver just resumes (send None)."""

    arrays: tuple


def aligned_canvas_length(adapter: Any, options: Any, prompt_len: int) -> int:
    """The positions a masked canvas covers after the prompt: max_tokens, or, where blocks
    sit on absolute positions, up to the end of the last block (block-diffusion references
    decode whole blocks), within the model's context."""
    if not adapter.align_blocks:
        return options.max_tokens
    whole = -(-(prompt_len + options.max_tokens) // options.block_length) * options.block_length
    return max(options.max_tokens, min(whole, adapter.max_length or whole) - prompt_len)


def queue(canvas: Canvas, block: BlockState, kept: Any, block_over: bool, ran_forward: bool = True) -> Queued:
    return Queued(
        canvas.tokens,
        kept,
        block.confidence,
        canvas.forwards,
        (block.start, block.end),
        block.step,
        block_over,
        ran_forward,
    )


def normalized_stats(logprobs: mx.array) -> TokenStats:
    """mlx-arsenal's `token_stats` (argmax proposal, its probability and the entropy of
    the temperature-1 softmax) for log-probabilities that are already normalized:
    token_stats would normalize them again, a second exp pass over the vocabulary per
    position, which on CPU is the largest cost of a step at real vocabulary sizes.
    mlx-arsenal would absorb this with a `normalized=True` option."""
    x0, prob = greedy_proposal(logprobs)
    return TokenStats(x0, prob, normalized_entropy(logprobs))


def greedy_proposal(logprobs: mx.array) -> tuple[mx.array, mx.array]:
    x0 = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    return x0, mx.exp(mx.max(logprobs, axis=-1))  # (the probability at the argmax)


def normalized_entropy(logprobs: mx.array) -> mx.array:
    """Entropy of the temperature-1 softmax, built only where a rule reads it."""
    p = mx.exp(logprobs)
    return -mx.sum(mx.where(p > 0, p * logprobs, 0.0), axis=-1)


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Decoder:
    """One decoding paradigm. The driver calls `canvas_length` and `fill` to build the
    canvas, then `decode_block` for each block, which yields one `Queued` per step."""

    name: ClassVar[str]
    # Blocks keep their size past max_tokens: the canvas is decoded whole and cut.
    whole_canvases: ClassVar[bool] = False
    # Options a checkpoint's generation_config.json may set that this decoder has no use
    # for: dropped from the checkpoint's defaults (a caller who names one is refused).
    unread_defaults: ClassVar[frozenset] = frozenset()

    def __init__(self, adapter: Any, options: Any, keep_logprobs: bool = True):
        self.adapter, self.options, self.keep_logprobs = adapter, options, keep_logprobs
        # Queue each step's arrays as soon as they are built (one decode); a batch of
        # decodes evaluates all rows' at once instead (mlx_lm_diffusion.decoding.batch).
        self.queue_eagerly = True
        # Ask for the logits of the positions a step reads only (Forward.rows): set by a
        # driver that answers such requests (Engine.run); a batch driver leaves it off.
        self.gather_rows = False
        # A running batch commits plain steps of all its rows at once (mlx_lm_diffusion.decoding.decoders.fused_commit).
        self.fuse_commits = False

    @classmethod
    def check_options(cls, values: dict, adapter: Any) -> None:
        """Refuse options that mean nothing to this paradigm (ValueError)."""

    @classmethod
    def fit_length(cls, max_tokens: int, block_length: int, room: int) -> int:
        """The largest max_tokens <= `max_tokens` whose decode fits `room` positions."""
        return min(max_tokens, room)

    def canvas_length(self, prompt_len: int) -> int:
        return self.options.max_tokens

    def blocks(self, prompt_len: int) -> list:
        """The (start, end) of each block the driver walks, in canvas positions."""
        N = self.canvas_length(prompt_len)
        return list(block_ranges(prompt_len, N, self.options.block_length, align=self.adapter.align_blocks))

    def forward_bound(self, prompt_len: int) -> int:
        """The most model forwards a decode can take (its rows may stop sooner): what a
        server checks against its limit before anything runs."""
        return sum(self.block_step_bound(end - start) for start, end in self.blocks(prompt_len))

    def block_step_bound(self, width: int) -> int:
        """The most steps (forwards) one block of `width` positions can take."""
        raise NotImplementedError

    @property
    def fill(self) -> int:
        """The token a fresh canvas holds after the prompt."""
        raise NotImplementedError

    def may_run_ahead(self) -> bool:
        """Whether a step may be queued before the previous one is read back (the
        control flow then reads no step's tokens but through the host mask counts)."""
        return False

    def changing(self) -> bool:
        """Whether tokens of the current block can change until the block is over."""
        return False

    def draft(self, host: np.ndarray, end: int) -> np.ndarray:
        """The canvas a Step shows."""
        return host

    def drafted(self) -> Optional[tuple]:
        """The positions [start, end) of the shown canvas that hold drafts (a speculative
        decoder's guesses, not committed tokens), or None."""
        return None

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator[Queued]:
        raise NotImplementedError

    def sample(self, logprobs: mx.array) -> mx.array:
        """(B, L) tokens drawn by the caller's sampler from (B, L, V) log-probs. The ids are
        checked before anything embeds them (an id past the vocabulary would be read out of
        bounds): a sampler that returns one, or a suppressed id, is a ValueError."""
        B, L, V = logprobs.shape
        x0 = self.options.sampler(logprobs.reshape(B * L, V)).reshape(B, L).astype(mx.int32)
        bad = (x0 < 0) | (x0 >= V)
        for token in self.adapter.suppress_ids:
            bad = bad | (x0 == token)
        if mx.any(bad).item():
            ids = sorted(set(np.array(x0)[np.array(bad)].tolist()))[:5]
            raise ValueError(
                f"the sampler returned token ids outside the vocabulary [0, {V}) or a suppressed "
                f"id ({sorted(self.adapter.suppress_ids)}): {ids}"
            )
        return x0

    def process(self, logits: mx.array) -> mx.array:
        """Logits in float32 with the request's allowed-token set applied (`allowed_tokens`:
        every other id gets -inf). mlx-lm logits processors are not applied here: they
        track a left-to-right state, so a decoder feeds them one committed position at a
        time (mlx_lm_diffusion.decoding.decoders.constraints.LeftToRight)."""
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        if self.allowed_bias is not None:
            logits = logits + self.allowed_bias
        return logits

    @property
    def allowed_bias(self) -> Optional[mx.array]:
        """(V,) 0 at the allowed ids, -inf elsewhere; None: every id is allowed."""
        if not hasattr(self, "_allowed_bias"):
            self._allowed_bias = allowed_bias(self.options.allowed_tokens, self.adapter)
        return self._allowed_bias


def allowed_bias(allowed: Optional[Sequence[int]], adapter: Any) -> Optional[mx.array]:
    """(V,) 0 at the allowed ids and the EOS ids, -inf elsewhere (the mask id included);
    None when `allowed` is None. Raises ValueError for ids outside the vocabulary or the
    mask token."""
    if allowed is None:
        return None
    V = adapter.vocab_size
    ids = sorted({int(t) for t in allowed})
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"allowed_tokens holds ids outside the vocabulary [0, {V}): {bad[:5]}")
    if adapter.mask_id is not None and adapter.mask_id in ids:
        raise ValueError(f"allowed_tokens holds the mask token (id {adapter.mask_id}); it is never generated")
    keep = set(ids) | {t for t in adapter.eos_ids if 0 <= t < V}
    bias = np.full((V,), -np.inf, dtype=np.float32)
    bias[sorted(keep)] = 0.0
    return mx.array(bias)
