"""A bigram checkpoint whose distributions are known exactly: the sampled self-speculative
decoders (I-DLM, Trida2.0) must draw from them as autoregressive sampling does.

Every layer's output is zeroed, so position i's logits depend on token i alone: after A,
P(A) = 0.7; after B, 0.2; after any other token (the prompt, a mask) 0.5.
"""

from __future__ import annotations

import numpy as np

A, B = 65, 66  # the only tokens it writes
BIGRAM = {"other": (0.5, 0.5), A: (0.7, 0.3), B: (0.2, 0.8)}  # P(A), P(B) after a token of each kind
LAYER_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def make_bigram(weights: dict, norm_one: float) -> dict:
    """The bigram's weights from a checkpoint's (model.embed_tokens, model.norm, an untied
    lm_head): `norm_one` is the norm weight that multiplies by one (1.0, or 0.0 where the
    checkpoint stores zero-centred norms)."""
    for name in weights:
        if name.endswith(LAYER_OUTPUTS):
            weights[name] = np.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    embed[:] = 0.0
    embed[:, 0], embed[A, 0], embed[B, 0] = 1.0, 0.0, 0.0  # (RMSNorm: sqrt(hidden) times the unit vector)
    embed[A, 1] = embed[B, 2] = 1.0
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], norm_one)
    head = np.full_like(weights["lm_head.weight"], -40.0 / np.sqrt(hidden))
    head[:, 3:] = 0.0
    for column, kind in enumerate(("other", A, B)):
        p = BIGRAM[kind]
        head[A, column], head[B, column] = np.log(p[0]) / np.sqrt(hidden), np.log(p[1]) / np.sqrt(hidden)
    weights["lm_head.weight"] = head
    return weights


def sequences(length: int, first: tuple) -> dict:
    """P(sequence) of `length` tokens under the bigram chain, from `first` = P(A), P(B)."""
    out = {(): 1.0}
    for _ in range(length):
        step = {}
        for seq, p in out.items():
            pa = (BIGRAM[seq[-1]] if seq else first)[0]
            step[seq + (A,)], step[seq + (B,)] = p * pa, p * (1 - pa)
        out = step
    return out


def distance(counts: dict, exact: dict) -> float:
    """Total variation between observed counts and the exact distribution."""
    runs = sum(counts.values())
    return 0.5 * sum(abs(counts.get(seq, 0) / runs - p) for seq, p in exact.items())
