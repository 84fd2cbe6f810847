"""The local JSONL data a fine-tuning run reads, checked before mlx-lm's loaders see it.

mlx-lm's loaders fail deep inside on data a user easily writes (an empty train.jsonl: an
IndexError; one file mixing `text` and `prompt`/`completion` records: KeyError 'text';
malformed JSON reported without the file and at the wrong line) and train characters the
vocabulary lacks silently as <unk>. `read_data` reads each file once: a ValueError naming
the file and the line, or the files' one format and the count of characters the tokenizer
cannot spell (a warning: the run goes on).

The format decides the objective: completions and chat records are supervised
fine-tuning whatever --mask-prompt says (the prompt never masked, the answers padded with
EOS, which teaches a diffusion model to stop); text records train every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

SPLITS = ("train", "valid", "test")
# each format by the keys that name it (mlx_lm.tuner.datasets' create_dataset)
FORMATS = (("chat", ("messages",)), ("completions", ("prompt", "completion")), ("text", ("text",)))


@dataclass
class DataFiles:
    """What the directory holds: its records' one format, and how many characters of its
    text the tokenizer cannot spell (they train as its unknown token)."""

    format: Optional[str]  # "chat", "completions", "text"; None: no local files
    unknown_characters: int = 0

    @property
    def supervised(self) -> bool:
        return self.format in ("chat", "completions")


def read_data(data: Any, tokenizer: Any, splits: tuple = SPLITS) -> DataFiles:
    """Check the JSONL files of the local directory `data` (ValueError naming the file and
    line); `splits`: the files the run reads. A Hub dataset (no such directory) is mlx-lm's."""
    folder = Path(str(data))
    if not folder.is_dir():
        return DataFiles(None)
    found, unknown = None, 0
    for split in splits:
        path = folder / f"{split}.jsonl"
        if not path.exists():
            continue
        if not path.is_file():
            raise ValueError(f"{path} is not a regular file")
        records = 0
        with open(path, encoding="utf-8", errors="strict") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                kind, text = _record(path, number, line)
                if found is None:
                    found = (kind, path, number)
                elif kind != found[0]:
                    raise ValueError(
                        f"{path} line {number}: a {kind} record, but {found[1].name} line {found[2]} "
                        f"is {found[0]}: use one format for all the data"
                    )
                unknown += _unknown_characters(tokenizer, text)
                records += 1
        if records == 0 and split == "train":
            raise ValueError(f"{path} holds no records: give at least one JSON line")
    return DataFiles(found[0] if found else None, unknown)


def _record(path: Path, number: int, line: str) -> tuple[str, str]:
    """(the record's format, its text)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {number}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} line {number}: a record must be a JSON object")
    for kind, keys in FORMATS:
        if all(k in record for k in keys):
            return kind, _text(path, number, kind, record)
    raise ValueError(
        f"{path} line {number}: a record needs 'text', 'prompt' and 'completion', or 'messages' "
        f"(it has {sorted(record)[:6]})"
    )


def _text(path: Path, number: int, kind: str, record: dict) -> str:
    if kind == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path} line {number}: 'messages' must be a list of objects")
        return "".join(str(m.get("content") or "") for m in messages)
    keys = dict(FORMATS)[kind]
    for key in keys:
        if not isinstance(record[key], str):
            raise ValueError(f"{path} line {number}: '{key}' must be a string")
    return "".join(record[k] for k in keys)


def _unknown_characters(tokenizer: Any, text: str) -> int:
    """Characters of `text` the tokenizer encodes as its unknown token (0 where it has none:
    a byte-level vocabulary spells anything)."""
    unk = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "unk_token_id", None)
    if unk is None or not text:
        return 0
    ids = tokenizer.encode(text, add_special_tokens=False) if hasattr(tokenizer, "encode") else []
    return sum(1 for i in ids if i == unk)
