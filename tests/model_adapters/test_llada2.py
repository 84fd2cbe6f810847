"""LLaDA2.0 / 2.1 (`llada2_moe`): forward parity against mlx-vlm's llada2_moe model on
the same checkpoint, decode parity against independent oracles of the LLaDA2.0 and
LLaDA2.1 (token editing) reference loops with and without the prefix cache, the same
tokens as mlx-vlm's loop, presets, the unsupported LLaDA2.2 edits, and the doors.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_arsenal.attention import block_causal_mask
from oracles import softmax

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api import generation as api  # (mld.generate is rebound if the CLI module loads)
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.block_checkpoints import LLADA2_EOS, LLADA2_MASK, write_llada2
from model_adapters import adapter_for

TOL = 1e-4
BLOCK = 32
PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 72)), list(range(100, 140))]


@pytest.fixture(scope="module")
def llada2_path(tmp_path_factory):
    return write_llada2(tmp_path_factory.mktemp("llada2"))


@pytest.fixture(scope="module")
def llada2(llada2_path):
    return mld.load(str(llada2_path))


@pytest.fixture(scope="module")
def vlm_model(llada2_path):
    from mlx_vlm.models.llada2_moe import Model, ModelConfig

    model = Model(ModelConfig.from_dict(json.loads((llada2_path / "config.json").read_text())))
    weights = model.sanitize(dict(mx.load(str(llada2_path / "model.safetensors"))))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def llada2_reference(
    model, prompt, *, gen_length, block_length, steps, threshold, mask_id, editing_threshold=None, max_post_steps=16
):
    """LLaDA2.0 `generate` (editing_threshold None) and LLaDA2.1 `generate` with token
    editing, batch 1, greedy, no cache: the window [0, block end) is recomputed with the
    block-causal mask at every step. Commit the masks with p > threshold when at least
    the step's quota (get_num_transfer_tokens(block_length, steps)) pass, else the
    quota's top-k (at most the masks left); with editing, also overwrite generated block
    tokens whose new proposal differs with p > editing_threshold, and end a block once it
    has no mask and no edit, or after max_post_steps extra passes. The mask token is
    never proposed (shared deviation); EOS stopping is left to the caller."""
    P = len(prompt)
    num_blocks = -(-(P + gen_length) // block_length)
    x = np.full(num_blocks * block_length, mask_id, dtype=np.int64)
    x[:P] = prompt
    quota = [block_length // steps + (1 if i < block_length % steps else 0) for i in range(steps)]
    editing = editing_threshold is not None
    forwards = 0
    for b in range(P // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        generated = np.arange(start, end) >= P
        step = post_steps = 0
        while step < steps or (editing and post_steps <= max_post_steps):
            masked = x[start:end] == mask_id
            if not masked.any():
                if not editing:
                    break
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            attention = block_causal_mask(end, block_length)
            logits = np.array(model(mx.array(x[None, :end]), mask=attention)[0, start:end]).astype(np.float64)
            forwards += 1
            logits[:, mask_id] = -np.inf
            probs = softmax(logits)
            x0, p = probs.argmax(-1), probs.max(-1)
            commit = np.zeros_like(masked)
            if masked.any() and step < steps:
                confidence = np.where(masked, p, -np.inf)
                high = confidence > threshold
                if high.sum() >= quota[step]:
                    commit = high
                else:
                    k = min(quota[step], int(masked.sum()))
                    commit[np.argsort(-confidence, kind="stable")[:k]] = True
            edit = np.zeros_like(masked)
            if editing:
                edit = ~masked & generated & (x0 != x[start:end]) & (p > editing_threshold)
            x[start:end] = np.where(commit | edit, x0, x[start:end])
            if not masked.any() and not edit.any():
                break
            if masked.any():
                step += 1
    return x[P : P + gen_length].tolist(), forwards


def engine_decode(model, tokenizer, prompt, use_cache=True, eos=False, **options):
    adapter = adapter_for(model, tokenizer)
    adapter.use_cache = use_cache
    if not eos:
        adapter.eos_ids = frozenset()  # fill the whole canvas, as the references do
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    last = None
    for last in Engine(adapter, resolved).run(mx.array([prompt])):
        pass
    P = len(prompt)
    return last.canvas[0, P : P + last.final[0]].tolist(), last.forwards


def whole_blocks(prompt, at_least=40):
    """A generation length that ends the canvas on a block boundary, as the reference's."""
    return at_least + (-(len(prompt) + at_least)) % BLOCK


def test_forward_matches_mlx_vlm(llada2, vlm_model):
    model, _ = llada2
    L = 70
    ids = mx.array(np.random.default_rng(0).integers(0, 256, (2, L)))
    keep = block_causal_mask(L, BLOCK) == 0  # mlx-vlm reads a keep mask
    theirs = np.array(vlm_model(ids, mask=keep).logits)
    ours = np.array(model(ids))
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= TOL
    # block-causal: the first block does not see the second; a block sees all of itself
    changed = np.array(ids)
    changed[:, 40] = (changed[:, 40] + 1) % 256
    again = np.array(model(mx.array(changed)))
    assert np.abs(again[:, :32] - ours[:, :32]).max() == 0.0
    assert np.abs(again[:, 32] - ours[:, 32]).max() > 1e-3


def test_mask_and_eos_come_from_tokenizer_and_config(llada2, llada2_path, tmp_path):
    import shutil

    model, tok = llada2
    adapter = adapter_for(model, tok)
    assert model.args.mask_token_id is None  # the released configs carry no mask id
    assert adapter.mask_id == LLADA2_MASK == tok.convert_tokens_to_ids("<|mask|>")
    assert adapter.eos_ids == {LLADA2_EOS}
    assert (adapter.block_length, adapter.attention_block, adapter.align_blocks) == (32, 32, True)
    options = resolve(DecodeOptions(max_tokens=64), adapter, 5)
    assert (options.steps, options.rule.name, options.rule.threshold, options.rule.strict) == (
        32,
        "low_confidence_dynamic",
        0.95,
        True,
    )
    assert options.editing_threshold is None  # LLaDA2.0's loop: no editing unless asked
    with pytest.raises(ValueError, match="mask token"):
        adapter_for(model, None)
    shutil.copytree(llada2_path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["mask_token_id"] = 7
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    other, other_tok = mld.load(str(tmp_path / "m"))
    assert adapter_for(other, other_tok).mask_id == 7  # an explicit config id wins


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("steps,threshold", [(32, 0.95), (8, 0.95), (5, 0.5), (32, 0.0)])
def test_llada2_0_matches_reference_with_and_without_cache(llada2, prompt, steps, threshold):
    model, tok = llada2
    gen = whole_blocks(prompt)
    ref_tokens, ref_forwards = llada2_reference(
        model, prompt, gen_length=gen, block_length=BLOCK, steps=steps, threshold=threshold, mask_id=LLADA2_MASK
    )
    for use_cache in (True, False):
        tokens, forwards = engine_decode(
            model, tok, prompt, use_cache, max_tokens=gen, steps=steps, threshold=threshold
        )
        assert tokens == ref_tokens
        assert forwards == ref_forwards
    assert LLADA2_MASK not in ref_tokens


@pytest.mark.parametrize(
    "options",
    [
        dict(preset="speed"),
        dict(preset="quality"),
        dict(preset="quality", max_post_steps=2),
        dict(threshold=0.95, editing_threshold=0.2, steps=8),
    ],
)
def test_llada2_1_editing_matches_reference_with_and_without_cache(llada2, options):
    model, tok = llada2
    prompt = PROMPTS[0]
    gen = whole_blocks(prompt)
    adapter = adapter_for(model, tok)
    resolved = resolve(DecodeOptions(max_tokens=gen, **options), adapter, len(prompt))
    ref_tokens, ref_forwards = llada2_reference(
        model,
        prompt,
        gen_length=gen,
        block_length=BLOCK,
        steps=resolved.steps,
        threshold=resolved.rule.threshold,
        mask_id=LLADA2_MASK,
        editing_threshold=resolved.editing_threshold,
        max_post_steps=resolved.max_post_steps,
    )
    for use_cache in (True, False):
        assert engine_decode(model, tok, prompt, use_cache, max_tokens=gen, **options) == (ref_tokens, ref_forwards)


@pytest.mark.parametrize("gen", [1, 20, 70])
def test_any_length_decodes_whole_blocks_as_the_reference(llada2, gen):
    """A canvas that ends inside a block is decoded as the reference's whole block (the
    positions past max_tokens take part and are cut); the engine stops once the first
    max_tokens tokens are final, so it may spend fewer forwards."""
    model, tok = llada2
    prompt = PROMPTS[0]
    ref_tokens, ref_forwards = llada2_reference(
        model, prompt, gen_length=gen, block_length=BLOCK, steps=8, threshold=0.95, mask_id=LLADA2_MASK
    )
    for use_cache in (True, False):
        tokens, forwards = engine_decode(model, tok, prompt, use_cache, max_tokens=gen, steps=8)
        assert tokens == ref_tokens and forwards <= ref_forwards


def test_presets_and_their_errors(llada2, request):
    model, tok = llada2
    adapter = adapter_for(model, tok)
    speed = resolve(DecodeOptions(max_tokens=32, preset="speed"), adapter, 5)
    quality = resolve(DecodeOptions(max_tokens=32, preset="quality"), adapter, 5)
    assert (speed.rule.threshold, speed.editing_threshold, speed.max_post_steps) == (0.5, 0.0, 16)
    assert (quality.rule.threshold, quality.editing_threshold) == (0.7, 0.5)
    assert speed.rule.name == quality.rule.name == "low_confidence_dynamic"
    mine = resolve(DecodeOptions(max_tokens=32, preset="quality", threshold=0.8), adapter, 5)
    assert (mine.rule.threshold, mine.editing_threshold) == (0.8, 0.5)  # explicit options win
    with pytest.raises(ValueError, match="'speed', 'quality'"):
        resolve(DecodeOptions(max_tokens=32, preset="fast"), adapter, 5)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(edit_ops=("substitute", "insert")), "insert and delete"),
        (dict(edit_ops=["delete"], preset="speed"), "insert and delete"),
        (dict(edit_ops=("swap",)), "Unknown edit_ops"),
        (dict(edit_ops=("substitute",)), "editing_threshold"),
    ],
)
def test_llada2_2_insert_and_delete_edits_are_refused(llada2, options, message):
    model, tok = llada2
    with pytest.raises(ValueError, match=message):
        next(api.stream_generate(model, tok, PROMPTS[0], max_tokens=8, **options))


def test_substitution_edits_are_the_editing_rule(llada2):
    model, tok = llada2
    prompt, gen = PROMPTS[0], whole_blocks(PROMPTS[0])
    plain = engine_decode(model, tok, prompt, max_tokens=gen, preset="speed")
    assert engine_decode(model, tok, prompt, max_tokens=gen, preset="speed", edit_ops=("substitute",)) == plain


@pytest.mark.parametrize("prompt,gen", [(PROMPTS[0], 91), (PROMPTS[2], 50)])
def test_same_tokens_as_mlx_vlm_loop(llada2, vlm_model, prompt, gen):
    """Block 32, 32 steps, no editing: the quota is one token a step, so LLaDA2's rule
    and mlx-vlm's (commit every p > threshold, else the best one) coincide."""
    model, tok = llada2
    theirs = vlm_model.language_model.generate(
        mx.array([prompt]),
        block_length=32,
        steps=32,
        gen_length=gen,
        threshold=0.95,
        eos_id=LLADA2_EOS,
        mask_id=LLADA2_MASK,
    )[0].tolist()
    ours, _ = engine_decode(model, tok, prompt, eos=True, max_tokens=gen, steps=32)
    assert ours == theirs


def test_fewer_steps_than_the_block_leave_no_mask(llada2, vlm_model):
    """4 steps for 32-token blocks: the even quota's fallback fills the block within its
    steps; mlx-vlm's loop, which commits one token when none passes, leaves masks."""
    model, tok = llada2
    prompt = PROMPTS[0]
    gen = whole_blocks(prompt)
    for use_cache in (True, False):
        tokens, forwards = engine_decode(model, tok, prompt, use_cache, max_tokens=gen, steps=4)
        assert len(tokens) == gen and LLADA2_MASK not in tokens and forwards <= 4 * 2
    theirs = vlm_model.language_model.generate(
        mx.array([prompt]), block_length=32, steps=4, gen_length=gen, eos_id=LLADA2_EOS, mask_id=LLADA2_MASK
    )[0].tolist()
    assert LLADA2_MASK in theirs


def test_eos_stops_once_nothing_before_it_is_masked(llada2):
    model, tok = llada2

    prompt = PROMPTS[1]  # 32 tokens: the first block starts at the prompt's end

    def eos_at(offset):  # (mlx-lm's call: the tokens so far, the next position's logits)
        def processor(tokens, logits):
            bias = mx.zeros(logits.shape)
            bias[:, LLADA2_EOS] = 1e4 if len(tokens) == len(prompt) + offset else 0.0
            return logits + bias

        return processor

    out = list(api.stream_generate(model, tok, prompt, max_tokens=96, logits_processors=[eos_at(5)]))
    assert [r.finish_reason for r in out][-1] == "stop" and out[-1].token == LLADA2_EOS and len(out) == 6
    assert out[-1].forwards <= 32  # the later blocks were never decoded
    rows = api.generate_batch(
        model, tok, [prompt], max_tokens=96, logits_processors=[eos_at(5)], return_token_ids=True
    ).token_ids
    assert len(rows[0]) == 5


def test_stream_contract_with_editing(llada2):
    model, tok = llada2
    drafts = []
    responses = list(
        api.stream_generate(
            model,
            tok,
            PROMPTS[0],
            max_tokens=40,
            preset="speed",
            draft_callback=lambda s: drafts.append(s.canvas.copy()),
        )
    )
    P = len(PROMPTS[0])
    assert len(drafts) == responses[-1].forwards
    for i, r in enumerate(responses):  # an emitted token never changes afterwards
        for canvas in drafts[r.forwards - 1 :]:
            assert canvas[0, P + i] == r.token
    assert LLADA2_MASK not in [r.token for r in responses]
    assert api.generate(model, tok, "Hello", max_tokens=8, preset="quality") == "".join(
        r.text for r in api.stream_generate(model, tok, "Hello", max_tokens=8, preset="quality")
    )


def test_cli_and_bad_input(llada2, llada2_path):
    from cli_run import run_main

    model, tok = llada2
    with pytest.raises(ValueError, match="mask token"):
        api.generate(model, tok, "x <|mask|> y", max_tokens=4)
    capped = list(api.stream_generate(model, tok, "Hi", max_tokens=2000, threshold=0.0))
    assert len(capped) <= model.max_length  # past the context: capped, not an error
    r = run_main(
        "mlx_lm_diffusion.generate",
        "--model",
        str(llada2_path),
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--threshold",
        "0.5",
        "--steps",
        "4",
        "--show-canvas",
    )
    assert r.returncode == 0 and "forwards" in r.stdout, r.stderr
    assert r.stderr.startswith("[forward 1]")  # --show-canvas draws the canvas on stderr


@pytest.mark.parametrize("bits", [None, 4])
def test_convert_and_quantize_reload(tmp_path, llada2_path, llada2, bits):
    from mlx.utils import tree_flatten

    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / f"q{bits}"
    convert(str(llada2_path), str(out), quantize=bits is not None, q_bits=bits or 4)
    model, tok = mld.load(str(out))
    ids = mx.array([PROMPTS[2]])
    if bits is None:
        assert float(mx.abs(model(ids) - llada2[0](ids)).max()) == 0.0
    else:
        assert type(model.layers[1].mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
        assert model.layers[1].mlp.gate.gate_proj.bits == 8  # the router stays at 8 bits
        q, f = np.array(model(ids)).ravel(), np.array(llada2[0](ids)).ravel()
        assert np.corrcoef(q, f)[0, 1] > 0.9  # 4-bit noise, not a different model
    weights = dict(tree_flatten(model.parameters()))
    assert set(model.sanitize(dict(weights))) == set(weights)
    assert isinstance(api.generate(model, tok, PROMPTS[0], max_tokens=8), str)
