"""The next demo model, work in progress (issue 12 part 1): not shipped yet.

The task widened to operands of 1 to 4 digits (0-9999), every answer followed by EOS
padding over training canvases of 16 to 528 positions (so that any max_tokens up to the
context would give the same answer), a chat template that renders the last user message
as is, decoding defaults in generation_config.json, and an evaluation that takes
max_tokens and a threshold:

    python -m mlx_lm_diffusion.demo.next.train --out DIR          # seed 0, 1400 steps
    python -m mlx_lm_diffusion.demo.next.evaluate --model DIR --max-tokens 8 64 512

Status (measured): the default run (0.26M parameters, d_model 64, 4 layers, RoPE base 500,
1400 steps of ~4096 tokens, seed 0) did not learn the wider task within the budget:
30.6 min wall (15.7 CPU-minutes; other jobs shared the 2 cores, ~3,000 tokens/s), final
loss 0.355, held-out exact match (256 problems, `next.evaluate`) 4.3 % at max_tokens 8 and
6.2 % at 64, at the defaults (block 32, one token per step) and with threshold 0.9 alike,
every answer stopped at EOS (100 %), and the answers agree across canvas lengths: the EOS
padding and the length robustness are learned, the carries and column alignment are not
(about 240k training examples were too few for this model). Where it fails: the answer's
length is right 91 % of the time and its leading digit 81-89 %, but its units digit only
8-19 % (chance): the answer's place values sit at positions that move with its length
(the digits are written most significant first), and the model has not learned to find
them (a units digit = the last digit before the first EOS, a relative offset that depends
on content). An earlier run without the
4-digit padding (operands as typed, RoPE base 1000) was at 1.2 % after 1600 steps. The
shipped demo
(`mlx_lm_diffusion/demo/model`) is still the 3-digit model.
See the module docstrings for the data, masking and weighting; the tokenizer here writes
every number with 4 digits (zeros in front) so that operands stand in fixed columns.
"""
