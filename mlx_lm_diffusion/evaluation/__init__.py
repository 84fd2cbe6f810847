"""lm-evaluation-harness for diffusion models: accuracy against speed.

    noise        the Monte Carlo masks of the likelihood bound (LLaDA's stratified draws)
    layout       which bound a family's attention implies, over which blocks
    likelihood   the bound's estimate of log p(continuation | context), and is_greedy
    generation   generate_until through the engine's running batch, stopped at `until`
    speed        tokens, forwards and seconds per task
    harness      lm-eval's `LM` (DiffusionLM; needs lm-eval: the eval extra)
    tasks        lm-eval's task index for the tasks asked for (needs lm-eval)
    sweep        --sweep's settings
    report       the table and the plot
    command      the CLI (`python -m mlx_lm_diffusion.evaluate`)

Only `harness`, `tasks` and what the CLI runs import lm-eval, so the rest (and the
CLI's refusal without it) works without the extra.
"""
