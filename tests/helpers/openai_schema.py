"""OpenAI's published response schemas (tests/helpers/openai_schemas.json: a copy of the part of
github.com/openai/openai-openapi's openapi.json the server answers in, commit named in the
file) as jsonschema validators."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import jsonschema

FILE = Path(__file__).with_name("openai_schemas.json")


def _nullable(node):
    """OpenAPI's `nullable: true` as JSON Schema (a null is valid too)."""
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False):
            node = {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


@lru_cache(maxsize=None)
def validator(name: str) -> jsonschema.Draft202012Validator:
    schemas = json.loads(FILE.read_text())["schemas"]
    text = json.dumps(_nullable(copy.deepcopy(schemas))).replace("#/components/schemas/", "#/$defs/")
    defs = json.loads(text)
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": defs})


def check(name: str, body: dict) -> None:
    """Raise jsonschema's ValidationError (the first, most relevant) if `body` breaks `name`."""
    error = jsonschema.exceptions.best_match(validator(name).iter_errors(body))
    if error is not None:
        raise error
