"""The mlx-lm-compatible API: streaming contract, EOS, options, batching, bad input."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import GenerationResponse
from mlx_lm.sample_utils import make_sampler

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.commit_rules import RULES
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, MASK_ID, VOCAB

PROMPT = [72, 101, 108, 108, 111, 44, 32]


def boost_eos_at(generated, prompt_len=len(PROMPT)):
    """An mlx-lm logits processor (tokens so far, (1, V) logits of the next position)
    that makes the generated token at index `generated` certainly EOS."""

    def processor(tokens, logits):
        if len(tokens) != prompt_len + generated:
            return logits
        bias = mx.zeros(logits.shape)
        bias[:, EOS_ID] = 1e4
        return logits + bias

    return processor


@pytest.mark.parametrize(
    "family,options",
    [("llada", {}), ("dream", {}), ("llada", dict(threshold=0.5, editing_threshold=0.3))],
)
def test_stream_contract(family, options, request):
    model, tok = request.getfixturevalue(family)
    drafts = []
    responses = list(
        mld.stream_generate(
            model,
            tok,
            PROMPT,
            max_tokens=24,
            block_length=8,
            draft_callback=lambda s: drafts.append(s.canvas.copy()),
            **options,
        )
    )
    assert len(drafts) == responses[-1].forwards  # one draft per forward
    assert all(isinstance(r, GenerationResponse) for r in responses)
    final = drafts[-1][0]
    P = len(PROMPT)
    tokens = [r.token for r in responses]
    eos_cut = tokens[:-1] if responses[-1].finish_reason == "stop" else tokens
    assert tokens == final[P : P + len(tokens)].tolist()
    assert [r.generation_tokens for r in responses] == list(range(1, len(responses) + 1))
    assert all(r.finish_reason is None for r in responses[:-1])
    assert responses[-1].finish_reason in ("stop", "length")
    detokenizer = tok.detokenizer  # the text is mlx-lm's detokenizer over the tokens
    detokenizer.reset()
    for t in eos_cut:
        detokenizer.add_token(t)
    detokenizer.finalize()
    assert "".join(r.text for r in responses) == detokenizer.text
    # every emitted token was already final: no later draft changes it
    forwards_at = [r.forwards for r in responses]
    assert forwards_at == sorted(forwards_at)
    for i, r in enumerate(responses):
        for canvas in drafts[r.forwards - 1 :]:
            assert canvas[0, P + i] == r.token
    # prompt positions never change, and the mask never leaves the engine
    for canvas in drafts:
        assert canvas[0, :P].tolist() == PROMPT
    assert MASK_ID not in tokens
    r = responses[-1]
    assert r.prompt_tokens == P and r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory >= 0
    assert r.logprobs.shape == (VOCAB,)
    assert abs(float(mx.exp(r.logprobs).sum()) - 1) < 1e-4
    assert int(mx.argmax(r.logprobs)) == r.token  # greedy


def test_generate_equals_stream_text(llada):
    model, tok = llada
    text = mld.generate(model, tok, "Hello", max_tokens=16)
    assert text == "".join(r.text for r in mld.stream_generate(model, tok, "Hello", max_tokens=16))


def test_length_finish_and_limit(llada):
    model, tok = llada
    out = list(mld.stream_generate(model, tok, PROMPT, max_tokens=5, logits_processors=[]))
    assert len(out) <= 5
    if out[-1].finish_reason == "length":
        assert len(out) == 5


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_eos_stops_early_and_is_never_text(family, request):
    model, tok = request.getfixturevalue(family)
    responses = list(
        mld.stream_generate(model, tok, PROMPT, max_tokens=32, block_length=8, logits_processors=[boost_eos_at(3)])
    )
    assert [r.finish_reason for r in responses][-1] == "stop"
    assert len(responses) == 4 and responses[-1].token == EOS_ID
    assert tok.decode([EOS_ID]) not in "".join(r.text for r in responses)
    assert responses[-1].forwards <= 8  # only the first block was decoded


def test_batch_rows_match_single_prompts(llada, dream):
    for model, tok in (llada, dream):
        a, b = PROMPT, [80, 81, 82, 83, 84, 85, 86]
        rows = mld.generate_batch(model, tok, [a, b], max_tokens=16, block_length=8, return_token_ids=True).token_ids
        for prompt, row in zip((a, b), rows):
            single = mld.generate_batch(
                model, tok, [prompt], max_tokens=16, block_length=8, return_token_ids=True
            ).token_ids
            assert row == single[0]


@pytest.mark.parametrize("strategy", RULES)
def test_every_rule_finishes_within_its_bound(llada, strategy):
    model, tok = llada
    steps = 3
    responses = list(
        mld.stream_generate(model, tok, PROMPT, max_tokens=16, block_length=8, steps=steps, strategy=strategy, seed=0)
    )
    forwards = responses[-1].forwards
    if strategy in ("threshold", "factor", "entropy_bound", "entropy_bounded"):
        assert forwards <= 16  # at least one commit per step
    else:
        assert forwards <= 2 * steps  # a fixed schedule ends within its steps


def test_threshold_commits_every_confident_token(llada):
    model, tok = llada
    # threshold 0 commits the whole block in one step; 1.0 exactly one per step
    fast = list(mld.stream_generate(model, tok, PROMPT, max_tokens=16, block_length=8, threshold=0.0))
    slow = list(mld.stream_generate(model, tok, PROMPT, max_tokens=16, block_length=8, threshold=1.0))
    assert fast[-1].forwards <= 2
    assert slow[-1].forwards == len(slow) or slow[-1].finish_reason == "stop"


def test_sampling_is_seeded(llada):
    model, tok = llada
    kw = dict(max_tokens=16, sampler=make_sampler(1.0, 0.9))
    a = mld.generate(model, tok, PROMPT, seed=3, **kw)
    b = mld.generate(model, tok, PROMPT, seed=3, **kw)
    assert a == b


BAD_OPTIONS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(block_length=0), "block_length"),
    (dict(steps=0), "steps"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=-0.1), "threshold"),
    (dict(editing_threshold=2.0), "editing_threshold"),
    (dict(max_post_steps=-1), "max_post_steps"),
    (dict(strategy="low_confidence", threshold=0.5), "threshold"),
    (dict(strategy="nope"), "strategy"),
]


@pytest.mark.parametrize("options,word", BAD_OPTIONS)
def test_bad_options_raise_before_any_output(llada, options, word):
    model, tok = llada
    kw = dict(max_tokens=8) | options
    with pytest.raises(ValueError, match=word):
        next(mld.stream_generate(model, tok, PROMPT, **kw))


def test_max_tokens_past_the_context_is_capped(llada):
    """Issue 12: a max_tokens past the model's context decodes what fits, ending with
    finish_reason "length" (it used to be an error)."""
    model, tok = llada
    room = model.max_length - len(PROMPT)
    capped = list(mld.stream_generate(model, tok, PROMPT, max_tokens=room + 300, block_length=room, threshold=0.0))
    assert len(capped) <= room
    if capped[-1].finish_reason == "length":
        assert len(capped) == room
    with pytest.raises(ValueError, match="context"):  # a prompt that fills the context still fails
        mld.generate(model, tok, [65] * model.max_length, max_tokens=4)


def test_mask_token_never_enters_the_canvas_from_a_prompt(llada):
    model, tok = llada
    with pytest.raises(ValueError, match="mask token"):
        mld.generate(model, tok, "Say <|mdm_mask|> now", max_tokens=4)
    with pytest.raises(ValueError, match="mask token"):
        mld.generate(model, tok, PROMPT + [MASK_ID], max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        mld.generate(model, tok, [], max_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        mld.generate(model, tok, [VOCAB + 5], max_tokens=4)


def test_unsupported_model_type_names_the_families(tmp_path, llada_path):
    import json
    import shutil

    shutil.copytree(llada_path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="llada.*Dream"):
        mld.load(str(tmp_path / "m"))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_load_after_convert(tmp_path, llada_path, bits):
    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / f"q{bits}"
    convert(str(llada_path), str(out), quantize=True, q_bits=bits)
    model, tok = mld.load(str(out))
    assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    full, _ = mld.load(str(llada_path))
    ids = mx.array([PROMPT])
    q, f = np.array(model(ids)).ravel(), np.array(full(ids)).ravel()
    corr = np.corrcoef(q, f)[0, 1]  # quantization noise, not a different model
    assert corr > (0.999 if bits == 8 else 0.95)
    text = mld.generate(model, tok, PROMPT, max_tokens=8)
    assert isinstance(text, str)


def test_plain_convert_reloads_identically(tmp_path, dream_path, dream):
    from mlx_lm_diffusion.cli.convert import convert

    convert(str(dream_path), str(tmp_path / "mlx"))
    model, _ = mld.load(str(tmp_path / "mlx"))
    ids = mx.array([PROMPT])
    assert float(mx.abs(model(ids) - dream[0](ids)).max()) == 0.0


def test_importing_the_cli_module_keeps_generate_the_function():
    import importlib

    cli = importlib.import_module("mlx_lm_diffusion.cli.generate")
    assert callable(mld.generate) and mld.generate is cli.generate
    from mlx_lm_diffusion import generate

    assert callable(generate)


@pytest.mark.parametrize("bad", [VOCAB + 5, -1, MASK_ID])
def test_a_sampler_returning_an_id_outside_the_vocabulary_is_a_clear_error(llada, bad):
    """Issue 13 part 3: whatever a sampler returns, no id past the vocabulary (read out of
    bounds by the embedding) and never the mask token enters the canvas."""
    model, tok = llada
    sampler = lambda logprobs: mx.full((logprobs.shape[0],), bad, mx.int32)  # noqa: E731
    with pytest.raises(ValueError, match="sampler returned token ids"):
        mld.generate(model, tok, PROMPT, max_tokens=8, block_length=4, sampler=sampler)
    good = mld.generate(model, tok, PROMPT, max_tokens=8, block_length=4)  # the next decode is fine
    assert good == mld.generate(model, tok, PROMPT, max_tokens=8, block_length=4)


def test_tiny_temperatures_decode_greedily(llada):
    """Issue 13 part 3: a temperature below a float32-safe epsilon is greedy decoding, not
    log-probs overflowing to inf / NaN."""
    model, tok = llada
    kw = dict(max_tokens=8, block_length=8, steps=8)
    greedy = mld.generate(model, tok, PROMPT, temperature_schedule=[0.0] * 8, **kw)
    assert mld.generate(model, tok, PROMPT, temperature_schedule=[1e-38] * 8, seed=3, **kw) == greedy


def test_load_applies_a_lora_adapter(llada_path, tmp_path):
    """load(adapter_path=...) (mlx-lm's load_adapters over a diffusion model's layers) decodes
    as the in-memory model with the same LoRA weights does, and not as the base model."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, tok = mld.load(str(llada_path))
    base = mld.generate(model, tok, "Hello", max_tokens=8, block_length=8)
    model.freeze()
    params = {"rank": 4, "dropout": 0.0, "scale": 20.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(0)
    for _, module in model.named_modules():
        if hasattr(module, "lora_b"):  # (initialised to zero: the adapter would change nothing)
            module.lora_b = mx.random.normal(module.lora_b.shape) * 0.5
    tuned = mld.generate(model, tok, "Hello", max_tokens=8, block_length=8)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (adapter / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params})
    )
    loaded, loaded_tok = mld.load(str(llada_path), adapter_path=str(adapter))
    assert mld.generate(loaded, loaded_tok, "Hello", max_tokens=8, block_length=8) == tuned != base


def _decode(model, tok, **options):
    out = list(mld.stream_generate(model, tok, PROMPT, max_tokens=16, block_length=8, **options))
    return [r.token for r in out], out[-1].forwards


def test_an_explicit_strategy_replaces_the_presets_rule(llada):
    """preset="fast" is threshold 0.9 with the dual cache: a strategy of one's own keeps the
    cache and drops the preset's threshold (it was refused: 'threshold applies to ...')."""
    model, tok = llada
    assert _decode(model, tok, preset="fast", strategy="factor") == _decode(model, tok, cache="dual", strategy="factor")
    assert _decode(model, tok, preset="fast", threshold=0.5) == _decode(model, tok, cache="dual", threshold=0.5)


def test_a_rule_setting_selects_its_rule_or_is_refused(llada):
    """Like threshold, factor and entropy_bound select the rule that reads them (they were
    silently ignored under the family's low_confidence); one the rule would not read is an
    error, a schedule's included."""
    model, tok = llada
    assert _decode(model, tok, factor=2.0) == _decode(model, tok, strategy="factor", factor=2.0)
    assert _decode(model, tok, entropy_bound=2.0) == _decode(model, tok, strategy="entropy_bound", entropy_bound=2.0)
    assert _decode(model, tok, factor=2.0)[1] < _decode(model, tok)[1]
    with pytest.raises(ValueError, match="factor applies to the factor strategies, not 'low_confidence'"):
        _decode(model, tok, strategy="low_confidence", factor=2.0)
    with pytest.raises(ValueError, match="threshold does not apply to a mask schedule"):
        _decode(model, tok, schedule="cosine", threshold=0.9)
    with pytest.raises(ValueError, match="threshold and entropy_bound each select a rule"):
        _decode(model, tok, threshold=0.9, entropy_bound=2.0)


@pytest.mark.parametrize("options", [dict(sampler="greedy"), dict(logits_processors=[None])])
def test_samplers_and_processors_must_be_callables(llada, options):
    """(they were a TypeError from inside the decode)"""
    model, tok = llada
    with pytest.raises(ValueError, match="must be a callable"):
        _decode(model, tok, **options)


@pytest.mark.parametrize("prompt", [["\x00"], ["7", "8"], [7.9], [True]])
def test_a_prompt_of_other_than_text_or_ids_is_a_clear_error(llada, prompt):
    """(int() read ["7"] and [7.9] as ids, and ["\x00"] failed with 'invalid literal for int()')"""
    model, tok = llada
    with pytest.raises(ValueError, match="prompt must be text or a list of token ids"):
        mld.generate(model, tok, prompt, max_tokens=4)


def test_a_misspelt_option_says_what_was_meant_and_editing_is_documented_for_llada():
    """Issue 54.5: the Python API suggests the option meant (as the server does); token
    editing applies to every masked family, as docs/options-and-commit-rules.md says (on
    the demo, not trained for it, 0.5 turns 825 into 824)."""
    from mlx_lm_diffusion.demo import load_demo

    model, tokenizer = load_demo()
    with pytest.raises(TypeError, match="did you mean 'threshold'"):
        mld.generate(model, tokenizer, "357+468=", treshold=0.5)
    assert mld.generate(model, tokenizer, "357+468=", max_tokens=8, editing_threshold=0.5) == "824"
    assert mld.generate(model, tokenizer, "357+468=", max_tokens=8) == "825"
