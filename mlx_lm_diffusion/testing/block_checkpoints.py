"""Tiny random SDAR and LLaDA2 checkpoints in the real on-disk layouts, written offline.

SDAR: Qwen3 names (q_norm / k_norm), `block_size` and `mask_token_id` in config.json.
LLaDA2: BailingMoeV2 names (fused query_key_value, per-expert weights, `mlp.gate.weight`
and `expert_bias`), and, as in the released checkpoints, no mask or EOS id in the
config beyond `pad_token_id`: the mask token comes from the tokenizer. Each family's
special tokens sit at their own ids, so a hard-coded id would be caught.

The mask token's lm_head row is zero: a trained model never proposes the mask, and a
reference that does not suppress it (mlx-vlm) then agrees with the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
from safetensors.numpy import save_file

from mlx_lm_diffusion.testing.checkpoints import _byte_of, _linear, _norm

VOCAB = 320

SDAR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
SDAR_EOS, SDAR_MASK = 256, 259
SDAR_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLADA2_SPECIALS = ["<role>", "</role>", "<|endoftext|>", "<|role_end|>", "<|arithmetic_start|>", "<|mask|>"]
LLADA2_EOS, LLADA2_MASK = 258, 261
LLADA2_TEMPLATE = (
    "{% for m in messages %}<role>{{ m['role'] | upper }}</role>{{ m['content'] }}<|role_end|>{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)


def write_tokenizer(path: Path, specials, eos: str, mask: str, chat_template: str) -> None:
    """Byte-level BPE without merges; specials get ids 256, 257, ... in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: _byte_of(c) for c in ByteLevel.alphabet()}
    for i, s in enumerate(specials):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, mask_token=mask)
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))


def write_sdar(
    path: Path,
    seed: int = 2,
    hidden=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    inter=128,
    block_size=4,
    max_len=1024,
) -> Path:
    """SDAR layout: Qwen3 names with q/k RMSNorm weights and an untied lm_head."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    head = _linear(rng, VOCAB, hidden, 4.0)
    head[SDAR_MASK] = 0.0
    w = {
        "model.embed_tokens.weight": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        "model.norm.weight": _norm(rng, hidden),
        "lm_head.weight": head,
    }
    for i in range(n_layers):
        b = f"model.layers.{i}."
        w[b + "self_attn.q_proj.weight"] = _linear(rng, n_heads * head_dim, hidden)
        w[b + "self_attn.k_proj.weight"] = _linear(rng, n_kv_heads * head_dim, hidden)
        w[b + "self_attn.v_proj.weight"] = _linear(rng, n_kv_heads * head_dim, hidden)
        w[b + "self_attn.o_proj.weight"] = _linear(rng, hidden, n_heads * head_dim)
        w[b + "self_attn.q_norm.weight"] = _norm(rng, head_dim)
        w[b + "self_attn.k_norm.weight"] = _norm(rng, head_dim)
        w[b + "mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.up_proj.weight"] = _linear(rng, inter, hidden)
        w[b + "mlp.down_proj.weight"] = _linear(rng, hidden, inter)
        w[b + "input_layernorm.weight"] = _norm(rng, hidden)
        w[b + "post_attention_layernorm.weight"] = _norm(rng, hidden)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "attention_bias": False,
        "block_size": block_size,
        "mask_token_id": SDAR_MASK,
        "bos_token_id": SDAR_EOS,
        "eos_token_id": SDAR_EOS,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": max_len,
        "num_attention_heads": n_heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, SDAR_SPECIALS, "<|endoftext|>", "<|MASK|>", SDAR_TEMPLATE)
    return path


def write_idlm(path: Path, seed: int = 5, block_size: int = 3, forced: Optional[int] = None, **sizes) -> Path:
    """I-DLM layout (thuEcstasy/I-DLM training/model/Qwen3-8B-b3-allmasked): SDAR's files,
    `block_size` 3 (the masks per round, N - 1) and I-DLM's `use_regular_causal` switch.
    `forced` (a token id): every position, masks included, predicts that token (the
    attention and MLP outputs zeroed, the head made to read one embedding direction): a
    checkpoint whose drafts are always right, so every round is accepted whole."""
    write_sdar(path, seed=seed, block_size=block_size, **sizes)
    config = json.loads((path / "config.json").read_text())
    config["use_regular_causal"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if forced is not None:
        from safetensors.numpy import load_file

        w = load_file(str(path / "model.safetensors"))
        for name in w:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w[name] = np.zeros_like(w[name])
        w["model.embed_tokens.weight"][:, 0] = np.abs(w["model.embed_tokens.weight"][:, 0]) + 4.0
        w["model.norm.weight"] = np.ones_like(w["model.norm.weight"])
        head = np.zeros_like(w["lm_head.weight"])
        head[forced, 0] = 1.0
        w["lm_head.weight"] = head
        save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def idlm_as_qwen3(path: Path, to: Path) -> Path:
    """The I-DLM checkpoint at `path`, copied to `to` as a stock mlx-lm Qwen3 checkpoint (the
    same weights; the autoregressive oracle of its greedy decoding)."""
    import shutil

    shutil.copytree(path, to)
    config = json.loads((to / "config.json").read_text())
    for key in ("use_regular_causal", "block_size", "mask_token_id"):
        config.pop(key, None)
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (to / "config.json").write_text(json.dumps(config, indent=2))
    return to


def write_llada2(
    path: Path,
    seed: int = 3,
    hidden=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    inter=128,
    moe_inter=32,
    n_experts=8,
    top_k=2,
    n_group=2,
    topk_group=1,
    max_len=1024,
    extra_config: Optional[dict] = None,
    head_scales: Optional[dict] = None,
) -> Path:
    """LLaDA2 (llada2_moe) layout: layer 0 dense, later layers MoE with a shared expert.
    `extra_config`: keys added to config.json; `head_scales`: {token id: factor} applied to
    those lm_head rows (a token proposed more or less often)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // n_heads
    head = _linear(rng, VOCAB, hidden, 4.0)
    head[LLADA2_MASK] = 0.0
    for token, factor in (head_scales or {}).items():
        head[token] *= factor
    w = {
        "model.word_embeddings.weight": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        "model.norm.weight": _norm(rng, hidden),
        "lm_head.weight": head,
    }
    for i in range(n_layers):
        b = f"model.layers.{i}."
        w[b + "attention.query_key_value.weight"] = _linear(rng, (n_heads + 2 * n_kv_heads) * hd, hidden)
        w[b + "attention.dense.weight"] = _linear(rng, hidden, n_heads * hd)
        w[b + "attention.query_layernorm.weight"] = _norm(rng, hd)
        w[b + "attention.key_layernorm.weight"] = _norm(rng, hd)
        w[b + "input_layernorm.weight"] = _norm(rng, hidden)
        w[b + "post_attention_layernorm.weight"] = _norm(rng, hidden)
        if i == 0:  # first_k_dense_replace = 1
            w[b + "mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
            w[b + "mlp.up_proj.weight"] = _linear(rng, inter, hidden)
            w[b + "mlp.down_proj.weight"] = _linear(rng, hidden, inter)
            continue
        w[b + "mlp.gate.weight"] = _linear(rng, n_experts, hidden)
        # negative biases make the group mask matter (a zeroed expert would outrank them)
        w[b + "mlp.gate.expert_bias"] = rng.uniform(-1.0, 0.2, n_experts).astype(np.float32)
        for e in range(n_experts):
            w[b + f"mlp.experts.{e}.gate_proj.weight"] = _linear(rng, moe_inter, hidden)
            w[b + f"mlp.experts.{e}.up_proj.weight"] = _linear(rng, moe_inter, hidden)
            w[b + f"mlp.experts.{e}.down_proj.weight"] = _linear(rng, hidden, moe_inter)
        w[b + "mlp.shared_experts.gate_proj.weight"] = _linear(rng, moe_inter, hidden)
        w[b + "mlp.shared_experts.up_proj.weight"] = _linear(rng, moe_inter, hidden)
        w[b + "mlp.shared_experts.down_proj.weight"] = _linear(rng, hidden, moe_inter)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "first_k_dense_replace": 1,
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": max_len,
        "moe_intermediate_size": moe_inter,
        "moe_router_enable_expert_bias": True,
        "n_group": n_group,
        "norm_head": False,
        "norm_topk_prob": True,
        "num_attention_heads": n_heads,
        "num_experts": n_experts,
        "num_experts_per_tok": top_k,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv_heads,
        "num_shared_experts": 1,
        "pad_token_id": LLADA2_EOS,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": topk_group,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "vocab_size": VOCAB,
        **(extra_config or {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, LLADA2_SPECIALS, "<|endoftext|>", "<|mask|>", LLADA2_TEMPLATE)
    return path


# LLaDA2.2's DELETE and SPLIT live in the base vocabulary, outside the tokenizer's added
# tokens (released: 156930 / 156931 of 157184); here two unused rows past the specials.
LLADA2_2_DELETE, LLADA2_2_SPLIT = 300, 301
LLADA2_2_EOS = [LLADA2_EOS, 259]  # <|endoftext|> and <|role_end|>, as generation_config.json lists them


def write_llada2_2(
    path: Path,
    seed: int = 5,
    block_size: int = 8,
    expert_capacity: int = 3,
    edit_scale: float = 1.6,
    head_scales: Optional[dict] = None,
    **sizes,
) -> Path:
    """LLaDA2.2 layout (inclusionAI/LLaDA2.2-flash's config.json and generation_config.json):
    LLaDA2's tensors, plus `expert_capacity` and `block_size` (block routing: each window of
    `block_size` positions keeps `expert_capacity` of the experts; released 48 of 256 over 32),
    the group fields still present (unused), `delete_token_id` / `split_token_id`, and an EOS
    list. The DELETE and SPLIT rows of lm_head are scaled by `edit_scale` so that random
    weights propose them often (the edit scan then has work to do); `head_scales` scales other
    rows (an EOS proposed more often)."""
    extra = {
        "block_size": block_size,
        "expert_capacity": expert_capacity,
        "delete_token_id": LLADA2_2_DELETE,
        "split_token_id": LLADA2_2_SPLIT,
        "rope_theta": 3000000,
    }
    write_llada2(
        path,
        seed=seed,
        extra_config=extra,
        head_scales={LLADA2_2_DELETE: edit_scale, LLADA2_2_SPLIT: edit_scale, **(head_scales or {})},
        **sizes,
    )
    generation = {"eos_token_id": LLADA2_2_EOS, "pad_token_id": LLADA2_EOS}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


IDLM_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_idlm_lora(path: Path, base: Path, rank: int = 4, alpha: float = 8.0, seed: int = 9) -> Path:
    """A PEFT LoRA adapter for the Qwen3 checkpoint at `base` (I-DLM's LoRA flavour: the
    adapter acts on the mask rows only, model_adapters.idlm_lora): adapter_config.json and
    adapter_model.safetensors with PEFT's names for every attention and MLP projection."""
    from safetensors.numpy import load_file

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = load_file(str(base / "model.safetensors"))
    adapter = {}
    for name, value in weights.items():
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module.rpartition(".")[2] not in IDLM_LORA_TARGETS:
            continue
        out_dim, in_dim = value.shape
        prefix = f"base_model.model.{module}"
        adapter[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
        adapter[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_dim, rank)) * 0.5).astype(np.float32)
    save_file(adapter, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(IDLM_LORA_TARGETS),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": str(base),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
