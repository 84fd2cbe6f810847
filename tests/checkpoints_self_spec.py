"""Tiny Nemotron-Labs Diffusion checkpoints whose drafts the causal pass accepts (in part).

Random weights draft almost nothing the causal pass agrees with, so self-speculation would
accept only its bonus token per window and the acceptance path (and the cache trimming
after a partly accepted window) would go untested. `write_speculable_nemotron` writes the
usual random checkpoint and then adds one shared direction to every embedding and to the
head rows of a few "attractor" tokens: both attention modes then propose mostly those
tokens, and which one depends on the content, so drafts are accepted in part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron

ATTRACTORS = (40, 41, 42)


def write_speculable_nemotron(path: Path, attractors=ATTRACTORS, strength: float = 1.0, seed: int = 0,
                              **dims) -> Path:
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
