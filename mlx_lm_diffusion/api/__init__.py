"""The Python door: load, generate, stream_generate, generate_batch, install(), mlx-lm's calling convention and the step-schedule protocol."""
