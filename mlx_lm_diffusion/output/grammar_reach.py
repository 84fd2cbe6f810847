"""Whether a grammar can still be completed with a vocabulary that cannot spell every byte.

llguidance computes its token masks as if the tokenizer could spell any text (byte-level
vocabularies can). A character vocabulary cannot: the demo model has no 'a', so a schema
with a key "answer" forces text no token sequence spells, and llguidance's mask there
allows tokens it then refuses ("token 20 breaks the grammar"), or none. `Reach` searches
the token sequences the matcher accepts, depth first (closing tokens first: a JSON value
ends soonest through '"', '}' and ']'), with a bound on the nodes it visits, for one that
ends in an accepting state: before a decode (a grammar nothing completes is refused) and at
each constrained position (a token from which nothing completes is masked out). A search that
runs out of nodes counts as reachable: the masks are then llguidance's own. A search cannot
prove a dead end that lies behind free content (a number before a required key the
vocabulary cannot spell: every digit is a new state), so a JSON schema is first read for the
text it requires (`json_spellable`).
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import numpy as np

SEARCH_NODES = 400  # matcher states one question may visit
SEARCH_DEPTH = 64  # tokens one path may take
CLOSERS = ('"', "}", "]")


class Reach:
    """Reachability of an accepting state for one matcher over `tokens` (id -> text, None:
    never generated: special, unused, textless)."""

    def __init__(self, tokens: Sequence[Optional[str]], vocab_size: int):
        self.vocab_size = vocab_size
        texts = [(i, t) for i, t in enumerate(tokens[:vocab_size]) if t]
        # the order a search tries tokens in: closers, then the shortest texts (digits, letters)
        rank = {i: (0 if t in CLOSERS else 1, len(t), i) for i, t in texts}
        self.order = np.array(sorted(rank, key=rank.get), dtype=np.int64)
        self.usable = np.zeros(vocab_size, dtype=bool)
        self.usable[[i for i, _ in texts]] = True
        self.characters = {c for _, t in texts for c in t}  # what the vocabulary can write

    def allowed(self, matcher: Any) -> np.ndarray:
        """(V,) the tokens llguidance allows next that have text."""
        mask = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[: self.vocab_size] > 0
        return mask & self.usable[: mask.shape[0]]

    def completes(self, matcher: Any) -> bool:
        """Whether some token sequence from the matcher's state ends accepted (or the
        search ran out of nodes)."""
        return _Search(self, matcher).run() is not False

    def viable(self, matcher: Any, allowed: np.ndarray) -> np.ndarray:
        """`allowed` (V,) less the tokens after which nothing completes."""
        out = allowed.copy()
        search = _Search(self, matcher)
        for token in np.flatnonzero(allowed & self.usable[: allowed.shape[0]]):
            search.budget = SEARCH_NODES
            if search.after(int(token), 0) is False:
                out[token] = False
        return out


class _Search:
    """One depth-first search from a matcher's state (rolled back to it after each path)."""

    def __init__(self, reach: Reach, matcher: Any):
        self.reach, self.matcher = reach, matcher
        self.budget = SEARCH_NODES

    def run(self) -> Optional[bool]:
        return self.search(0)

    def after(self, token: int, depth: int) -> Optional[bool]:
        m = self.matcher
        if m.validate_tokens([token]) != 1 or not m.consume_token(token):
            return False
        try:
            return self.search(depth + 1)
        finally:
            m.rollback(1)

    def search(self, depth: int) -> Optional[bool]:
        """True: reachable; False: every path dies; None: the budget or depth ran out."""
        m = self.matcher
        if m.is_accepting():
            return True
        if self.budget <= 0 or depth >= SEARCH_DEPTH:
            return None
        self.budget -= 1
        allowed = self.reach.allowed(m)
        unknown = False
        for token in self.reach.order[allowed[self.reach.order]]:
            found = self.after(int(token), depth)
            if found:
                return True
            unknown = unknown or found is None
        return None if unknown else False


# The characters each JSON type's shortest value needs (a number: any one digit).
TYPE_TEXT = {"string": '""', "boolean": None, "null": "null", "array": "[]", "object": "{}"}


def json_spellable(schema: Any, chars: set) -> bool:
    """Whether some JSON value valid against `schema` can be written with `chars` (False only
    where it surely cannot: a required key, a constant or every enum value has a character
    outside them, or every type it allows does; what is not read here counts as spellable:
    patterns, formats, $ref)."""
    if not isinstance(schema, dict):
        return True
    ok = lambda text: set(text) <= chars  # noqa: E731
    if "const" in schema:
        return ok(json.dumps(schema["const"], separators=(",", ":")))
    if "enum" in schema and isinstance(schema["enum"], list):
        return any(ok(json.dumps(v, separators=(",", ":"))) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and not any(json_spellable(s, chars) for s in schema[key]):
            return False
    if isinstance(schema.get("allOf"), list) and not all(json_spellable(s, chars) for s in schema["allOf"]):
        return False
    types = schema.get("type")
    if types is None:
        return True
    types = [types] if isinstance(types, str) else list(types)
    return any(_type_spellable(t, schema, chars) for t in types)


def _type_spellable(kind: str, schema: dict, chars: set) -> bool:
    if kind in ("integer", "number"):
        return bool(chars & set("0123456789"))
    if kind == "boolean":
        return set("true") <= chars or set("false") <= chars
    if kind not in TYPE_TEXT or not set(TYPE_TEXT[kind]) <= chars:
        return False
    if kind == "array" and (schema.get("minItems") or 0) > 0:
        return "," in chars and json_spellable(schema.get("items", {}), chars)
    if kind == "object":
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in schema.get("required") or ():
            if not set(json.dumps(str(key)) + ":,") <= chars or not json_spellable(properties.get(key, {}), chars):
                return False
    return True


__all__ = ["Reach", "json_spellable"]
