"""The contracts between a model family, mlx-lm and the decoding engine.

A family's `ModelArgs` (a `DiffusionArgs`) reads config.json: its own fields, plus the
text backbone's mlx-lm ModelArgs (`args.text`), built by that mlx-lm module's `from_dict`
after the family's renames. Its `Model` (a `DiffusionModel`) is the glue mlx-lm and the
adapters expect (`DiffusionLM`): backbone, head, vocab_size, max_length, layers,
make_cache, an idempotent sanitize. Its `Adapter` wires the family's decoding specifics
(mask token, attention layout, logit shift, cache, reference defaults) behind four calls.
The engine never sees any of that; an adapter never sees commit rules, schedules or
streaming.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Optional, Protocol, Union, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs

from model_adapters.runtime.prompt_cache import TokenCache
from model_adapters.runtime.sharding import attention_sizes, shard_mlx_lm_layers, shard_model, shard_vocabulary


@dataclass(frozen=True)
class FamilyDefaults:
    """A family's reference decoding settings (what its own demo code uses)."""

    block_length: Optional[int]  # None: the whole generation is one block
    strategy: str
    steps: Optional[int] = None  # None: one denoising step per block position
    threshold: Optional[float] = None
    editing_threshold: Optional[float] = None  # None: committed tokens never change
    max_post_steps: int = 16  # editing passes allowed once a block has no masks
    entropy_bound: Optional[float] = None  # None: the entropy rules' own default


@dataclass(frozen=True)
class DecodeSetup:
    """What one decode tells its adapter (`Adapter.start`, `Adapter.reuse_length`): its
    resolved options (mlx_lm_diffusion.decoding.options.ResolvedOptions; the family's own
    in `options.family`) and its inputs besides the token ids (`vision`: the images'
    inputs, DiffusionGemma). An adapter keeps what it reads of it in the decode's state,
    never on itself: one adapter serves every row of a running batch, and the rows may
    differ in it. Without options: the family's defaults."""

    options: Any = None
    vision: Any = None

    def family(self, name: str, default: Any = None) -> Any:
        """The family option `name` of this decode (`default` where it has none)."""
        family = getattr(self.options, "family", None) or {}
        return family.get(name, default)


NO_SETUP = DecodeSetup()  # (a decode started without options: the family's defaults)


@dataclass
class DiffusionArgs(BaseModelArgs):
    """config.json of a diffusion family. Subclasses declare the family's own fields
    (the mask id, the attention block, what they refuse) and name the mlx-lm module of
    the text backbone (`text_module`), the config keys it spells otherwise (`renames`:
    config key -> mlx-lm's name) and the family's defaults for keys a config may omit
    (`text_defaults`). `from_dict` then builds `text`, that module's ModelArgs."""

    model_type: str
    mask_token_id: Optional[int] = None  # None: the tokenizer's mask token
    eos_token_id: Optional[Union[int, list]] = None
    pad_token_id: Optional[int] = None
    text: Any = None  # the text backbone's mlx-lm ModelArgs, built by from_dict

    text_module: ClassVar[ModuleType]
    renames: ClassVar[dict] = {}
    text_defaults: ClassVar[dict] = {}

    @classmethod
    def from_dict(cls, params: dict) -> "DiffusionArgs":
        args = super().from_dict(params)
        try:
            text = args.text_config(params)
        except ZeroDivisionError:
            raise ValueError("config.json's num_attention_heads (or n_heads) must be positive") from None
        args.text = cls.text_module.ModelArgs.from_dict(text)
        _check_numbers(args.text)
        return args

    def text_config(self, params: dict) -> dict:
        """`params` as the text backbone's ModelArgs reads them; a key set to None counts
        as absent (LLaDA writes `n_kv_heads: null`, meaning one KV head per head)."""
        config = {**self.text_defaults, **{k: v for k, v in params.items() if v is not None}}
        config.update({new: params[old] for old, new in self.renames.items() if params.get(old) is not None})
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        config["model_type"] = self.text_module.__name__.rpartition(".")[2]
        return config


# Backbone fields that must be positive (a rope_theta of 0 loaded and decoded NaN rotations)
POSITIVE_FIELDS = (
    "rope_theta",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "head_dim",
    "vocab_size",
)


def _check_numbers(args: Any) -> None:
    """Refuse (ValueError) a config whose numeric fields hold something else: a string
    rope_theta loaded and failed at the first forward, deep inside a kernel call; or a
    size or rope_theta that is not positive and finite."""
    try:
        hints = typing.get_type_hints(type(args))
    except Exception:  # (a backbone's annotations this Python cannot resolve: nothing checked)
        return
    for f in dataclasses.fields(args):
        kind, value = hints.get(f.name), getattr(args, f.name, None)
        if kind not in (int, float) or value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or kind is int and not isinstance(value, int):
            raise ValueError(
                f"config.json's {f.name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            )
        if f.name in POSITIVE_FIELDS and not (0 < value < math.inf):
            raise ValueError(f"config.json's {f.name} must be positive, got {value!r}")


@runtime_checkable
class DiffusionLM(Protocol):
    """What the masked-canvas adapters read from a loaded model (every family's `Model`;
    DiffusionGemma's uniform-noise adapter calls its `encode` and `decode` instead of
    `backbone`)."""

    args: Any  # model_type, mask_token_id, eos_token_id, pad_token_id
    vocab_size: int  # the logits' last axis
    max_length: Optional[int]  # the longest sequence the positions cover
    layers: list  # one entry per KV cache layer

    def backbone(self, inputs: mx.array, mask: Any = None, cache: Optional[list] = None) -> mx.array:
        """Final hidden states (B, L, H); `mask` None: bidirectional attention."""

    def head(self, hidden: mx.array) -> mx.array:
        """Logits (..., vocab_size) of hidden states."""


class LayerStack(nn.Module):
    """Embeddings, an mlx-lm block class repeated, the final norm: the backbone of the
    families built from mlx-lm's plain layers (llama, qwen2, qwen3). Unlike mlx-lm's own
    model classes it builds no causal mask: the caller owns the attention layout."""

    embedding_name: ClassVar[str] = "embed_tokens"

    def __init__(self, args: Any, block: type):
        super().__init__()
        setattr(self, self.embedding_name, nn.Embedding(args.vocab_size, args.hidden_size))
        self.layers = [self.layer(block, args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def layer(self, block: type, args: Any, index: int) -> nn.Module:
        return block(args)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        h = getattr(self, self.embedding_name)(inputs)
        cache = cache or [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class DiffusionModel(nn.Module):
    """The glue a family's `Model` shares with every other: the backbone under
    `backbone_name`, an output head under `head_name` unless the config ties it to the
    embeddings (`embedding_name` below the backbone), mlx-lm's `layers` and
    `make_cache`, and an idempotent `sanitize`. Hooks: `rename` (checkpoint names) and
    `attention_mask` (None: the bidirectional attention the masked families train with)."""

    backbone_name: ClassVar[str] = "model"
    head_name: ClassVar[str] = "lm_head"
    embedding_name: ClassVar[str] = "embed_tokens"

    def __init__(self, args: Any, backbone: nn.Module):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        setattr(self, self.backbone_name, backbone)
        if not self.tied:
            setattr(self, self.head_name, nn.Linear(args.text.hidden_size, self.vocab_size, bias=False))

    @property
    def tied(self) -> bool:
        return bool(self.args.text.tie_word_embeddings)

    @property
    def vocab_size(self) -> int:
        return self.args.text.vocab_size

    @property
    def max_length(self) -> Optional[int]:
        return self.args.text.max_position_embeddings

    @property
    def layers(self):
        return getattr(self, self.backbone_name).layers

    def make_cache(self) -> list:
        """mlx-lm's `make_prompt_cache(model)` returns this: one TokenCache (the tokens a
        conversation holds; the adapters build their own KV caches per decode)."""
        return [TokenCache()]

    def backbone(self, inputs: mx.array, mask: Any = None, cache: Optional[list] = None) -> mx.array:
        return getattr(self, self.backbone_name)(inputs, mask, cache)

    def head(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return getattr(getattr(self, self.backbone_name), self.embedding_name).as_linear(hidden)
        return getattr(self, self.head_name)(hidden)

    def attention_mask(self, inputs: mx.array, cache: Optional[list]) -> Any:
        return None

    # -- tensor parallelism (model_adapters.runtime.sharding)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Split the weights over `group` (mlx-lm's `Model.shard`; its `sharded_load` calls it)."""
        shard_model(self, group)

    def shard_sizes(self) -> list:
        """(what, size) pairs that the group size must divide."""
        return attention_sizes(self.args.text)

    def shard_layers(self, group: mx.distributed.Group) -> None:
        """The backbone's attention and MLPs: mlx-lm's own sharding of its module."""
        shard_mlx_lm_layers(self.args.text_module, getattr(self, self.backbone_name), group)

    def shard_vocabulary(self, group: mx.distributed.Group) -> None:
        """The embeddings and the head, split by vocabulary rows."""
        shard_vocabulary(self, group)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, mask: Any = None) -> mx.array:
        """Raw logits (B, L, V) with the attention the family trains with, unless `mask`
        is given (mlx-lm's own models would build a causal mask here)."""
        if mask is None:
            mask = self.attention_mask(inputs, cache)
        return self.head(self.backbone(inputs, mask, cache))

    def rename(self, key: str) -> Optional[str]:
        """A checkpoint's weight name -> this model's (None: the weight is dropped);
        names already converted pass through."""
        return key

    def sanitize(self, weights: dict) -> dict:
        """Renamed weights, less RoPE's cached frequencies and, when tied, the head."""
        out = {}
        for key, value in weights.items():
            key = self.rename(key)
            if key is None or "rotary_emb.inv_freq" in key:
                continue
            if self.tied and key.startswith(f"{self.head_name}."):
                continue
            out[key] = value
        return out


class Adapter:
    """Base adapter for a masked-diffusion family with full-canvas attention.

    Subclasses set `family`, `defaults` and, when needed, override `predict`
    (logit shift, caches) and `finish_block`.
    """

    family: ClassVar[str] = ""
    defaults: ClassVar[FamilyDefaults]
    align_blocks: ClassVar[bool] = False  # blocks on absolute multiples of block_length
    presets: ClassVar[dict] = {}  # named option sets (LLaDA2.1's "speed" / "quality")
    # The decoding paradigm (mlx_lm_diffusion.decoding.decoders): "masked_block" or "uniform_canvas".
    decoder: ClassVar[str] = "masked_block"
    # The family's own decoding options (model_adapters.option.Option), with their
    # defaults; the resolved values reach `start` (DecodeSetup) and the decoder as `options.family`.
    options: ClassVar[tuple] = ()
    # Why text after the current block cannot condition it (infill with a suffix is then
    # refused, mlx_lm_diffusion.output.infill); None: the attention sees the whole canvas.
    suffix_refusal: ClassVar[Optional[str]] = None
    # The likelihood bound its attention implies (mlx_lm_diffusion.evaluation.layout, also the
    # training objective's blocks): "canvas" (the whole canvas attends to itself: this base
    # class's forward), "aligned" (block-causal blocks on absolute positions), "prefix" (a
    # block over a causally encoded prefix), or None (no masked bound: uniform noise, AR)
    likelihood_layout: ClassVar[Optional[str]] = "canvas"

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        self.model = model
        args = model.args
        self.mask_id: Optional[int] = args.mask_token_id
        self.vocab_size: int = model.vocab_size
        self.max_length: Optional[int] = model.max_length
        self.eos_ids: frozenset[int] = frozenset(_stop_ids(args, tokenizer))

    @property
    def block_length(self) -> Optional[int]:
        return self.defaults.block_length

    @property
    def suppress_ids(self) -> frozenset:
        """Token ids never proposed: the mask token."""
        return frozenset() if self.mask_id is None else frozenset({self.mask_id})

    def decoder_for(self, family: Any) -> str:
        """The decoder (mlx_lm_diffusion.decoding.decoders) for a decode with these family options
        (a mapping, defaults filled in); a family with a second paradigm overrides it."""
        return self.decoder

    def check_options(self, family: dict, values: dict) -> None:
        """Refuse a combination of this family's options (`family`, defaults filled in)
        and the options set (`values`) that it cannot decode (ValueError)."""

    def check_resolved(self, options: Any) -> None:
        """Refuse resolved options (mlx_lm_diffusion.decoding.options.ResolvedOptions: the rule built,
        every default filled) that this adapter cannot decode (ValueError)."""

    # True where only the next position gets a prediction (the ar adapter): the decoding
    # layer then refuses a commit rule that would commit any other, with this message.
    predicts_next_only = False

    def next_only_refusal(self, options: Any) -> str:
        return f"{self.family} predicts only the next token; unmask one token per step"

    def family_option(self, setup: DecodeSetup, name: str) -> Any:
        """The decode's value of this family's option `name`: its resolved options', or the
        option's declared default (a decode started without options)."""
        declared = next(o for o in self.options if o.name == name)
        return setup.family(name, declared.default)

    def start(self, prompt: mx.array, reuse: Any = None, setup: DecodeSetup = NO_SETUP) -> Any:
        """Prepare a decode of `prompt` (B, P); returns the decode's state, which holds
        whatever of `setup` (the decode's options and inputs) the family reads later.
        `reuse` (a model_adapters.runtime.prefix_kv.PrefixKV, given only when
        `reuse_length` allowed it) holds the keys and values of the prompt's first
        `reuse.length` positions: prefill the rest."""
        return None

    # Prompt KV reused across decodes (model_adapters.runtime.prefix_kv). The families whose prompt
    # keys and values a cold prefill would compute identically override both; the others
    # (bidirectional attention: the KV depends on the whole canvas) reuse nothing.
    def reuse_length(self, prefix: Any, prompt: mx.array, setup: DecodeSetup = NO_SETUP) -> int:
        """How many leading positions of `prompt` (B, P) this decode (`setup`) can take
        from `prefix` (the KV of the same leading tokens from an earlier decode); 0: none."""
        return 0

    def export_prefix(self, state: Any, length: int) -> Any:
        """After (or while) a decode: a PrefixKV of at most the first `length` canvas
        positions, holding only keys and values a cold prefill of those tokens would compute
        identically (final tokens, the family's exact layout), or None."""
        return None

    def block_seed(self, state: Any, canvas: mx.array, start: int) -> Optional[mx.array]:
        """Logits (B, V) proposing the token at `start` from an earlier causal pass, or
        None when the block starts all masked."""
        return None

    def condition(self, state: Any, scaled_logits: mx.array) -> None:
        """Uniform-noise canvases: keep this step's scaled logits as the next step's
        self-conditioning input."""

    def predict(self, state: Any, canvas: mx.array, start: int, end: int) -> mx.array:
        """Logits (B, end - start, V): row i predicts the token at position start + i."""
        hidden = self.model.backbone(canvas)
        return self.model.head(hidden[:, start:end])

    def block_hidden(self, state: Any, canvas: mx.array, start: int, end: int) -> Optional[mx.array]:
        """Final hidden states (B, end - start, H) whose `model.head` gives `predict`'s
        logits (the same call: it advances caches as `predict` does), or None where the
        family's logits are not a head over hidden states it can hand out."""
        return None

    def predict_rows(self, state: Any, canvas: mx.array, start: int, end: int, rows: mx.array) -> mx.array:
        """Head over selected rows: the logits (B, K, V) `predict` gives at the block
        positions `rows` (B, K) (start-relative, distinct within a row), in that order. With
        `block_hidden` the hidden states are gathered before the head, so the output layer
        runs over K rows instead of the block's; without it, `predict`'s rows are gathered."""
        index = rows[..., None]
        hidden = self.block_hidden(state, canvas, start, end)
        if hidden is None:
            return mx.take_along_axis(self.predict(state, canvas, start, end), index, axis=1)
        return self.model.head(mx.take_along_axis(hidden, index, axis=1))

    def finish_block(self, state: Any, canvas: mx.array, start: int, end: int) -> None:
        """Called once positions [start, end) are final (a cache may store them)."""

    def predict_batch(self, requests: list) -> list:
        """The logits `predict` gives for each of many decodes' forward requests
        (mlx_lm_diffusion.decoding.decoders.Forward), from as few model calls as the family can
        batch (model_adapters.runtime.batched); here, one call per request. A request marked
        `verify` (self-speculation's verify pass) is answered by `verify`."""
        return [
            self.verify(r.state, r.canvas[:, r.start : r.end], r.clean)
            if getattr(r, "verify", False)
            else self.predict(r.state, r.canvas, r.start, r.end)
            for r in requests
        ]


def _stop_ids(args: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the config and the tokenizer; a pad id distinct from EOS stops too."""
    ids: set[int] = set()
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(args, name, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None:
        ids.update(getattr(tokenizer, "eos_token_ids", ()) or ())
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
    mask_id = getattr(args, "mask_token_id", None)
    ids.discard(mask_id)
    return ids
