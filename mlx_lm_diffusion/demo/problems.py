"""The demo task: addition of two 3-digit numbers, "357+468=" -> "825" (3 or 4 digits).

Operands are drawn uniformly from 100-999 (the digit-count draw below is kept general,
MIN_DIGITS..MAX_DIGITS, but the shipped model was trained with 3 and 3). The answer is
written as usual, most significant digit first, then EOS up to GEN_LENGTH positions:
LLaDA's SFT practice, so the model learns to fill the tail of the canvas with EOS.

Held-out split: an unordered pair {a, b} is held out when a fixed integer hash of
(min(a, b), max(a, b)) falls in the lowest 1/16 of its range (`is_held_out`). Training
rejects every held-out pair in either order, so no held-out problem, nor its mirror
b+a, is ever a training example; `held_out_problems` draws only held-out pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .vocab import EOS_ID, encode

MIN_DIGITS, MAX_DIGITS = 3, 3  # operand digit counts are drawn from this range
ANSWER_MAX = 2 * (10**MAX_DIGITS - 1)  # 1998: at most 4 digits
GEN_LENGTH = 5  # generated positions: the answer, then EOS up to this length
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
    """Problems of one prompt length: prompts (B, P) and targets (B, GEN_LENGTH)."""

    a: np.ndarray
    b: np.ndarray
    prompts: np.ndarray
    targets: np.ndarray


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def _batch(a: np.ndarray, b: np.ndarray, gen_length: int) -> Batch:
    prompts = np.array([encode(prompt_text(x, y)) for x, y in zip(a.tolist(), b.tolist())], np.int32)
    targets = np.full((len(a), gen_length), EOS_ID, np.int32)
    for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        ans = encode(answer_text(x, y))
        targets[i, : len(ans)] = ans
    return Batch(a, b, prompts, targets)


def sample_pairs(rng: np.random.Generator, n: int, da: int, db: int, held_out: bool) -> tuple:
    """`n` pairs with `da` and `db` digits, all inside (held_out) or outside the held-out set."""
    got_a, got_b, have = [], [], 0
    while have < n:
        m = 2 * (n - have) + 16
        a = _operands(rng, m, np.full(m, da))
        b = _operands(rng, m, np.full(m, db))
        keep = is_held_out(a, b) == held_out
        got_a.append(a[keep])
        got_b.append(b[keep])
        have += int(keep.sum())
    return np.concatenate(got_a)[:n], np.concatenate(got_b)[:n]


def training_batch(rng: np.random.Generator, size: int, gen_length: int = GEN_LENGTH) -> Batch:
    """One training batch: a digit-count pair drawn uniformly, then `size` training pairs."""
    da, db = (int(d) for d in rng.integers(MIN_DIGITS, MAX_DIGITS + 1, size=2))
    a, b = sample_pairs(rng, size, da, db, held_out=False)
    return _batch(a, b, gen_length)


def held_out_problems(n: int, seed: int = 1234) -> list[tuple[int, int]]:
    """`n` distinct held-out pairs (a, b), digit counts as in training, in a seeded order."""
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
        by_len.setdefault(len(prompt_text(a, b)), []).append((a, b))
    return [
        _batch(np.array([p[0] for p in g]), np.array([p[1] for p in g]), gen_length)
        for _, g in sorted(by_len.items())
    ]
