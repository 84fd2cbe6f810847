"""Tiny random checkpoints of the hybrid families, written offline in their released layouts:
Trida2.0 / FLARE (the Qwen3.5 hybrid with a block-diffusion sidecar) and LFM2.5-Diffusion (the
LFM2 convolution / attention hybrid with sigma conditioning; `write_lfm2_diffusion`).

Trida2.0-4B ships a raw transformers text checkpoint: config.json with `model_type "qwen3_5_text"`
and architectures ["Qwen3_5ForCausalLM"] (flat, no text_config), Qwen3.5's weight names (gated
delta layers `linear_attn.*` with a (C, 1, K) depthwise conv, gated attention every
`full_attention_interval`-th layer), zero-centred RMSNorm weights (the norm multiplies by 1 + w),
tied embeddings with the tied head shipped as well, and a `block_diffusion.json` sidecar
{bd_size, mask_id} (trillion-labs/trida-stack inference/mlx/tests/tiny_ckpt.py,
inference/mlx/trida_mlx/model.py `mask_id_of`). FLARE (Adobe HybridDiffusion) ships the
vision-language layout: `model_type "qwen3_5"` with a nested text_config, weights under
`model.language_model.`, architectures ["Qwen3_5DLLMForConditionalGeneration"] (`layout="flare"`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
from safetensors.numpy import load_file, save_file

from mlx_lm_diffusion.testing.block_checkpoints import SDAR_EOS, SDAR_TEMPLATE, VOCAB, write_tokenizer
from mlx_lm_diffusion.testing.checkpoints import _linear

HYBRID_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
HYBRID_EOS, HYBRID_MASK = SDAR_EOS, 259


def write_trida(
    path: Path,
    seed: int = 7,
    hidden: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    inter: int = 128,
    linear_k_heads: int = 2,
    linear_v_heads: int = 4,
    linear_k_dim: int = 32,
    linear_v_dim: int = 16,
    conv_kernel: int = 4,
    bd_size: int = 8,
    tied: bool = True,
    layout: str = "trida",
    sidecar: bool = True,
) -> Path:
    """A Qwen3.5 hybrid (layers 0-2 gated delta, 3 attention when n_layers = 4) in Trida's raw
    layout, or FLARE's (`layout="flare"`); `sidecar` False: the same weights as an ordinary
    Qwen3.5 checkpoint (what stock mlx-lm loads as its own qwen3_5)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    embed = (rng.standard_normal((VOCAB, hidden)) * 0.1).astype(np.float32)  # (small: tied, the layers decide)
    w = {"model.embed_tokens.weight": embed, "model.norm.weight": _centred(rng, hidden)}
    conv_dim = 2 * linear_k_heads * linear_k_dim + linear_v_heads * linear_v_dim
    for i in range(n_layers):
        b = f"model.layers.{i}."
        if (i + 1) % 4:
            a = b + "linear_attn."
            w[a + "in_proj_qkv.weight"] = _linear(rng, conv_dim, hidden)
            w[a + "in_proj_z.weight"] = _linear(rng, linear_v_heads * linear_v_dim, hidden)
            w[a + "in_proj_b.weight"] = _linear(rng, linear_v_heads, hidden)
            w[a + "in_proj_a.weight"] = _linear(rng, linear_v_heads, hidden)
            w[a + "conv1d.weight"] = (rng.standard_normal((conv_dim, 1, conv_kernel)) * 0.5).astype(np.float32)
            w[a + "dt_bias"] = rng.uniform(0.5, 1.5, linear_v_heads).astype(np.float32)
            w[a + "A_log"] = np.log(rng.uniform(1.0, 8.0, linear_v_heads)).astype(np.float32)
            w[a + "norm.weight"] = (1.0 + 0.1 * rng.standard_normal(linear_v_dim)).astype(np.float32)
            w[a + "out_proj.weight"] = _linear(rng, hidden, linear_v_heads * linear_v_dim)
        else:
            a = b + "self_attn."
            w[a + "q_proj.weight"] = _linear(rng, 2 * n_heads * head_dim, hidden)  # queries and their gates
            w[a + "k_proj.weight"] = _linear(rng, n_kv_heads * head_dim, hidden)
            w[a + "v_proj.weight"] = _linear(rng, n_kv_heads * head_dim, hidden)
            w[a + "o_proj.weight"] = _linear(rng, hidden, n_heads * head_dim)
            w[a + "q_norm.weight"] = _centred(rng, head_dim)
            w[a + "k_norm.weight"] = _centred(rng, head_dim)
        w[b + "mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.up_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.down_proj.weight"] = _linear(rng, hidden, inter)
        w[b + "input_layernorm.weight"] = _centred(rng, hidden)
        w[b + "post_attention_layernorm.weight"] = _centred(rng, hidden)
    head = embed if tied else _linear(rng, VOCAB, hidden, 2.0)
    head[HYBRID_MASK] = 0.0  # (a trained model never proposes the mask)
    if tied:
        w["model.embed_tokens.weight"] = head  # the head is the embedding; shipped as well, as Trida does
    w["lm_head.weight"] = head.copy()
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": linear_k_heads,
        "linear_num_value_heads": linear_v_heads,
        "linear_key_head_dim": linear_k_dim,
        "linear_value_head_dim": linear_v_dim,
        "linear_conv_kernel_dim": conv_kernel,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "eos_token_id": HYBRID_EOS,
    }
    if layout == "flare":
        w = {k.replace("model.", "model.language_model.", 1): v for k, v in w.items() if k != "lm_head.weight"} | (
            {} if tied else {"lm_head.weight": w["lm_head.weight"]}
        )
        config = {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5DLLMForConditionalGeneration"],
            "text_config": text,
            "tie_word_embeddings": tied,
            "eos_token_id": HYBRID_EOS,
        }
    else:
        config = dict(text, architectures=["Qwen3_5ForCausalLM"])
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if sidecar:
        (path / "block_diffusion.json").write_text(
            json.dumps({"bd_size": bd_size, "mask_id": HYBRID_MASK, "ar_loss_weight": 1.0})
        )
    write_tokenizer(path, HYBRID_SPECIALS, "<|im_end|>", "<|mask|>", SDAR_TEMPLATE)
    return path


def _centred(rng, dim: int) -> np.ndarray:
    """A zero-centred RMSNorm weight (Qwen3.5 multiplies by 1 + w)."""
    return (0.1 * rng.standard_normal(dim)).astype(np.float32)


def trida_as_qwen3_5(path: Path, to: Path) -> Path:
    """The checkpoint at `path`, copied to `to` as an ordinary Qwen3.5 checkpoint that stock
    mlx-lm loads as its own qwen3_5 (the autoregressive oracle): no sidecar, `model_type
    "qwen3_5"` (mlx-lm 0.32 has no "qwen3_5_text") and, when tied, no shipped head (mlx-lm's
    qwen3_5 sanitize drops only an unprefixed one)."""
    shutil.copytree(path, to)
    (to / "block_diffusion.json").unlink(missing_ok=True)
    config = json.loads((to / "config.json").read_text())
    config["model_type"] = "qwen3_5"
    (to / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(to / "model.safetensors"))
    if config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")):
        weights.pop("lm_head.weight", None)
    save_file(weights, str(to / "model.safetensors"), metadata={"format": "pt"})
    return to


def force_bigram(path: Path, scale: float = 1.0, forced: Optional[int] = None) -> Path:
    """Zero every layer's output (attention, gated delta and MLP), so that a position's logits
    depend on its own token only: a bigram model whose distributions are known (the head over
    the final norm of the token's embedding, `scale` sharpening them). `forced`: every token,
    the mask included, predicts that one (drafts always right)."""
    weights = load_file(str(path / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    heads = [n for n in weights if n.endswith("lm_head.weight")]
    embeds = [n for n in weights if n.endswith("embed_tokens.weight")]
    for name in embeds + heads:
        weights[name] = weights[name] * scale
    if forced is not None:
        config = json.loads((path / "config.json").read_text())
        if config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")):
            raise ValueError("a forced checkpoint needs an untied head (write_trida(tied=False))")
        for name in embeds:
            weights[name][:, 0] = np.abs(weights[name][:, 0]) + 4.0
        for name in heads:
            weights[name] = np.zeros_like(weights[name])
            weights[name][forced, 0] = 1.0
        for name in weights:
            if name.endswith("model.norm.weight"):
                weights[name] = np.zeros_like(weights[name])  # (1 + 0: the plain RMS norm)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


LFM2_REAL_VOCAB = 300  # (the table's last 20 rows are padding, as LFM2.5's 64,400 of 65,536)


def write_lfm2_diffusion(
    path: Path,
    seed: int = 11,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    inter: int = 128,
    layer_types: tuple = ("conv", "full_attention", "conv", "conv"),
    conv_cache: int = 3,
    cond: int = 32,
    frequencies: int = 16,
    block: int = 32,
) -> Path:
    """LFM2.5-350M-Diffusion's layout (Liquid4All/sglang-diffusion-lfm python/sglang/srt/models/
    lfm2_diffusion.py): transformers' LFM2 names (`conv.conv.weight` as (C, 1, L), tied head),
    plus `model.sigma_embed.mlp.{0,2}`, `model.adaln_proj.1`, `model.adaln_block_emb`,
    `model.selfcond_norm`, `model.selfcond_ffn.{0,2}`; config `model_type "lfm2_diffusion"`,
    `real_vocab_size` below the table's rows, mlx-lm's LFM2 block fields."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // n_heads
    w = {
        "model.embed_tokens.weight": (rng.standard_normal((VOCAB, hidden)) * 0.5).astype(np.float32),
        "model.embedding_norm.weight": _ones_jitter(rng, hidden),
    }
    for i, kind in enumerate(layer_types):
        b = f"model.layers.{i}."
        if kind == "conv":
            w[b + "conv.in_proj.weight"] = _linear(rng, 3 * hidden, hidden)
            w[b + "conv.conv.weight"] = (rng.standard_normal((hidden, 1, conv_cache)) * 0.5).astype(np.float32)
            w[b + "conv.out_proj.weight"] = _linear(rng, hidden, hidden)
        else:
            w[b + "self_attn.q_proj.weight"] = _linear(rng, n_heads * hd, hidden)
            w[b + "self_attn.k_proj.weight"] = _linear(rng, n_kv_heads * hd, hidden)
            w[b + "self_attn.v_proj.weight"] = _linear(rng, n_kv_heads * hd, hidden)
            w[b + "self_attn.out_proj.weight"] = _linear(rng, hidden, n_heads * hd)
            w[b + "self_attn.q_layernorm.weight"] = _ones_jitter(rng, hd)
            w[b + "self_attn.k_layernorm.weight"] = _ones_jitter(rng, hd)
        w[b + "feed_forward.w1.weight"] = _linear(rng, inter, hidden)
        w[b + "feed_forward.w3.weight"] = _linear(rng, inter, hidden)
        w[b + "feed_forward.w2.weight"] = _linear(rng, hidden, inter)
        w[b + "operator_norm.weight"] = _ones_jitter(rng, hidden)
        w[b + "ffn_norm.weight"] = _ones_jitter(rng, hidden)
    w["model.sigma_embed.mlp.0.weight"] = _linear(rng, cond, frequencies)
    w["model.sigma_embed.mlp.0.bias"] = (0.1 * rng.standard_normal(cond)).astype(np.float32)
    w["model.sigma_embed.mlp.2.weight"] = _linear(rng, cond, cond)
    w["model.sigma_embed.mlp.2.bias"] = (0.1 * rng.standard_normal(cond)).astype(np.float32)
    w["model.adaln_proj.1.weight"] = _linear(rng, 3 * hidden, cond, 0.3)
    w["model.adaln_proj.1.bias"] = (0.05 * rng.standard_normal(3 * hidden)).astype(np.float32)
    w["model.adaln_block_emb"] = (0.05 * rng.standard_normal((len(layer_types), 3 * hidden))).astype(np.float32)
    w["model.selfcond_norm.weight"] = _ones_jitter(rng, hidden)
    w["model.selfcond_ffn.0.weight"] = _linear(rng, hidden, hidden)
    w["model.selfcond_ffn.0.bias"] = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w["model.selfcond_ffn.2.weight"] = _linear(rng, hidden, hidden)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Lfm2ForBlockDiffusion"],
        "model_type": "lfm2_diffusion",
        "vocab_size": VOCAB,
        "real_vocab_size": LFM2_REAL_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "max_position_embeddings": 2048,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": conv_cache,
        "block_dim": hidden,
        "block_ff_dim": inter,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": list(layer_types),
        "rope_theta": 1000000.0,
        "tie_embedding": True,
        "eos_token_id": HYBRID_EOS,
        "pad_token_id": HYBRID_EOS,
        "sigma_cond_dim": cond,
        "sigma_freq_embedding_size": frequencies,
        "selfcond_ffn_bias": True,
        "self_conditioning": True,
        "adaln_conditioning": True,
        "diffusion_block_size": block,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, HYBRID_SPECIALS, "<|endoftext|>", "<|mask|>", SDAR_TEMPLATE)
    return path


def _ones_jitter(rng, dim: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
