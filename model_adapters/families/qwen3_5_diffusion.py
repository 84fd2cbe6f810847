"""Trida2.0 / FLARE: the Qwen3.5 hybrid (gated delta + gated attention) decoded by self-speculation.

The checkpoints are mlx-lm's own `qwen3_5` (Trida2.0-4B's raw text layout says `qwen3_5_text`,
FLARE's `qwen3_5` with a text_config) with a `block_diffusion.json` sidecar {bd_size, mask_id}
or FLARE's architecture name; model_adapters.evidence loads them under this module's model type,
and only them (an ordinary Qwen3.5 stays mlx-lm's). The weights, their names and sanitising,
the layers and quantisation are mlx-lm's `qwen3_5` unchanged: `Model` is that model.

What differs is the decoding forward (trillion-labs/trida-stack inference/mlx/trida_mlx/model.py
`canvas`, after the SGLang reference `HybridDiffusionSelfSpec`, variant `bd_bidir_shift`, block
2N - 1): over a window [pending, drafts, masks] after the cache,
- the first `clean` rows (the pending token and the drafts) are the ordinary causal computation,
  so their logits are the autoregressive ones;
- the mask rows after them see the whole window in the attention layers, and in the gated-delta
  layers read the recurrent state at the window's end (the state after every row, masks
  included) instead of the state at their own position;
- nothing is kept until `keep`: the attention layers' keys and values are trimmed to the
  accepted prefix, and a gated-delta layer's state after the accepted prefix is recomputed from
  the state before the window and the accepted rows' keys, values and gates (a recurrent state
  cannot be trimmed); its convolution window is cut from the rows before the window and the
  accepted rows.
A cold round (no drafts) is causal in every row, as the reference's (its mask rows after the
first N are never read). The decoder is I-DLM's (mlx_lm_diffusion.decoding.decoders.introspective),
which passes `clean`; greedy output is greedy autoregressive decoding token for token.

FLARE's and Trida's diffusion mode (trida-stack's `hybrid_diffusion_shift` configuration) is not
decoded here: its block-end readout is published only in PolyForm-Noncommercial code, and the
Apache-2.0 MLX port decodes the self-speculative mode only; a commit rule is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from model_adapters.base import NO_SETUP, DecodeSetup, FamilyDefaults, _check_numbers
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.runtime.prompt_cache import TokenCache

SIDECAR = "block_diffusion.json"
FLARE_ARCHITECTURE = "Qwen3_5DLLMForConditionalGeneration"


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict = field(default_factory=dict)
    mask_token_id: Optional[int] = None  # the sidecar's mask_id (evidence puts it here)
    bd_size: int = 8  # the block size it was trained with (the sidecar's)
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[int] = None
    text: Any = None  # mlx-lm's qwen3_5.TextModelArgs

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        args = super().from_dict(params)
        nested = params.get("text_config")
        text = dict(nested) if isinstance(nested, dict) else {k: v for k, v in params.items() if k != "text_config"}
        for key in ("tie_word_embeddings", "eos_token_id"):  # (FLARE's layout keeps them at the top)
            if key in params and key not in text:
                text[key] = params[key]
        if args.eos_token_id is None:
            args.eos_token_id = text.get("eos_token_id")
        args.text_config = text
        args.text = qwen3_5.TextModelArgs.from_dict(text)
        _check_numbers(args.text)
        if args.bd_size < 1:
            raise ValueError(f"{SIDECAR}'s bd_size must be at least 1, got {args.bd_size}")
        if args.text.num_experts:
            raise ValueError("a mixture-of-experts Qwen3.5 (qwen3_5_moe) block-diffusion checkpoint is not supported")
        return args


class Model(qwen3_5.Model):
    """mlx-lm's qwen3_5 model (the same weights, names, sanitising and quantisation), plus the
    self-speculative window forward (`window`) and its commit (`keep`)."""

    @property
    def vocab_size(self) -> int:
        return self.args.text.vocab_size

    @property
    def max_length(self) -> Optional[int]:
        return self.args.text.max_position_embeddings

    def make_cache(self) -> list:
        """mlx-lm's prompt cache for a diffusion model: the tokens a conversation holds."""
        return [TokenCache()]

    def sanitize(self, weights: dict) -> dict:
        weights = super().sanitize(weights)
        if self.args.text.tie_word_embeddings:  # (Trida ships the tied head too; mlx-lm keeps it prefixed)
            for key in [k for k in weights if k.startswith("language_model.lm_head.")]:
                weights.pop(key)
        return weights

    def shard(self, group: Any = None) -> None:
        """Refused: the window forward reads the gated-delta layers' projections itself, without
        the all-sums mlx-lm's sharded layer adds (untested across processes, so not offered)."""
        raise ValueError(
            "tensor parallelism is not supported for Trida2.0 / FLARE checkpoints; run them on one process"
        )

    def make_state(self) -> list:
        """One decode's cache: per layer a KVCache (attention) or a Recurrent (gated delta)."""
        return [Recurrent() if layer.is_linear else KVCache() for layer in self.layers]

    def window(self, tokens: mx.array, state: list, offset: int, clean: int) -> tuple:
        """Logits (1, L, V) of `tokens` (1, L) after the `offset` positions `state` holds: rows
        before `clean` causal, the later (mask) rows over the whole window and the gated-delta
        state at its end. Returns (logits, pending): `keep(state, pending, offset, n)` then keeps
        the window's first n rows."""
        text = self.language_model
        h = text.model.embed_tokens(tokens)
        mask = attention_mask(tokens.shape[1], offset, clean)
        pending = []
        for layer, c in zip(self.layers, state):
            x = layer.input_layernorm(h)
            if layer.is_linear:
                r, written = recurrent_window(layer.linear_attn, x, c, clean)
                pending.append(written)
            else:
                r = layer.self_attn(x, mask, c)
                pending.append(None)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = text.model.norm(h)
        logits = text.model.embed_tokens.as_linear(h) if text.args.tie_word_embeddings else text.lm_head(h)
        return logits, pending

    @staticmethod
    def keep(state: list, pending: list, offset: int, n: int) -> None:
        """Keep the first `n` rows (at most its clean ones) of the window `pending` came from,
        which followed `offset` positions: trim the keys and values, recompute the recurrences."""
        for i, (c, written) in enumerate(zip(state, pending)):
            if written is None:
                c.trim(c.offset - (offset + n))
            else:
                state[i] = written.after(n)


@dataclass
class Recurrent:
    """A gated-delta layer's state: the last K - 1 rows before its convolution and the
    recurrence's state (None: zeros, before the first position)."""

    conv: Optional[mx.array] = None
    ssm: Optional[mx.array] = None


@dataclass
class WindowRows:
    """What a gated-delta layer saw of a window: enough to give its state after any accepted
    prefix of the clean rows without running the model again."""

    before: Recurrent
    conv_input: mx.array  # (1, K - 1 + L, C): the rows before the window, then the window's
    q: mx.array  # (1, clean, Hk, Dk) ... the clean rows' recurrence inputs
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    after_clean: mx.array  # the state after every clean row
    layer: Any

    def after(self, n: int) -> Recurrent:
        clean = self.q.shape[1]
        if not 0 < n <= clean:
            raise RuntimeError(f"a window keeps 1 to {clean} of its rows, not {n}")
        conv = self.conv_input[:, n : n + self.layer.conv_kernel_size - 1]
        if n == clean:
            ssm = self.after_clean
        else:
            lin = self.layer
            _, ssm = gated_delta_update(
                self.q[:, :n],
                self.k[:, :n],
                self.v[:, :n],
                self.a[:, :n],
                self.b[:, :n],
                lin.A_log,
                lin.dt_bias,
                self.before.ssm,
                use_kernel=not lin.training,
            )
        return Recurrent(conv, ssm)


def recurrent_window(lin: nn.Module, x: mx.array, state: Recurrent, clean: int) -> tuple:
    """mlx-lm's GatedDeltaNet over a window (its own projections, convolution and recurrence),
    rows from `clean` on reading the state at the window's end; nothing is stored."""
    B, L, _ = x.shape
    qkv = lin.in_proj_qkv(x)
    z = lin.in_proj_z(x).reshape(B, L, lin.num_v_heads, lin.head_v_dim)
    b, a = lin.in_proj_b(x), lin.in_proj_a(x)
    before = state.conv if state.conv is not None else mx.zeros((B, lin.conv_kernel_size - 1, lin.conv_dim), qkv.dtype)
    conv_input = mx.concatenate([before, qkv], axis=1)
    conv_out = nn.silu(lin.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, L, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [lin.key_dim, 2 * lin.key_dim], -1),
            [lin.num_k_heads, lin.num_k_heads, lin.num_v_heads],
            [lin.head_k_dim, lin.head_k_dim, lin.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=lin.head_k_dim**-0.5, eps=1e-6)
    use_kernel = not lin.training
    y, after_clean = gated_delta_update(
        q[:, :clean],
        k[:, :clean],
        v[:, :clean],
        a[:, :clean],
        b[:, :clean],
        lin.A_log,
        lin.dt_bias,
        state.ssm,
        use_kernel=use_kernel,
    )
    if clean < L:  # the mask rows: the state after the whole window, read by each row's query
        _, at_end = gated_delta_update(
            q[:, clean:],
            k[:, clean:],
            v[:, clean:],
            a[:, clean:],
            b[:, clean:],
            lin.A_log,
            lin.dt_bias,
            after_clean,
            use_kernel=use_kernel,
        )
        queries = mx.repeat(q[:, clean:], lin.num_v_heads // lin.num_k_heads, axis=2)
        read = mx.einsum("bhvk,bthk->bthv", at_end, queries.astype(at_end.dtype)).astype(y.dtype)
        y = mx.concatenate([y, read], axis=1)
    out = lin.out_proj(lin.norm(y, z).reshape(B, L, -1))
    return out, WindowRows(
        state, conv_input, q[:, :clean], k[:, :clean], v[:, :clean], a[:, :clean], b[:, :clean], after_clean, lin
    )


def attention_mask(L: int, offset: int, clean: int) -> Any:
    """Rows before `clean` causal over the cache and the window; the later rows see it all."""
    if clean >= L:
        return "causal" if L > 1 else None
    rows = mx.arange(L)[:, None]
    cols = mx.arange(L)[None, :]
    window = (cols <= rows) | (rows >= clean)
    return mx.concatenate([mx.ones((L, offset), mx.bool_), window], axis=1)


@dataclass
class _State:
    cache: list  # per layer: KVCache or Recurrent, positions [0, length)
    length: int = 0
    pending: Optional[list] = None  # the last window's per-layer rows, until `keep`
    seed: Optional[mx.array] = None  # (1, V) the prompt's last logits: the first token


class Adapter(_BaseAdapter):
    """Self-speculation on the hybrid: I-DLM's rounds, this family's window forward."""

    family = "Trida2.0 / FLARE"
    decoder = "introspective"
    # trida-stack's served setting (inference/configs/trida_self_spec_b7_g4.yaml: block 7, gen 4)
    defaults = FamilyDefaults(block_length=4, strategy="low_confidence")
    suffix_refusal = "its attention is causal: a token never sees text after it"
    likelihood_layout = "prefix"

    def start(self, prompt: mx.array, reuse: Any = None, setup: DecodeSetup = NO_SETUP) -> _State:
        if prompt.shape[0] != 1:
            raise ValueError(f"{self.family} decodes one row at a time")
        state = _State(self.model.make_state())
        state.seed = self.verify(state, prompt)[:, -1]
        self.keep(state, prompt.shape[1])
        return state

    def block_seed(self, state: _State, canvas: mx.array, start: int) -> Optional[mx.array]:
        return state.seed

    def predict(self, state: _State, canvas: mx.array, start: int, end: int) -> mx.array:
        raise RuntimeError(f"{self.family} decodes by self-speculation, whose forwards are verify passes")

    def verify(self, state: _State, window: mx.array, clean: Optional[int] = None) -> mx.array:
        """Logits (1, L, V) of `window`, the L positions after the state's: the first `clean`
        rows (all when None) causal, the rest mask rows; `keep` then keeps a prefix of them."""
        if state.pending is not None:
            raise RuntimeError("a window's rows were not kept before the next window")
        L = window.shape[1]
        logits, state.pending = self.model.window(window, state.cache, state.length, L if clean is None else clean)
        return logits

    def keep(self, state: _State, length: int) -> None:
        """Keep positions [0, length): the last window's first length - state.length rows."""
        if state.pending is None:
            if length != state.length:
                raise RuntimeError(f"the state holds {state.length} positions, cannot keep {length}")
            return
        self.model.keep(state.cache, state.pending, state.length, length - state.length)
        state.pending, state.length = None, length
