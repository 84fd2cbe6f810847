"""Fine-tuning diffusion models with their own objectives on mlx-lm's trainer.

objectives   each family's training loss (LLaDA / Dream, block diffusion, AR)
validation   the validation and --test loss: the ELBO estimate, fixed seeds
batches      mlx-lm's batches, validation batches in a fixed order
command      the lora CLI (`python -m mlx_lm_diffusion.lora`)
fusing       the fuse CLI (`python -m mlx_lm_diffusion.fuse`)
"""
