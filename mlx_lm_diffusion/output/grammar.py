"""Grammar-constrained output (JSON schema, any JSON object) through llguidance.

llguidance (guidance-ai/llguidance, the optional extra `constraints`) compiles a JSON
schema into a token-level matcher over a Hugging Face tokenizer and gives, for each
next position, the mask of the tokens the grammar allows. `GrammarProcessor` wraps a
matcher as an mlx-lm logits processor: it consumes the tokens it is fed one at a time,
in order, and masks the next position's logits. The engine feeds processors exactly
that way (mlx_lm_diffusion.decoding.decoders.constraints.LeftToRight), so a diffusion decode commits
several grammar-valid tokens per forward while the output always matches the grammar.
The mask is computed on the host (numpy): llguidance's MLX helper is a Metal kernel.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.output.grammar_reach import Reach, json_spellable

INSTALL_HINT = 'the constraints extra: pip install -e ".[constraints]" in a clone of mlx-lm-diffusion (llguidance)'
# Compact JSON: one way to write each value, so a constrained decode spends no tokens
# on optional whitespace (a schema's own "x-guidance" settings still apply).
JSON_DEFAULTS = {"whitespace_flexible": False}

UNSPELLABLE = (
    "the model's vocabulary cannot spell output that matches this grammar (text it requires, a key, "
    "a constant or an enum value, has characters no token has)"
)

_tokenizers: dict = {}  # (id(hf tokenizer), vocab size) -> (hf tokenizer, llguidance tokenizer, textless ids, Reach)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:
        raise ValueError(f"grammar-constrained output needs llguidance: {INSTALL_HINT}") from e
    return llguidance


def _ll_tokenizer(tokenizer: Any, vocab_size: int):
    """(llguidance's view of a Hugging Face tokenizer over the model's vocabulary (ids
    past the tokenizer's are never allowed), the ids of tokens without text, a Reach where
    the vocabulary cannot spell every byte, else None); built once per tokenizer (~1 s). A
    tokenizer whose decoder llguidance cannot read (a character vocabulary with a Fuse
    decoder) is described token by token instead, which is also where tokens without text
    and unspellable bytes occur (the demo model's <blank> padding, its dozen characters)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # (mlx-lm's TokenizerWrapper wraps it)
    key = (id(hf), vocab_size)
    if key not in _tokenizers:
        ll = _llguidance()
        try:
            built, textless, reach = ll.hf.from_tokenizer(hf, n_vocab=vocab_size), (), None
        except ValueError:
            table = _TokenTable(hf, vocab_size)
            built, textless = ll.LLTokenizer(ll.TokenizerWrapper(table), n_vocab=vocab_size), table.textless
            reach = None if table.spells_every_byte else Reach(table.texts, vocab_size)
        _tokenizers[key] = (hf, built, textless, reach)  # (keeps hf alive: its id stays unique)
    return _tokenizers[key][1:]


class _TokenTable:
    """A tokenizer as llguidance's generic wrapper reads it: each id's bytes (special
    and unused ids as 0xFF-prefixed names, which text never matches) and an encoder."""

    def __init__(self, hf: Any, vocab_size: int):
        special = set(getattr(hf, "all_special_ids", ()) or ())
        known = len(hf)
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        text = [None if i in special or i >= known else hf.decode([i]).encode("utf-8") for i in range(vocab_size)]
        # tokens whose text is empty: no grammar can tell them apart, so llguidance is shown
        # them as special (never allowed) and GrammarProcessor lets them through itself
        self.textless = tuple(i for i, t in enumerate(text) if t == b"")
        self.special_token_ids = sorted(t for t in special if t < vocab_size) + list(range(known, vocab_size))
        self.special_token_ids = sorted(set(self.special_token_ids) | set(self.textless))
        self.tokens = [b"\xff" + f"<[{i}]>".encode() if not t else t for i, t in enumerate(text)]
        # each id's text where it has some (a Reach reads it), and whether every byte is a token
        self.texts = [None if not t else t.decode("utf-8", "replace") for t in text]
        self.spells_every_byte = len({t for t in text if t and len(t) == 1}) == 256
        self._hf = hf
        self._ids_of: dict = {}  # each text token's bytes -> its (lowest) id
        for i, t in enumerate(self.tokens):
            if not t.startswith(b"\xff"):
                self._ids_of.setdefault(t, i)
        self._longest = max(map(len, self._ids_of), default=1)

    def __call__(self, text: str) -> list:
        """Ids whose bytes spell `text` (llguidance tokenizes the text a grammar forces).
        The tokenizer's own encoding when its tokens spell the text; otherwise (a
        normalizer rewrote it: a zero-padding one encodes "825" as 0 8 2 5) the
        longest tokens of the table that do: out-of-context ids made llguidance force
        tokens the text does not have ("token 0 breaks the grammar")."""
        ids = list(self._hf.encode(text, add_special_tokens=False))
        wanted = text.encode("utf-8")
        if b"".join(self.tokens[i] if 0 <= i < len(self.tokens) else b"\xff" for i in ids) == wanted:
            return ids
        return self._spelled(wanted)

    def _spelled(self, data: bytes) -> list:
        ids, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids_of.get(data[at : at + size])
                if token is not None:
                    ids.append(token)
                    at += size
                    break
            else:  # (no token has this byte: llguidance will refuse the text itself)
                at += 1
        return ids


class GrammarProcessor:
    """An mlx-lm logits processor that constrains generation to a grammar: call it as
    mlx-lm does, with the prompt plus the tokens generated so far (one more each call)
    and the next position's logits (1, V)."""

    def __init__(self, matcher: Any, vocab_size: int, textless: Sequence[int] = (), reach: Optional[Reach] = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        # a vocabulary that cannot spell every byte: tokens after which the grammar cannot be
        # completed are masked out too (grammar_reach)
        self.reach = reach
        # tokens without text (the demo's <blank> padding): they add nothing a grammar reads,
        # so they are not fed to the matcher, and allowed wherever the grammar leaves a
        # choice; where it forces one token, that token comes first (padding there would let
        # a model skip the grammar's lead: the demo, whose plain answer starts with blanks,
        # must begin a JSON object with its '{')
        self.textless = frozenset(textless)
        self.start: Optional[int] = None  # the prompt's length (the first call's tokens)
        self.consumed = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.start is None:
            self.start = len(tokens)
        else:
            fed = len(tokens) - self.start - self.consumed
            if fed != 1:
                raise RuntimeError(f"a grammar processor is fed one token per call, in order; got {fed}")
            token = int(tokens[-1].item())
            if token not in self.textless and not self.matcher.consume_token(
                token
            ):  # (llguidance's report: the first line)
                error = (self.matcher.get_error() or "").strip().splitlines()[:1]
                raise RuntimeError(f"token {token} breaks the grammar: {error[0] if error else 'rejected'}")
            self.consumed += 1
        allowed = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)[: self.vocab_size] > 0
        if self.reach is not None:
            allowed = self.reach.viable(self.matcher, allowed)
        if self.textless and np.count_nonzero(allowed) > 1:
            allowed[list(self.textless)] = True
        if allowed.shape[0] < logits.shape[-1]:
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def can_begin_with(self, ids: Sequence[int]) -> bool:
        """Whether any of `ids` may come first (a token without text always may); asked
        before the first call (the matcher is not advanced)."""
        allowed = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)[: self.vocab_size] > 0
        return self.matcher.is_accepting() or any(
            0 <= int(t) < self.vocab_size and (allowed[int(t)] or int(t) in self.textless) for t in ids
        )


def grammar_processor(tokenizer: Any, vocab_size: int, grammar: str, schema: Any = None) -> GrammarProcessor:
    """A processor for an llguidance grammar (LLMatcher.grammar_from_*); ValueError when
    the grammar does not compile, or the vocabulary cannot begin or complete output it
    accepts (`schema`: the JSON schema it was compiled from, read for the text it requires)."""
    ll = _llguidance()
    built, textless, reach = _ll_tokenizer(tokenizer, vocab_size)
    matcher = ll.LLMatcher(built, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
    _check_can_begin(matcher, tokenizer, vocab_size)
    if reach is not None and not (json_spellable(schema, reach.characters) and reach.completes(matcher)):
        raise ValueError(UNSPELLABLE)
    return GrammarProcessor(matcher, vocab_size, textless, reach)


def _check_can_begin(matcher: Any, tokenizer: Any, vocab_size: int) -> None:
    """ValueError, before anything runs, when no token of the vocabulary can begin text
    the grammar accepts (and it does not accept empty output): every token it allows
    first is special or has no text (the demo model's vocabulary cannot begin a JSON array).
    The decode would otherwise commit one and fail mid-way. Each candidate is checked by
    `validate_tokens` too: where the vocabulary cannot spell text the grammar forces (an
    earlier demo's digits, for '{"sum":'), llguidance's first mask can allow tokens that it
    then refuses."""
    if matcher.is_accepting():
        return
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    special = set(getattr(hf, "all_special_ids", ()) or ())
    allowed = np.flatnonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[:vocab_size] > 0)
    if not any(
        int(t) not in special and hf.decode([int(t)]) and matcher.validate_tokens([int(t)]) == 1 for t in allowed
    ):
        raise ValueError(
            "the model's vocabulary cannot begin output that matches this grammar (no token it "
            "allows first has text of its own)"
        )


def json_schema_processor(tokenizer: Any, vocab_size: int, schema: Any) -> GrammarProcessor:
    """Output that is JSON valid against `schema` (a dict or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except ValueError as e:
        raise ValueError(f"the JSON schema cannot be compiled: {e}") from e
    return grammar_processor(tokenizer, vocab_size, grammar, schema)


def response_format_processor(tokenizer: Any, vocab_size: int, response_format: Any) -> Optional[GrammarProcessor]:
    """The processor of an OpenAI `response_format`: {"type": "json_schema",
    "json_schema": {"schema": ...}}, {"type": "json_object"} (any JSON object), or
    {"type": "text"} (None: no constraint). ValueError for anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError("response_format must be an object with a type")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_processor(tokenizer, vocab_size, {"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return json_schema_processor(tokenizer, vocab_size, spec["schema"])
    raise ValueError(f"response_format type must be text, json_object or json_schema; got {kind!r}")


__all__ = [
    "GrammarProcessor",
    "grammar_processor",
    "json_schema_processor",
    "response_format_processor",
    "INSTALL_HINT",
]
