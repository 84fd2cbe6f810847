"""Tiny random checkpoints of every family in its released on-disk layout, written offline.

    python -m mlx_lm_diffusion.testing OUT_DIR [--families llada dream ...]

writes one directory per family under OUT_DIR (config.json as released, Hugging Face weight
names, a byte-level tokenizer with the family's special tokens and chat template), so every
door (load, generate, the CLIs, the server, install()) can be tried offline, and downstream
projects can test against the same layouts this project's tests use. The weights are random:
the checkpoints load, decode and serve, their text is noise. DiffusionGemma's are made with
transformers' own model class (torch, in the `test` extra); its vision checkpoint adds
mlx-vlm's processor (the `vision` extra).
"""
