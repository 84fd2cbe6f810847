"""Tiny random checkpoints in each family's real on-disk layout, written offline.

Weights are numpy arrays saved with safetensors' numpy API, named exactly as the
Hugging Face checkpoints name them; the tokenizer is a byte-level BPE with no
merges, built with `tokenizers` and saved with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB = 288  # model vocabulary (the tokenizer uses ids < 261)
EOS_ID = 256  # <|endoftext|>
EOT_ID = 257  # <|eot_id|>
MASK_ID = 260
SPECIALS = ["<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|mdm_mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mdm_mask|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _byte_of(char: str) -> int:
    from tokenizers.pre_tokenizers import ByteLevel  # noqa: F401

    # GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table[char]


def _linear(rng, out_dim, in_dim, scale=1.0):
    return (rng.standard_normal((out_dim, in_dim)) * scale / np.sqrt(in_dim)).astype(np.float32)


def _norm(rng, dim):
    return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)


def write_llada(
    path: Path, seed: int = 0, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp=128, max_len=512, vocab=VOCAB
) -> Path:
    """LLaDA 1.x layout: model.transformer.{wte, blocks.N.*, ln_f, ff_out}. (`vocab` >
    VOCAB: benchmarks at a realistic vocabulary; the tokenizer still uses ids < 261.)"""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = d_model // n_heads
    w = {
        "model.transformer.wte.weight": rng.standard_normal((vocab, d_model)).astype(np.float32),
        "model.transformer.ln_f.weight": _norm(rng, d_model),
        "model.transformer.ff_out.weight": _linear(rng, vocab, d_model, 4.0),
    }
    for i in range(n_layers):
        b = f"model.transformer.blocks.{i}."
        w[b + "q_proj.weight"] = _linear(rng, n_heads * hd, d_model)
        w[b + "k_proj.weight"] = _linear(rng, n_kv_heads * hd, d_model)
        w[b + "v_proj.weight"] = _linear(rng, n_kv_heads * hd, d_model)
        w[b + "attn_out.weight"] = _linear(rng, d_model, n_heads * hd)
        w[b + "ff_proj.weight"] = _linear(rng, mlp, d_model)
        w[b + "up_proj.weight"] = _linear(rng, mlp, d_model)
        w[b + "ff_out.weight"] = _linear(rng, d_model, mlp)
        w[b + "attn_norm.weight"] = _norm(rng, d_model)
        w[b + "ff_norm.weight"] = _norm(rng, d_model)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "mlp_hidden_size": mlp,
        "mlp_ratio": 2,
        "vocab_size": vocab,
        "embedding_size": vocab,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": max_len,
        "weight_tying": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path


def write_dream(
    path: Path, seed: int = 1, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, inter=128, max_len=512, vocab=VOCAB
) -> Path:
    """Dream layout: Qwen2 names with q/k/v biases and an untied lm_head."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // n_heads
    w = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
        "model.norm.weight": _norm(rng, hidden),
        "lm_head.weight": _linear(rng, vocab, hidden, 4.0),
    }
    for i in range(n_layers):
        b = f"model.layers.{i}."
        for name, out in (("q_proj", n_heads * hd), ("k_proj", n_kv_heads * hd), ("v_proj", n_kv_heads * hd)):
            w[b + f"self_attn.{name}.weight"] = _linear(rng, out, hidden)
            w[b + f"self_attn.{name}.bias"] = (0.1 * rng.standard_normal(out)).astype(np.float32)
        w[b + "self_attn.o_proj.weight"] = _linear(rng, hidden, n_heads * hd)
        w[b + "mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.up_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.down_proj.weight"] = _linear(rng, hidden, inter)
        w[b + "input_layernorm.weight"] = _norm(rng, hidden)
        w[b + "post_attention_layernorm.weight"] = _norm(rng, hidden)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": n_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "max_position_embeddings": max_len,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path
