"""The demo's character-level vocabulary and its Hugging Face tokenizer.

One token per character of "0123456789+=", then EOS, the mask token and an unknown
token; whitespace is dropped by the normalizer, so "357 + 468 =" reads as "357+468=".
The tokenizer is a `tokenizers` BPE with single-character tokens and no merges, saved
with transformers so that `AutoTokenizer` (and therefore `mlx_lm.load`) reads it offline.
"""

from __future__ import annotations

from pathlib import Path

CHARS = "0123456789+="
EOS = "<eos>"
MASK = "<|mdm_mask|>"
UNK = "<unk>"
TOKENS: tuple[str, ...] = tuple(CHARS) + (EOS, MASK, UNK)
ID = {t: i for i, t in enumerate(TOKENS)}
EOS_ID = ID[EOS]
MASK_ID = ID[MASK]
UNK_ID = ID[UNK]
VOCAB_SIZE = len(TOKENS)


def encode(text: str) -> list[int]:
    """Token ids of a string over CHARS (the tokenizer's result, without loading it)."""
    return [ID.get(c, UNK_ID) for c in text if not c.isspace()]


def decode(ids) -> str:
    """Text of token ids, stopping at the first EOS (mask shown as '_')."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        out.append("_" if i == MASK_ID else TOKENS[i] if i < len(CHARS) else "?")
    return "".join(out)


def write_tokenizer(path: Path) -> None:
    """Save the tokenizer files (tokenizer.json, tokenizer_config.json, ...) under `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), "")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS, MASK, UNK])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(path))
