"""The engine run to the end of its canvas, as the reference loops are (no EOS stop)."""

import mlx.core as mx

from mlx_lm_diffusion.engine import Engine
from mlx_lm_diffusion.options import DecodeOptions, resolve
from model_adapters import adapter_for


def engine_decode(model, tokenizer, prompt, **options):
    """(generated tokens of the whole canvas, forwards) of one prompt, EOS not stopping it."""
    adapter = adapter_for(model, tokenizer)
    adapter.eos_ids = frozenset()  # fill the whole canvas, as the references do
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    last = None
    for last in Engine(adapter, resolved).run(mx.array([prompt])):
        pass
    return last.canvas[0, len(prompt):].tolist(), last.forwards
