"""Tiny random Nemotron-Labs Diffusion and DiffusionGemma checkpoints, written offline.

Nemotron-Labs Diffusion: numpy weights in NVIDIA's layout (`encoder.*`, `diffusion_head`)
with a config shaped like the released one (YaRN RoPE parameters and Ministral-3's query
scaling; the scaling starts at position 128, which longer test sequences reach).

DiffusionGemma: transformers' own `DiffusionGemmaForBlockDiffusion`, given random weights
at a useful scale (the default initialisation gives near-uniform logits) and saved with
`save_pretrained`, so the layout (tied encoder/decoder, per-layer config, a small vision
tower) is the one transformers writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from mlx_lm_diffusion.testing.checkpoints import EOS_ID, VOCAB, _linear, _norm, write_tokenizer

NEMOTRON_MASK_ID = 260  # <|mdm_mask|> in the test tokenizer (100 in the released checkpoints)


def write_nemotron(
    path: Path, seed: int = 3, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, inter=128, max_len=512
) -> Path:
    """Nemotron-Labs Diffusion layout: encoder.{embed_tokens, layers.N.*, norm}, diffusion_head."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = {
        "encoder.embed_tokens.weight": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        "encoder.norm.weight": _norm(rng, hidden),
        "diffusion_head.weight": _linear(rng, VOCAB, hidden, 4.0),
    }
    for i in range(n_layers):
        b = f"encoder.layers.{i}."
        w[b + "self_attn.q_proj.weight"] = _linear(rng, n_heads * head_dim, hidden)
        w[b + "self_attn.k_proj.weight"] = _linear(rng, n_kv_heads * head_dim, hidden)
        w[b + "self_attn.v_proj.weight"] = _linear(rng, n_kv_heads * head_dim, hidden)
        w[b + "self_attn.o_proj.weight"] = _linear(rng, hidden, n_heads * head_dim)
        w[b + "mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.up_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.down_proj.weight"] = _linear(rng, hidden, inter)
        w[b + "input_layernorm.weight"] = _norm(rng, hidden)
        w[b + "post_attention_layernorm.weight"] = _norm(rng, hidden)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["NemotronLabsDiffusionModel"],
        "model_type": "nemotron_labs_diffusion",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 32,
        "bos_token_id": 1,
        "dlm_paradigm": "bidirectional",
        "eos_token_id": EOS_ID,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "mask_token_id": NEMOTRON_MASK_ID,
        "max_position_embeddings": max_len,
        "mlp_bias": False,
        "num_attention_heads": n_heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 4.0,
            "llama_4_scaling_beta": 0.1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
            "rope_type": "yarn",
        },
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path


def diffusion_gemma_config(canvas_length=16, sliding_window=8, **text):
    from transformers import DiffusionGemmaConfig

    text_config = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        max_position_embeddings=512,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        bos_token_id=2,
        use_bidirectional_attention="vision",
    )
    text_config.update(text)
    vision_config = dict(
        model_type="gemma4_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    return DiffusionGemmaConfig(
        text_config=text_config, vision_config=vision_config, canvas_length=canvas_length, eos_token_id=EOS_ID
    )


def random_diffusion_gemma(config, seed: int = 4):
    """transformers' DiffusionGemmaForBlockDiffusion with random weights at a useful scale:
    matrices ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N(0, 1), embeddings ~ N(0, 1), layer scalars
    and expert scales near 1 (the encoder's and the decoder's scalars differ)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.1 * torch.randn(b.shape, generator=gen))
    return model


def write_diffusion_gemma(path: Path, seed: int = 4, **config_kwargs) -> Path:
    """DiffusionGemma as transformers' save_pretrained writes it, plus the test tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    model = random_diffusion_gemma(diffusion_gemma_config(**config_kwargs), seed)
    model.save_pretrained(str(path))
    write_tokenizer(path)
    return path


# Nemotron-Labs Diffusion checkpoints whose drafts the causal pass accepts (in part): random
# weights draft almost nothing the causal pass agrees with, so self-speculation would accept only
# its bonus token per window and the acceptance path (and the cache trimming after a partly
# accepted window) would go untested. `write_speculable_nemotron` writes the usual random
# checkpoint and then adds one shared direction to every embedding and to the head rows of a few
# "attractor" tokens: both attention modes then propose mostly those tokens, and which one
# depends on the content, so drafts are accepted in part.
ATTRACTORS = (40, 41, 42)


def write_speculable_nemotron(path: Path, attractors=ATTRACTORS, strength: float = 1.0, seed: int = 0, **dims) -> Path:
    """write_nemotron's checkpoint (dims: its sizes), made partly predictable; one attractor
    and a strength of 3 give a model whose drafts are accepted whole."""
    write_nemotron(path, **dims)
    file = path / "model.safetensors"
    weights = load_file(str(file))
    head = weights["diffusion_head.weight"]
    hidden = head.shape[1]
    shared = np.random.default_rng(seed).standard_normal(hidden).astype(np.float32)
    shared /= np.linalg.norm(shared)
    weights["encoder.embed_tokens.weight"] += strength * np.sqrt(hidden) * shared
    for token in attractors:
        head[token] += 4 * strength * shared
    save_file(weights, str(file), metadata={"format": "pt"})
    return path
