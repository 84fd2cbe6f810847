"""Tiny random mlx-lm causal LMs (llama, qwen3) written as MLX checkpoints, offline (the ar adapter's tests and benches)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlx_lm_diffusion.testing.checkpoints import EOS_ID, VOCAB, write_tokenizer

CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_theta=10000.0,
    ),
}


def write_causal(path: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[model_type], eos_token_id=EOS_ID, **overrides)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # sharper than the default init, so greedy choices are far from ties
    params = tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters())
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(params)))
    (path / "config.json").write_text(json.dumps(config))
    write_tokenizer(path)
    return path
