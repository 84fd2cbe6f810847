"""The demo task: addition of two numbers of 1 to 4 digits, "357+468=" -> "825".

Operands: per operand a digit count drawn uniformly from MIN_DIGITS..MAX_DIGITS (1-4),
then a number of that many digits (0-9 for one digit, no leading zeros otherwise), so
sums run from 0 to 19998 (1 to 5 digits). The answer is written in ANSWER_WIDTH (5)
slots, right-aligned, BLANK (text: nothing) before its first digit, so each place value
has a fixed slot (`vocab.encode_answer`; the text read is the plain number), followed by
EOS, and the rest of the canvas is EOS padding: LLaDA's SFT practice, so that the model
fills the tail of any canvas with EOS and a decode of any length stops after the answer.
(Written left-aligned, as typed, the units digit sat at a position that moves with the
answer's length, and a model of this size left it at chance: see RECIPE.md.)

Training canvases have varied lengths (`CANVAS_LENGTHS`: prompt + generated positions,
from 16 up to the model's context, most of them short); the rows of one batch share a
canvas length and mix prompt lengths, so the generated region is canvas - prompt.

Held-out split: an unordered pair {a, b} is held out when a fixed integer hash of
(min(a, b), max(a, b)) falls in the lowest 1/16 of its range (`is_held_out`). Training
rejects every held-out pair in either order, so no held-out problem, nor its mirror
b+a, is ever a training example; `held_out_problems` draws only held-out pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_lm_diffusion.demo.vocab import ANSWER_WIDTH, EOS_ID, encode, encode_answer

MIN_DIGITS, MAX_DIGITS = 1, 4  # operand digit counts are drawn from this range
ANSWER_MAX = 2 * (10**MAX_DIGITS - 1)  # 19998: at most 5 digits
PROMPT_MAX = 2 * MAX_DIGITS + 2  # "9999+9999=", and every prompt as the tokenizer pads it: 10 tokens
GEN_LENGTH = 8  # a small canvas that holds every answer (5 slots) and its EOS
# The model's context (max_sequence_length): a prompt and up to 118 tokens. The first
# training run's canvases run to 256, but past ~128 its answers degrade (89.5 % held-out
# at 246 generated tokens against 98.2 % at 118, RECIPE.md), so the context says 128 and
# the second run trains up to it.
CONTEXT = 128
MIN_CANVAS = PROMPT_MAX + ANSWER_WIDTH + 1  # prompt, answer slots, EOS: 16
# Canvas lengths (prompt + generated) of the training batches, and how often each is drawn:
# mostly short canvases (cheap, where the digits are learned), some long ones (where the
# model learns that every position after the answer is EOS, whatever its distance).
CANVAS_LENGTHS = (16, 18, 24, 32, 48, 64, 128, 256)
TRAIN_MAX_CANVAS = max(CANVAS_LENGTHS)
CANVAS_WEIGHTS = (10, 4, 3, 2, 1.5, 1.5, 1, 1)
HELD_OUT_BITS = 4  # 1 pair in 2**4 is held out
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def is_held_out(a, b) -> np.ndarray:
    """True where the unordered pair {a, b} belongs to the held-out set (vectorized)."""
    a = np.asarray(a, dtype=np.uint64)
    b = np.asarray(b, dtype=np.uint64)
    key = np.minimum(a, b) * np.uint64(10**MAX_DIGITS) + np.maximum(a, b) + np.uint64(1)
    with np.errstate(over="ignore"):
        h = key * _GOLDEN  # Fibonacci hashing: multiplication modulo 2**64
    return (h >> np.uint64(64 - HELD_OUT_BITS)) == 0


def _operands(rng: np.random.Generator, n: int, digits: np.ndarray) -> np.ndarray:
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    return rng.integers(low, 10**digits)


@dataclass
class Batch:
    """Problems of one prompt length: prompts (B, P) and targets (B, gen_length)."""

    a: np.ndarray
    b: np.ndarray
    prompts: np.ndarray
    targets: np.ndarray


@dataclass
class CanvasBatch:
    """Training rows of one canvas length T with mixed prompt lengths.

    tokens (B, T): prompt, answer slots, EOS, EOS padding; prompt_len (B,): where each
    row's generated region starts; answer_len (B,): answer slots + the first EOS."""

    a: np.ndarray
    b: np.ndarray
    tokens: np.ndarray
    prompt_len: np.ndarray
    answer_len: np.ndarray


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def _batch(a: np.ndarray, b: np.ndarray, gen_length: int) -> Batch:
    prompts = np.array([encode(prompt_text(x, y)) for x, y in zip(a.tolist(), b.tolist())], np.int32)
    targets = np.full((len(a), gen_length), EOS_ID, np.int32)
    for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        ans = encode_answer(answer_text(x, y))[:gen_length]
        targets[i, : len(ans)] = ans
    return Batch(a, b, prompts, targets)


def sample_pairs(rng: np.random.Generator, n: int, da, db, held_out: bool) -> tuple:
    """`n` pairs with `da` and `db` digits (ints, or arrays of n digit counts), all inside
    (held_out) or outside the held-out set."""
    da = np.broadcast_to(np.asarray(da), (n,))
    db = np.broadcast_to(np.asarray(db), (n,))
    a = _operands(rng, n, da)
    b = _operands(rng, n, db)
    bad = is_held_out(a, b) != held_out
    while bad.any():  # redraw the rejected rows with their own digit counts
        idx = np.flatnonzero(bad)
        a[idx] = _operands(rng, len(idx), da[idx])
        b[idx] = _operands(rng, len(idx), db[idx])
        bad[idx] = is_held_out(a[idx], b[idx]) != held_out
    return a, b


def digit_counts(rng: np.random.Generator, n: int) -> tuple:
    return rng.integers(MIN_DIGITS, MAX_DIGITS + 1, size=(2, n))


def canvas_batch(rng: np.random.Generator, size: int, length: int) -> CanvasBatch:
    """`size` training rows (never a held-out pair) on canvases of `length` positions."""
    if length < MIN_CANVAS:
        raise ValueError(f"canvas length must be >= {MIN_CANVAS}: prompt, {ANSWER_WIDTH} answer slots, EOS")
    da, db = digit_counts(rng, size)
    a, b = sample_pairs(rng, size, da, db, held_out=False)
    tokens = np.full((size, length), EOS_ID, np.int32)
    prompt_len = np.zeros(size, np.int32)
    answer_len = np.zeros(size, np.int32)
    for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        p, ans = encode(prompt_text(x, y)), encode_answer(answer_text(x, y))
        tokens[i, : len(p)] = p
        tokens[i, len(p) : len(p) + len(ans)] = ans
        prompt_len[i], answer_len[i] = len(p), len(ans) + 1
    return CanvasBatch(a, b, tokens, prompt_len, answer_len)


def training_batch(rng: np.random.Generator, size: int, length: int = 2 * GEN_LENGTH) -> CanvasBatch:
    """One training batch of `size` rows (default: the shortest canvas)."""
    return canvas_batch(rng, size, length)


def held_out_problems(n: int, seed: int = 1234) -> list[tuple[int, int]]:
    """`n` distinct held-out pairs (a, b), digit counts drawn as in training, in a seeded order."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < n:
        da, db = (int(d) for d in rng.integers(MIN_DIGITS, MAX_DIGITS + 1, size=2))
        a, b = sample_pairs(rng, 1, da, db, held_out=True)
        pair = (int(a[0]), int(b[0]))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def group_by_prompt_length(pairs: list[tuple[int, int]], gen_length: int = GEN_LENGTH) -> list[Batch]:
    """Batches of equal prompt length (what `generate_batch` needs), in length order."""
    by_len: dict[int, list[tuple[int, int]]] = {}
    for a, b in pairs:
        by_len.setdefault(len(encode(prompt_text(a, b))), []).append((a, b))
    return [
        _batch(np.array([p[0] for p in g]), np.array([p[1] for p in g]), gen_length)
        for _, g in sorted(by_len.items())
    ]
