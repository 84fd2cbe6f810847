"""Forward parity against transformers' PyTorch models on the same tiny checkpoints.

LLaDA is Llama with bidirectional attention (weights renamed from the OLMo-style
layout); Dream is Qwen2 with bidirectional attention and the same names.
"""

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
import json  # noqa: E402

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from model_adapters.families.llada import _rename  # noqa: E402

TOL = 1e-4


def _tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.from_numpy(ids)).logits.float().numpy()


def _bidirectional(ref_cls, config):
    config.is_causal = False
    ref = ref_cls(config).eval()
    assert ref.config.is_causal is False
    return ref


def test_llada_matches_bidirectional_llama(llada_path, llada):
    model, _ = llada
    cfg = json.loads((llada_path / "config.json").read_text())
    ref = _bidirectional(
        LlamaForCausalLM,
        LlamaConfig(
            hidden_size=cfg["d_model"],
            intermediate_size=cfg["mlp_hidden_size"],
            num_attention_heads=cfg["n_heads"],
            num_key_value_heads=cfg["n_kv_heads"],
            num_hidden_layers=cfg["n_layers"],
            vocab_size=cfg["vocab_size"],
            rope_theta=cfg["rope_theta"],
            rms_norm_eps=cfg["rms_norm_eps"],
            max_position_embeddings=cfg["max_sequence_length"],
            tie_word_embeddings=False,
        ),
    )
    weights = load_file(str(llada_path / "model.safetensors"))
    ref.load_state_dict({_rename(k): torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    ids = _tokens(0, (2, 37), cfg["vocab_size"])
    ours = np.array(model(mx.array(ids)))
    theirs = _reference_logits(ref, ids)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= TOL
    # bidirectional: the last token changes the first position's logits
    ids2 = ids.copy()
    ids2[:, -1] = (ids2[:, -1] + 1) % cfg["vocab_size"]
    assert np.abs(np.array(model(mx.array(ids2)))[:, 0] - ours[:, 0]).max() > 1e-3


def test_dream_matches_bidirectional_qwen2(dream_path, dream):
    model, _ = dream
    cfg = json.loads((dream_path / "config.json").read_text())
    ref = _bidirectional(
        Qwen2ForCausalLM,
        Qwen2Config(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            num_hidden_layers=cfg["num_hidden_layers"],
            vocab_size=cfg["vocab_size"],
            rope_theta=cfg["rope_theta"],
            rms_norm_eps=cfg["rms_norm_eps"],
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=False,
        ),
    )
    weights = load_file(str(dream_path / "model.safetensors"))
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    ids = _tokens(1, (2, 41), cfg["vocab_size"])
    ours = np.array(model(mx.array(ids)))
    theirs = _reference_logits(ref, ids)
    assert np.abs(ours - theirs).max() <= TOL


def test_sanitize_is_idempotent(llada, dream):
    from mlx.utils import tree_flatten

    for model, _ in (llada, dream):
        weights = dict(tree_flatten(model.parameters()))
        once = model.sanitize(dict(weights))
        assert set(once) == set(weights)
        assert set(model.sanitize(dict(once))) == set(once)
