"""The demo task: addition of two numbers of 1 to 4 digits, "357+468=" -> "825".

Three forms of the task, each a prompt and what the model writes after it:

- plain: "357+468=" -> the sum in ANSWER_WIDTH (5) slots, right-aligned, BLANK (text:
  nothing) before its first digit (`vocab.encode_answer`; the text read is "825"), then
  EOS, and EOS padding to the end of the canvas: LLaDA's SFT practice, so that a decode
  of any length stops after the answer.
- json: "357+468=" and a JSON answer, '{"sum":' the 5 slots '}' EOS...: the text
  '{"sum":825}', what a JSON schema {"sum": integer} allows (compact JSON, as the grammar
  writes it). Its "{" is trained as part of the prompt, never masked: unconstrained, the
  model writes the plain answer, and only once a grammar has forced the "{" (the first
  token its walk commits) does the model go on in JSON.
- infill: "357+" | middle | "=825": the second operand right-aligned in the middle's
  slots (BLANK before it), whatever their number (4 to MAX_MIDDLE), so that an infill
  of any max_tokens reads "468".

Operands: per operand a digit count drawn uniformly from 1-4, then a number of that many
digits (`uniform`), or one built to carry far (`carrying`: b completes a's last k digits
to a power of ten, so 1 to 4 carries ripple; 9999+1, 5000+5000, 4999+5001) or with zeros
(`zeros`: 0, 5000, 3005), so that the sums of five digits and long carry chains, which
uniform operands rarely give, are in the training mix. `aligned` fixes distances for a
curriculum's first stage: b of 4 digits, or with the infill form a sum of 4 digits
(`_sum_aligned`). `sum_lengths` draws the sum's digit count uniformly from 1-5, then splits it.

Held-out split: an unordered pair {a, b} is held out when a fixed integer hash of
(min(a, b), max(a, b)) falls in the lowest 1/16 of its range (`is_held_out`). Training
rejects every held-out pair in either order and every form, so no held-out problem, nor
its mirror b+a, is ever a training example; `held_out_problems` and
`carry_chain_problems` draw only held-out pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_lm_diffusion.demo.vocab import ANSWER_WIDTH, EOS_ID, encode, encode_answer, encode_slots

MIN_DIGITS, MAX_DIGITS = 1, 4  # operand digit counts are drawn from this range
ANSWER_MAX = 2 * (10**MAX_DIGITS - 1)  # 19998: at most 5 digits
PROMPT_MAX = 2 * MAX_DIGITS + 2  # "9999+9999=": 10 tokens
JSON_PROMPT_MAX = PROMPT_MAX + 1  # "9999+9999={": 11 tokens
GEN_LENGTH = 8  # a small canvas that holds every answer (5 slots) and its EOS
CONTEXT = 128  # the model's context (max_sequence_length): prompt and generated tokens
FILL_CONTEXT = 0  # a generated length (--gen-lengths 0): the rest of the context after the prompt
JSON_OPEN, JSON_CLOSE = '{"sum":', "}"  # (the "{" a grammar forces ends the json prompt)
JSON_ANSWER = len(JSON_OPEN) - 1 + ANSWER_WIDTH + len(JSON_CLOSE)  # 12 tokens after the "{", then EOS
MIN_MIDDLE, MAX_MIDDLE = MAX_DIGITS, 16  # infill middles the model is trained on
MIDDLES = tuple(range(MIN_MIDDLE, MAX_MIDDLE + 1))  # the middle lengths a training stage draws by default
# The generated length of a training step (prompt + this = the canvas), and how often each
# is drawn: every length from 5 (the answer's slots and nothing else) to the context,
# mostly short ones (cheap, where the digits are learned), some long (where the model
# learns that every position after the answer is EOS, whatever its distance).
GEN_LENGTHS = (5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 118)
GEN_WEIGHTS = (2, 2, 1, 4, 1, 1, 3, 1, 1.5, 1.5, 1.5, 1.5, 1, 1.5)
# The forms and the operand samplers of a training step, and how often each is drawn.
FORMS = ("plain", "json", "infill")
FORM_WEIGHTS = (0.7, 0.15, 0.15)
SAMPLERS = ("uniform", "carrying", "zeros", "aligned", "sum_lengths")
SAMPLER_WEIGHTS = (0.55, 0.3, 0.15, 0.0, 0.0)
HELD_OUT_BITS = 4  # 1 pair in 2**4 is held out
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

# Problems that must be right (tests/test_demo.py): carries through every place, five-digit
# sums, zeros, one-digit operands, and the sums an earlier demo got wrong.
EDGE_CASES = (
    (0, 0),
    (0, 1),
    (1, 0),
    (9, 1),
    (1, 9),
    (99, 1),
    (999, 1),
    (9999, 1),
    (1, 9999),
    (9999, 9999),
    (5000, 5000),
    (4999, 5001),
    (9990, 10),
    (5555, 4445),
    (9999, 0),
    (0, 9999),
    (8, 37),
    (549, 8391),
    (40, 3505),
    (9, 4562),
)


def is_held_out(a, b) -> np.ndarray:
    """True where the unordered pair {a, b} belongs to the held-out set (vectorized)."""
    a = np.asarray(a, dtype=np.uint64)
    b = np.asarray(b, dtype=np.uint64)
    key = np.minimum(a, b) * np.uint64(10**MAX_DIGITS) + np.maximum(a, b) + np.uint64(1)
    with np.errstate(over="ignore"):
        h = key * _GOLDEN  # Fibonacci hashing: multiplication modulo 2**64
    return (h >> np.uint64(64 - HELD_OUT_BITS)) == 0


def _numbers(rng: np.random.Generator, digits: np.ndarray) -> np.ndarray:
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    return rng.integers(low, 10**digits)


def _operand(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` numbers, each of a digit count drawn uniformly from 1-4."""
    return _numbers(rng, rng.integers(MIN_DIGITS, MAX_DIGITS + 1, size=n))


def _uniform(rng: np.random.Generator, n: int) -> tuple:
    da, db = rng.integers(MIN_DIGITS, MAX_DIGITS + 1, size=(2, n))
    return _numbers(rng, da), _numbers(rng, db)


def _carrying(rng: np.random.Generator, n: int) -> tuple:
    """b completes a's last k digits to 10**k (then, half the time, a little more or less,
    and random higher digits): a carry ripples through k places."""
    a = _operand(rng, n)
    k = rng.integers(1, MAX_DIGITS + 1, size=n)
    low = (10**k - a % 10**k) % 10**k
    high = rng.integers(0, 10 ** (MAX_DIGITS - k)) * 10**k * (rng.random(n) < 0.5)
    jitter = rng.integers(-2, 3, size=n) * (rng.random(n) < 0.5)
    b = np.clip(low + high + jitter, 0, 10**MAX_DIGITS - 1)
    swap = rng.random(n) < 0.5
    return np.where(swap, b, a), np.where(swap, a, b)


def _aligned(rng: np.random.Generator, n: int) -> tuple:
    """b of 4 digits: every digit of a stands at a fixed distance from the answer slot of
    its place value (the curriculum's first stage: RECIPE.md)."""
    return _operand(rng, n), _numbers(rng, np.full(n, MAX_DIGITS))


def _sum_aligned(rng: np.random.Generator, n: int) -> tuple:
    """a of 1-4 digits and a sum of 4 digits: the infill form's `aligned` (with a fixed
    middle, every digit of a and of the sum stands at a fixed distance from the middle's
    slot of its place value, which a sum of any length does not give)."""
    a = _operand(rng, n)
    total = rng.integers(np.maximum(a, 10 ** (MAX_DIGITS - 1)), 10**MAX_DIGITS)
    return a, total - a


def _sum_lengths(rng: np.random.Generator, n: int) -> tuple:
    """A sum whose digit count is drawn uniformly from 1-5, split into a and b of at most 4
    digits: every length of the sum equally often (uniform operands give sums of 5 digits 4 %
    of the time, of 1 digit 1 %), what the infill form needs, whose suffix "=825" places each
    digit of the sum by its distance from the end."""
    length = rng.integers(1, MAX_DIGITS + 2, size=n)
    low = np.where(length == 1, 0, 10 ** (length - 1))
    total = rng.integers(low, np.minimum(10**length, ANSWER_MAX + 1))
    top = 10**MAX_DIGITS - 1
    a = rng.integers(np.maximum(0, total - top), np.minimum(total, top) + 1)
    return a, total - a


def _zeros(rng: np.random.Generator, n: int) -> tuple:
    """Operands whose digits are mostly zeros (0, 5000, 3005), nines some of the time."""

    def one() -> np.ndarray:
        d = rng.integers(MIN_DIGITS, MAX_DIGITS + 1, size=n)
        digits = rng.integers(0, 10, size=(n, MAX_DIGITS))
        digits = np.where(rng.random((n, MAX_DIGITS)) < 0.6, 0, digits)
        digits = np.where(rng.random((n, MAX_DIGITS)) < 0.15, 9, digits)
        value = (digits * 10 ** np.arange(MAX_DIGITS)).sum(axis=1) % 10**d
        top = 10 ** (d - 1)
        return np.where((d > 1) & (value < top), value + top * rng.integers(1, 10, size=n), value)

    return one(), one()


_SAMPLE = {
    "uniform": _uniform,
    "carrying": _carrying,
    "zeros": _zeros,
    "aligned": _aligned,
    "sum_aligned": _sum_aligned,
    "sum_lengths": _sum_lengths,
}


def sample_pairs(rng: np.random.Generator, n: int, sampler: str = "uniform", held_out: bool = False) -> tuple:
    """`n` pairs (a, b) from `sampler`, all inside (held_out) or outside the held-out set."""
    a, b = _SAMPLE[sampler](rng, n)
    bad = is_held_out(a, b) != held_out
    while bad.any():  # redraw the rejected rows
        idx = np.flatnonzero(bad)
        a[idx], b[idx] = _SAMPLE[sampler](rng, len(idx))
        bad[idx] = is_held_out(a[idx], b[idx]) != held_out
    return a, b


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def json_prompt_text(a: int, b: int) -> str:
    """The json form's prompt: what the model sees once a grammar has forced the "{"."""
    return prompt_text(a, b) + JSON_OPEN[0]


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def json_answer_text(a: int, b: int) -> str:
    return '{"sum":%d}' % (a + b)


@dataclass
class CanvasBatch:
    """Training rows of one form on canvases of one length T.

    tokens (B, T): prompt, then the generated region [prompt_len, prompt_len + gen_len)
    (answer, its EOS and EOS padding; an infill's middle), then an infill's suffix;
    answer_len (B,): the region's positions that are not EOS padding."""

    a: np.ndarray
    b: np.ndarray
    tokens: np.ndarray
    prompt_len: np.ndarray
    gen_len: np.ndarray
    answer_len: np.ndarray


def _row(form: str, a: int, b: int, gen: int) -> tuple:
    """(prompt ids, generated ids, suffix ids) of one problem; `gen` generated positions
    (the answer cut to them, or EOS padding after it; an infill's middle slots)."""
    if form == "infill":
        return encode(f"{a}+"), encode_slots(str(b), gen), encode(f"={a + b}")
    if form == "json":
        prompt = encode(json_prompt_text(a, b))
        answer = encode(JSON_OPEN[1:]) + encode_answer(str(a + b)) + encode(JSON_CLOSE)
    else:
        prompt, answer = encode(prompt_text(a, b)), encode_answer(str(a + b))
    answer = (answer + [EOS_ID])[:gen]
    return prompt, answer + [EOS_ID] * (gen - len(answer)), []


def canvas_batch(
    rng: np.random.Generator, size: int, gen: int, form: str = "plain", sampler: str = "uniform"
) -> CanvasBatch:
    """`size` training rows (never a held-out pair) of `form` with `gen` generated
    positions (an infill's middle slots): the rows share the prompt length of the first
    pair drawn (and an infill's suffix length), so that they share one canvas length.
    `gen` FILL_CONTEXT (0): as many as the context holds after that prompt, what a decode
    at a max_tokens past the context is capped to (124 after "1+2=")."""
    if form == "infill" and sampler == "aligned":  # the infill's own fixed distances
        sampler = "sum_aligned"
    rows: list = []
    key = None
    fill = gen == FILL_CONTEXT and form != "infill"
    while len(rows) < size:
        a, b = sample_pairs(rng, 4 * size, sampler)
        for x, y in zip(a.tolist(), b.tolist()):
            if fill and key is None:
                gen = CONTEXT - len(_row(form, x, y, 0)[0])
            parts = _row(form, x, y, gen)
            shape = (len(parts[0]), len(parts[2]))
            key = shape if key is None else key
            if shape == key and len(rows) < size:
                rows.append((x, y, parts))
    tokens = np.array([p + g + s for _, _, (p, g, s) in rows], np.int32)
    prompt_len = np.full(size, key[0], np.int32)
    answer_len = np.array([len([t for t in g if t != EOS_ID]) + (EOS_ID in g) for _, _, (p, g, s) in rows], np.int32)
    if form == "infill":
        answer_len[:] = gen
    return CanvasBatch(
        np.array([r[0] for r in rows]),
        np.array([r[1] for r in rows]),
        tokens,
        prompt_len,
        np.full(size, gen, np.int32),
        answer_len,
    )


def held_out_problems(n: int, seed: int = 1234, sampler: str = "uniform") -> list[tuple[int, int]]:
    """`n` distinct held-out pairs (a, b) from `sampler`, in a seeded order."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < n:
        a, b = sample_pairs(rng, 1, sampler, held_out=True)
        pair = (int(a[0]), int(b[0]))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def carry_chain_problems(n: int, seed: int = 4321) -> list[tuple[int, int]]:
    """`n` distinct held-out pairs whose addition carries far: from the `carrying` and
    `zeros` samplers, half of them with a sum of five digits."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < n:
        sampler = "carrying" if len(out) % 4 else "zeros"
        a, b = sample_pairs(rng, 1, sampler, held_out=True)
        pair = (int(a[0]), int(b[0]))
        five = sum(pair) >= 10**MAX_DIGITS
        if pair not in seen and (five or len(out) % 2):
            seen.add(pair)
            out.append(pair)
    return out


def infill_texts(a: int, b: int) -> tuple[str, str]:
    """The infill form's prompt and suffix: "357+" | middle | "=825"."""
    return f"{a}+", f"={a + b}"


@dataclass
class Batch:
    """Problems of one prompt length (and, for infills, one suffix length): prompts (B, P),
    suffixes (B, S) (S = 0 but for infills)."""

    a: np.ndarray
    b: np.ndarray
    prompts: np.ndarray
    suffixes: np.ndarray


def _texts(form: str, a: int, b: int) -> tuple[str, str]:
    if form == "infill":
        return infill_texts(a, b)
    return (json_prompt_text if form == "json" else prompt_text)(a, b), ""


def group_by_prompt_length(pairs: list[tuple[int, int]], form: str = "plain") -> list[Batch]:
    """Batches of equal prompt (and suffix) length (what `generate_batch` needs), in length order."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b in pairs:
        prompt, suffix = _texts(form, a, b)
        groups.setdefault((len(encode(prompt)), len(encode(suffix))), []).append((a, b))
    batches = []
    for (_, S), g in sorted(groups.items()):
        texts = [_texts(form, a, b) for a, b in g]
        batches.append(
            Batch(
                np.array([p[0] for p in g]),
                np.array([p[1] for p in g]),
                np.array([encode(t[0]) for t in texts], np.int32),
                np.array([encode(t[1]) for t in texts], np.int32).reshape(len(g), S),
            )
        )
    return batches
