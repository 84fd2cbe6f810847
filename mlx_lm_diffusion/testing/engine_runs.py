"""The engine run to the end of its canvas, as the reference loops are (no EOS stop)."""

import mlx.core as mx

from mlx_lm_diffusion.decoding import DecodeOptions, Engine, resolve
from model_adapters import adapter_for


def engine_decode(model, tokenizer, prompt, **options):
    """(generated tokens of the whole canvas, forwards) of one prompt, EOS not stopping it."""
    adapter = adapter_for(model, tokenizer)
    # fill the whole canvas, as the references do
    resolved = resolve(DecodeOptions(**options, ignore_eos=True), adapter, len(prompt))
    last = None
    for last in Engine(adapter, resolved).run(mx.array([prompt])):
        pass
    return last.canvas[0, len(prompt) :].tolist(), last.forwards


def record_batch_sizes(monkeypatch, owner, name: str) -> list:
    """Wrap `owner.name`, a batched call taking its rows' requests second (after the adapter
    or self), so that each call appends how many rows it served; returns that list."""
    sizes, wrapped = [], getattr(owner, name)

    def counted(*args, **kwargs):
        sizes.append(len(args[1]))
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return sizes
