"""The demo's character-level vocabulary and its Hugging Face tokenizer.

One token per character of "0123456789+-={}\":,absum" (digits, the operators, and what
the JSON prompts and answers are written with), then EOS, the mask token, an unknown
token and BLANK, a filler whose text is empty. The normalizer only drops whitespace:
every digit is its own token and a number is written as typed ("357+468=" is 8 tokens),
so the text a stop string, a grammar or a suffix is compared with is the text typed.
The model writes a sum in ANSWER_WIDTH (5) slots, right-aligned, BLANK in the slots
before the first digit ("825" is BLANK BLANK 8 2 5): every place value has its own
slot, so the units digit is always the fifth generated token whatever the answer's
length. The alignment is the model's own output format, not the tokenizer's: the
tokenizer's decoder turns BLANK into nothing, so the text read is "825" (a regular
vocabulary token, not a special one, so that decoding never needs skip_special_tokens),
and BLANK is never what the tokenizer makes of text.
The tokenizer is a `tokenizers` BPE with single-character tokens and no merges, saved
with transformers so that `AutoTokenizer` (and therefore `mlx_lm.load`) reads it offline.
Its chat template (`CHAT_TEMPLATE`, in tokenizer_config.json) renders the last user
message's text and nothing else, so the chat prompt of "357+468=" is "357+468=" itself:
the model knows no roles, and any chat door answers what the raw prompt answers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHARS = '0123456789+-={}":,absum'
EOS = "<eos>"
MASK = "<|mdm_mask|>"
UNK = "<unk>"
BLANK = "<blank>"
TOKENS: tuple[str, ...] = tuple(CHARS) + (EOS, MASK, UNK, BLANK)
ID = {t: i for i, t in enumerate(TOKENS)}
EOS_ID = ID[EOS]
MASK_ID = ID[MASK]
UNK_ID = ID[UNK]
BLANK_ID = ID[BLANK]
VOCAB_SIZE = len(TOKENS)
ANSWER_WIDTH = 5  # answer slots: the largest sum, 9999 + 9999 = 19998, has 5 digits

# The last user message's content (a string, or OpenAI-style parts whose text is joined),
# then nothing else: the generation prompt is empty and there are no role markers. A
# conversation that ends with the assistant's reply (a training example: mlx-lm's
# completions and chat data) renders that reply after it, then EOS.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(text='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if message['content'] is string -%}{%- set ns.text = message['content'] -%}"
    "{%- else -%}{%- set ns.text = '' -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set ns.text = ns.text + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- ns.text -}}"
    "{%- if messages and messages[-1]['role'] == 'assistant' and messages[-1]['content'] is string -%}"
    "{{- messages[-1]['content'] + '<eos>' -}}"
    "{%- endif -%}"
)


def normalize(text: str) -> str:
    """What the tokenizer's normalizer makes of `text`: the text without whitespace."""
    return re.sub(r"\s", "", text)


def encode(text: str) -> list[int]:
    """Token ids of a prompt (the tokenizer's result, without loading it)."""
    return encode_chars(normalize(text))


def encode_chars(text: str) -> list[int]:
    """Token ids of `text` character by character."""
    return [ID.get(c, UNK_ID) for c in text if not c.isspace()]


def encode_answer(text: str) -> list[int]:
    """The answer's ANSWER_WIDTH slots as the model writes them: BLANK, then the digits."""
    return encode_slots(text, ANSWER_WIDTH)


def encode_slots(text: str, width: int) -> list[int]:
    """`text` right-aligned in `width` slots, BLANK before it (the infilled operand's form)."""
    digits = encode_chars(text)
    if len(digits) > width:
        raise ValueError(f"{text!r} does not fit {width} slots")
    return [BLANK_ID] * (width - len(digits)) + digits


def decode(ids) -> str:
    """Text of token ids, stopping at the first EOS (BLANK is empty, mask shown as '_')."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i != BLANK_ID:
            out.append("_" if i == MASK_ID else TOKENS[i] if i < len(CHARS) else "?")
    return "".join(out)


def write_tokenizer(path: Path, model_max_length: int | None = None) -> None:
    """Save the tokenizer files (tokenizer.json, tokenizer_config.json, ...) under `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), "")
    tok.decoder = decoders.Sequence([decoders.Replace(BLANK, ""), decoders.Fuse()])
    tok.add_special_tokens([EOS, MASK, UNK])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        **({} if model_max_length is None else {"model_max_length": model_max_length}),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    # the template lives in tokenizer_config.json (what every transformers version reads),
    # not in a separate chat_template.jinja
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
