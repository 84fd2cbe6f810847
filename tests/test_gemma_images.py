"""DiffusionGemma with images: loading whole (vision tower, projector, processor), forward
parity with an image against transformers' DiffusionGemmaForBlockDiffusion, seeded decodes
against mlx-vlm 0.7.10's stream_diffusion_generate with the same image, every door (Python,
CLI, chat, server, protocol), bad images, the server's path restriction.
"""

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion import images
from mlx_lm_diffusion.engine import Engine
from mlx_lm_diffusion.options import DecodeOptions, resolve
from model_adapters import adapter_for
from model_adapters.gemma_vision import VisionInputs

from checkpoints import VOCAB
from checkpoints_gemma_images import IMAGE_ID, MAX_SOFT_TOKENS, PATCH, POOL, make_image, write_gemma_with_vision
from test_diffusion_gemma import _NoText

torch = pytest.importorskip("torch")

CANVAS = 16


@pytest.fixture(scope="module")
def vision_path(tmp_path_factory):
    return write_gemma_with_vision(tmp_path_factory.mktemp("gemma_vision"))


@pytest.fixture(scope="module")
def loaded(vision_path):
    return mld.load(str(vision_path))


@pytest.fixture(scope="module")
def reference(vision_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(vision_path)).eval()


def processed(processor, text="Look: <|image|> what is it?", pictures=None):
    out = processor(text=[text], images=pictures or [make_image()])
    return (np.array(out["input_ids"]), np.array(out["pixel_values"]), np.array(out["mm_token_type_ids"]))


def hf_pixels(pixel_values):
    """The same pixel values in transformers' layout: patches (B, max_patches, 3 p^2) and
    their (x, y) positions, padded with -1 (transformers' own patching functions)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import convert_image_to_patches, pad_along_first_dim

    patches, positions = [], []
    for image in pixel_values:
        p = convert_image_to_patches(image, PATCH)
        grid = np.meshgrid(np.arange(image.shape[2] // PATCH), np.arange(image.shape[1] // PATCH), indexing="xy")
        p, pos = pad_along_first_dim(p, np.stack(grid, -1).reshape(-1, 2), MAX_SOFT_TOKENS * POOL**2)
        patches.append(p)
        positions.append(pos)
    return torch.from_numpy(np.stack(patches)).float(), torch.from_numpy(np.stack(positions)).long()


def hf_encoder_masks(reference, ids, token_types):
    """transformers' own encoder masks with the image blocks bidirectional. (transformers
    5.24's DiffusionGemmaEncoderModel.forward builds this mapping and drops it -- the call's
    result is never assigned -- so its forward attends causally over images unless given the
    mapping; mlx-vlm's encoder and the config's use_bidirectional_attention="vision" apply it.)"""
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaEncoderModel

    N = ids.shape[1]
    return DiffusionGemmaEncoderModel.create_masks_for_generate(
        config=reference.config, inputs_embeds=torch.zeros(1, N, 1), attention_mask=None, cache=None,
        position_ids=torch.arange(N)[None], mm_token_type_ids=torch.from_numpy(token_types))


# ---------------------------------------------------------------------------- loading


def test_load_returns_mlx_vlm_processor_and_the_whole_model(loaded):
    from mlx.utils import tree_flatten
    from mlx_vlm.models.diffusion_gemma import DiffusionGemma4Processor
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
    from mlx_vlm.models.gemma4.vision import VisionModel

    model, processor = loaded
    assert isinstance(processor, DiffusionGemma4Processor)
    assert isinstance(model.model.encoder.vision_tower, VisionModel)
    assert isinstance(model.model.encoder.embed_vision, MultimodalEmbedder)
    names = dict(tree_flatten(model.parameters()))
    assert any(k.startswith("model.encoder.vision_tower.") for k in names)
    assert images.text_tokenizer(processor).eos_token_ids  # mlx-lm's wrapper for the text doors


def test_a_checkpoint_without_processor_files_returns_the_tokenizer(tmp_path, vision_path):
    import shutil

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    copy = tmp_path / "no_processor"
    shutil.copytree(vision_path, copy)
    (copy / "processor_config.json").unlink()
    model, tok = mld.load(str(copy))
    assert isinstance(tok, TokenizerWrapper) and model.has_vision


# ---------------------------------------------------------------------------- forward


def test_forward_with_an_image_matches_transformers(loaded, reference):
    """Prefill with an image (15 soft tokens, a block longer than the sliding window of 8),
    a first step, a step with self-conditioning: max |delta| <= 1e-4 in fp32."""
    model, processor = loaded
    ids, pixels, types = processed(processor)
    patches, positions = hf_pixels(pixels)
    canvas = np.random.default_rng(0).integers(0, VOCAB, (1, CANVAS))
    T = torch.from_numpy
    hf = dict(input_ids=T(ids), attention_mask=hf_encoder_masks(reference, ids, types), pixel_values=patches,
              image_position_ids=positions, mm_token_type_ids=T(types), decoder_input_ids=T(canvas))
    vision = VisionInputs(mx.array(pixels), mx.array(types))
    with torch.no_grad():
        first = reference(**hf).logits.numpy()
    ours = np.array(model(mx.array(ids), canvas=mx.array(canvas), vision=vision))
    assert np.abs(ours - first).max() <= 1e-4
    sc = first / 0.7
    with torch.no_grad():
        theirs = reference(**hf, self_conditioning_logits=T(sc)).logits.numpy()
    ours = np.array(model(mx.array(ids), canvas=mx.array(canvas), self_conditioning=mx.array(sc), vision=vision))
    assert np.abs(ours - theirs).max() <= 1e-4
    # the image matters: the same tokens without it give other logits
    assert np.abs(np.array(model(mx.array(ids), canvas=mx.array(canvas))) - first).max() > 1e-2


def test_image_features_match_transformers_vision_tower(loaded, reference):
    model, processor = loaded
    _, pixels, _ = processed(processor, pictures=[make_image(28, 16, seed=2)])
    patches, positions = hf_pixels(pixels)
    with torch.no_grad():
        theirs = reference.model.encoder.get_image_features(patches, positions, return_dict=True).pooler_output
    enc = model.model.encoder
    ours = np.array(enc.embed_vision(enc.vision_tower(mx.array(pixels))))
    assert np.abs(ours.reshape(theirs.shape) - theirs.numpy()).max() <= 1e-4


# ---------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def mlx_vlm_model(vision_path):
    from mlx_vlm.models import diffusion_gemma as ref

    cfg = json.loads((vision_path / "config.json").read_text())
    layer = cfg["text_config"]["per_layer_config"]["1"]  # mlx-vlm reads these top-level only
    cfg["text_config"].update(global_head_dim=layer["head_dim"], num_global_key_value_heads=layer["num_key_value_heads"])
    model = ref.Model(ref.ModelConfig.from_dict(cfg))
    model.load_weights(list(model.sanitize(mx.load(str(vision_path / "model.safetensors"))).items()), strict=True)
    model.config.generation_config = {"stability_threshold": 1, "confidence_threshold": 0.005}
    return model


def mlx_vlm_decode(model, ids, pixels, types, max_tokens, seed):
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    mx.random.seed(seed)
    tokens, last = [], None
    for last in stream_diffusion_generate(
        model, _NoText, _NoText, mx.array(ids), mx.array(pixels), None, max_tokens=max_tokens,
        temperature=1.0, skip_special_token_ids=[], max_denoising_steps=48, diffusion_full_canvas=True,
        diffusion_sampler="entropy-bound", mm_token_type_ids=mx.array(types),
    ):
        if not (last.is_draft or last.diffusion_block_complete or last.finish_reason):
            tokens.append(last.token)
    return tokens, last.diffusion_denoising_steps


def engine_decode(model, tok, ids, vision, **options):
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()  # the references fill every canvas
    adapter.vision = vision
    resolved = resolve(DecodeOptions(**options), adapter, len(ids))
    last = None
    for last in Engine(adapter, resolved).run(mx.array([ids])):
        pass
    return last.canvas[0, len(ids):len(ids) + options["max_tokens"]].tolist(), last.forwards


CASES = [("Look: <|image|> what is it?", (20, 12, 0)), ("<|image|>Describe.", (16, 24, 1))]


@pytest.mark.parametrize("text,picture", CASES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("canvases", [1, 2])
def test_tokens_match_mlx_vlm_with_an_image(loaded, mlx_vlm_model, text, picture, seed, canvases):
    """Same image, same seed: the same tokens and denoising steps as mlx-vlm's loop (each
    canvas here stops before its 48th step, where mlx-vlm skips the reference's draws)."""
    model, processor = loaded
    ids, pixels, types = processed(processor, text, [make_image(*picture)])
    ids = ids[0].tolist()
    theirs, their_steps = mlx_vlm_decode(mlx_vlm_model, [ids], pixels, types, CANVAS * canvases, seed)
    vision = VisionInputs(mx.array(pixels), mx.array(types))
    tokens, forwards = engine_decode(model, processor, ids, vision, max_tokens=CANVAS * canvases, seed=seed)
    assert tokens == theirs
    assert forwards == their_steps < 48 * canvases
    text_only, _ = engine_decode(model, processor, ids, None, max_tokens=CANVAS * canvases, seed=seed)
    assert text_only != tokens  # (the image changes the decode)
