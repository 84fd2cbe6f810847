"""A checkpoint's generation_config.json gives the decoding defaults: explicit options >
generation_config.json > the family's reference defaults (mlx_lm_diffusion.decoding.generation_defaults)."""

import json
import shutil

import pytest

import mlx_lm_diffusion
from mlx_lm_diffusion.decoding import generation_defaults
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.checkpoints import write_dream, write_llada
from model_adapters import adapter_for

PROMPT = [3, 5, 7, 9]
OWN = {"block_length": 4, "steps": 1, "strategy": "random", "max_new_tokens": 8}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_llada(tmp_path_factory.mktemp("plain"))


def _with_config(plain, tmp_path, config):
    path = tmp_path / "ckpt"
    shutil.copytree(plain, path)
    (path / "generation_config.json").write_text(json.dumps(config))
    return mlx_lm_diffusion.load(str(path))


def _resolved(model, tokenizer, **options):
    return resolve(DecodeOptions(**options), adapter_for(model, tokenizer), len(PROMPT))


def test_load_reads_the_decoding_keys_and_max_new_tokens(plain, tmp_path):
    model, tokenizer = _with_config(plain, tmp_path, {**OWN, "eos_token_id": 1, "temperature": 0.7})
    assert dict(model.generation_defaults) == {"max_tokens": 8, "block_length": 4, "steps": 1, "strategy": "random"}
    r = _resolved(model, tokenizer)
    assert (r.max_tokens, r.block_length, r.steps, r.rule.name) == (8, 4, 1, "random")


def test_without_a_file_the_family_defaults_hold(plain):
    model, tokenizer = mlx_lm_diffusion.load(str(plain))
    assert dict(model.generation_defaults) == {}
    r = _resolved(model, tokenizer)
    assert (r.max_tokens, r.block_length, r.steps, r.rule.name) == (256, 32, 32, "low_confidence")


def test_explicit_options_win(plain, tmp_path):
    model, tokenizer = _with_config(plain, tmp_path, OWN)
    r = _resolved(model, tokenizer, max_tokens=6, strategy="low_confidence")
    assert (r.max_tokens, r.block_length, r.steps, r.rule.name) == (6, 4, 1, "low_confidence")
    # a block length given: the checkpoint's steps (meant for its own blocks) give way too
    r = _resolved(model, tokenizer, block_length=2)
    assert (r.max_tokens, r.block_length, r.steps) == (8, 2, 2)
    # a threshold given replaces the checkpoint's whole commit rule (no "random does not take one")
    r = _resolved(model, tokenizer, threshold=0.9)
    assert r.rule.name == "threshold"


def test_decoding_at_the_checkpoint_defaults_equals_asking_for_them(plain, tmp_path):
    model, tokenizer = _with_config(plain, tmp_path, {**OWN, "strategy": "low_confidence"})
    asked = dict(max_tokens=8, block_length=4, steps=1, strategy="low_confidence")
    own = [(r.token, r.forwards) for r in mlx_lm_diffusion.stream_generate(model, tokenizer, PROMPT)]
    assert own == [(r.token, r.forwards) for r in mlx_lm_diffusion.stream_generate(model, tokenizer, PROMPT, **asked)]
    assert len(own) <= 8 and own[-1][1] <= 2 * 1  # two blocks of 4, one step each
    text = mlx_lm_diffusion.generate(model, tokenizer, PROMPT)
    assert text == mlx_lm_diffusion.generate(model, tokenizer, PROMPT, **asked)


def test_dreams_own_file_does_not_change_dreams_defaults(tmp_path):
    """Dream's released generation_config.json counts "steps" over the whole canvas and
    names alg / temperature: none of it is read."""
    path = write_dream(tmp_path / "dream")
    model, tokenizer = mlx_lm_diffusion.load(str(path))
    before = _resolved(model, tokenizer)
    (path / "generation_config.json").write_text(
        json.dumps(
            {"alg": "entropy", "alg_temp": 0.0, "steps": 512, "temperature": 0.2, "top_p": 0.95, "mask_token_id": 3}
        )
    )
    model, tokenizer = mlx_lm_diffusion.load(str(path))
    assert dict(model.generation_defaults) == {"alg_temp": 0.0}
    after = _resolved(model, tokenizer)
    assert (after.max_tokens, after.block_length, after.steps, after.rule.name) == (
        before.max_tokens,
        before.block_length,
        before.steps,
        before.rule.name,
    )


@pytest.mark.parametrize(
    "config, key",
    [
        ({"block_length": 0}, "block_length"),
        ({"strategy": "fastest"}, "strategy"),
        ({"max_new_tokens": "many"}, "max_new_tokens"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_key(plain, tmp_path, config, key):
    with pytest.raises(ValueError, match=f"generation_config.json: {key}"):
        _with_config(plain, tmp_path, config)


def test_fill_keeps_a_preset_or_explicit_group_whole():
    class Model:
        generation_defaults = {"block_length": 8, "steps": 8, "strategy": "low_confidence", "max_tokens": 32}

    fill = generation_defaults.fill
    assert fill({}, Model()) == Model.generation_defaults
    assert fill({"schedule": "cosine"}, Model()) == {
        "block_length": 8,
        "steps": 8,
        "max_tokens": 32,
        "schedule": "cosine",
    }
    assert fill({"block_length": 4, "max_tokens": 5}, Model()) == {
        "block_length": 4,
        "max_tokens": 5,
        "strategy": "low_confidence",
    }
    assert fill({"steps": 2}, None) == {"steps": 2}
