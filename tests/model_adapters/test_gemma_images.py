"""DiffusionGemma with images: loading whole (vision tower, projector, processor), forward
parity with an image against transformers' DiffusionGemmaForBlockDiffusion, seeded decodes
against mlx-vlm 0.7.10's stream_diffusion_generate with the same image, every door (Python,
CLI, chat, server, protocol), bad images, the server's path restriction.
"""

import base64
import io
import json
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from cli_run import run_main
from test_diffusion_gemma import _NoText

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.testing.checkpoints import VOCAB
from mlx_lm_diffusion.testing.gemma_vision_checkpoints import (
    IMAGE_ID,
    MAX_SOFT_TOKENS,
    PATCH,
    POOL,
    make_image,
    write_gemma_with_vision,
)
from model_adapters import adapter_for
from model_adapters.base import DecodeSetup
from model_adapters.gemma_vision import VisionInputs

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
        config=reference.config,
        inputs_embeds=torch.zeros(1, N, 1),
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(N)[None],
        mm_token_type_ids=torch.from_numpy(token_types),
    )


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
    hf = dict(
        input_ids=T(ids),
        attention_mask=hf_encoder_masks(reference, ids, types),
        pixel_values=patches,
        image_position_ids=positions,
        mm_token_type_ids=T(types),
        decoder_input_ids=T(canvas),
    )
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
    cfg["text_config"].update(
        global_head_dim=layer["head_dim"], num_global_key_value_heads=layer["num_key_value_heads"]
    )
    model = ref.Model(ref.ModelConfig.from_dict(cfg))
    model.load_weights(list(model.sanitize(mx.load(str(vision_path / "model.safetensors"))).items()), strict=True)
    model.config.generation_config = {"stability_threshold": 1, "confidence_threshold": 0.005}
    return model


def mlx_vlm_decode(model, ids, pixels, types, max_tokens, seed):
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    mx.random.seed(seed)
    tokens, last = [], None
    for last in stream_diffusion_generate(
        model,
        _NoText,
        _NoText,
        mx.array(ids),
        mx.array(pixels),
        None,
        max_tokens=max_tokens,
        temperature=1.0,
        skip_special_token_ids=[],
        max_denoising_steps=48,
        diffusion_full_canvas=True,
        diffusion_sampler="entropy-bound",
        mm_token_type_ids=mx.array(types),
    ):
        if not (last.is_draft or last.diffusion_block_complete or last.finish_reason):
            tokens.append(last.token)
    return tokens, last.diffusion_denoising_steps


def engine_decode(model, tok, ids, vision, **options):
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()  # the references fill every canvas
    resolved = resolve(DecodeOptions(**options), adapter, len(ids))
    last = None
    for last in Engine(adapter, resolved, vision=vision).run(mx.array([ids])):
        pass
    return last.canvas[0, len(ids) : len(ids) + options["max_tokens"]].tolist(), last.forwards


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


# ---------------------------------------------------------------------------- doors


def png_bytes(picture=None) -> bytes:
    out = io.BytesIO()
    (picture or make_image()).save(out, format="PNG")
    return out.getvalue()


def data_url(picture=None) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()


@pytest.fixture(scope="module")
def picture_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pictures")
    good = d / "allowed" / "a.png"
    good.parent.mkdir()
    good.write_bytes(png_bytes())
    (d / "outside.png").write_bytes(png_bytes())
    (d / "not_an_image.png").write_bytes(b"this is text, not a PNG")
    (d / "truncated.png").write_bytes(png_bytes()[:200])
    return d


def library_tokens(model, processor, prompt, **kwargs):
    return [r.token for r in mld.stream_generate(model, processor, prompt, max_tokens=CANVAS, seed=0, **kwargs)]


def templated_ids(processor, text="What is it?", n=1):
    """The processor's ids of one user message with `n` images before its text, and the
    processor's pixel values (the reference every door is compared with)."""
    tok = images.text_tokenizer(processor)
    content = [{"type": "image"}] * n + [{"type": "text", "text": text}]
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    out = processor(text=[prompt], images=[make_image()] * n, add_special_tokens=False)
    return np.array(out["input_ids"])[0].tolist(), out


def reference_tokens(model, processor, ids, out):
    """The engine with explicitly prepared inputs: what every door should produce."""
    adapter = adapter_for(model, processor)
    vision = VisionInputs(out["pixel_values"], mx.array(out["mm_token_type_ids"]))
    resolved = resolve(DecodeOptions(max_tokens=CANVAS, seed=0), adapter, len(ids))
    last = None
    for last in Engine(adapter, resolved, vision=vision).run(mx.array([ids])):
        pass
    tokens = last.canvas[0, len(ids) : len(ids) + last.final[0]].tolist()
    return tokens


def test_python_door_paths_pil_images_and_messages_agree(loaded, picture_files):
    model, processor = loaded
    ids, out = templated_ids(processor)
    expected = reference_tokens(model, processor, ids, out)
    path = str(picture_files / "allowed" / "a.png")
    message = lambda part: [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]  # noqa: E731
    assert library_tokens(model, processor, message({"type": "image", "image": make_image()})) == expected
    assert library_tokens(model, processor, message({"type": "image", "image": path})) == expected
    assert (
        library_tokens(model, processor, message({"type": "image_url", "image_url": {"url": data_url()}})) == expected
    )
    text = images.text_tokenizer(processor).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    # a text prompt with the placeholder; images as paths or PIL images (mlx-vlm's image=[...])
    raw = [r.token for r in mld.stream_generate(model, processor, text, image=[path], max_tokens=CANVAS, seed=0)]
    assert raw == library_tokens(model, processor, text, image=[make_image()])
    assert mld.generate(model, processor, "Hi", image=path, max_tokens=CANVAS, seed=0) == mld.generate(
        model, processor, "<|image|>Hi", image=[make_image()], max_tokens=CANVAS, seed=0
    )


def test_text_requests_are_unchanged_by_the_processor(loaded):
    model, processor = loaded
    tok = images.text_tokenizer(processor)
    assert mld.generate(model, processor, "Hello", max_tokens=CANVAS, seed=3) == mld.generate(
        model, tok, "Hello", max_tokens=CANVAS, seed=3
    )
    batch = mld.generate_batch(model, processor, ["ab", "cd"], max_tokens=CANVAS, seed=1)
    assert batch.texts == mld.generate_batch(model, tok, ["ab", "cd"], max_tokens=CANVAS, seed=1).texts


@pytest.mark.parametrize(
    "source,word",
    [
        ("not_an_image.png", "not an image"),
        ("truncated.png", "not a readable image"),
        ("missing.png", "no image at"),
        ("http://127.0.0.1:9/cat.png", "remote image URLs are refused"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:text/plain;base64,aGk=", "data:image/"),
    ],
)
def test_bad_images_are_a_clear_error_before_anything_runs(loaded, picture_files, source, word):
    model, processor = loaded
    if not source.startswith(("http", "data")):
        source = str(picture_files / source)
    with pytest.raises(ValueError, match=word):
        next(mld.stream_generate(model, processor, "What?", image=[source], max_tokens=CANVAS))


def test_limits_and_mismatches(loaded, llada):
    model, processor = loaded
    with pytest.raises(ValueError, match="at most 8"):
        mld.generate(model, processor, "x", image=[make_image()] * 9, max_tokens=CANVAS)
    with pytest.raises(images.ImageError, match="pixels") as e:
        images.open_image(png_bytes(), images.ImagePolicy(max_pixels=100))
    assert e.value.status == 413
    with pytest.raises(images.ImageError, match="larger") as e:
        images.open_image(data_url(), images.ImagePolicy(max_bytes=100))
    assert e.value.status == 413
    with pytest.raises(ValueError, match="2 image placeholders"):
        mld.generate(model, processor, "<|image|><|image|>", image=[make_image()], max_tokens=CANVAS)
    with pytest.raises(ValueError, match="processor"):  # a tokenizer cannot place image tokens
        mld.generate(model, images.text_tokenizer(processor), "x", image=[make_image()], max_tokens=CANVAS)
    with pytest.raises(ValueError, match=r"takes no images \(no vision tower\)"):  # nor a model without one
        mld.generate(llada[0], llada[1], "x", image=[make_image()], max_tokens=4)
    with pytest.raises(ValueError, match="image tokens"):  # features and placeholders must agree
        mld.generate(
            model, processor, [5, IMAGE_ID, 6], vision=VisionInputs(mx.zeros((1, 3, 16, 16))), max_tokens=CANVAS
        )


def run_cli(*argv):
    return run_main("mlx_lm_diffusion.generate", *argv)


def test_cli_image_flag(loaded, vision_path, picture_files):
    model, processor = loaded
    path = str(picture_files / "allowed" / "a.png")
    r = run_cli(
        "--model",
        str(vision_path),
        "--prompt",
        "What is it?",
        "--image",
        path,
        "--max-tokens",
        str(CANVAS),
        "--seed",
        "0",
        "--verbose",
        "False",
    )
    assert r.returncode == 0, r.stderr
    ids, out = templated_ids(processor)
    expected = mld.generate(model, processor, ids, vision=VisionInputs(out["pixel_values"]), max_tokens=CANVAS, seed=0)
    assert r.stdout == expected + "\n"
    bad = run_cli(
        "--model",
        str(vision_path),
        "--prompt",
        "x",
        "--image",
        str(picture_files / "truncated.png"),
        "--max-tokens",
        "4",
    )
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "not a readable image" in bad.stderr


def test_chat_image_command_attaches_to_the_next_message(loaded, vision_path, picture_files, capsys):
    from chat_script import ScriptedUI, args_for

    from mlx_lm_diffusion.cli import chat

    model, processor = loaded
    path = str(picture_files / "allowed" / "a.png")
    args = args_for(vision_path, "--max-tokens", str(CANVAS))
    ui = ScriptedUI([f"/image {path}", "What is it?", f"/image {picture_files / 'truncated.png'}", "q"])
    mx.random.seed(7)
    chat.chat_loop(model, processor, args, ui)
    printed = capsys.readouterr().out
    assert "attached to the next message" in printed and "not a readable image" in printed
    ids, out = templated_ids(processor)
    mx.random.seed(7)
    expected = mld.generate(
        model,
        processor,
        ids,
        vision=VisionInputs(out["pixel_values"]),
        max_tokens=CANVAS,
        sampler=chat._sampler(args, images.text_tokenizer(processor)),
    )
    assert ui.turns == [expected]


def test_chat_turns_keep_the_conversations_images(loaded):
    """A second turn re-reads the whole conversation: the first turn's image goes with it."""
    model, processor = loaded
    pictures = images.ConversationImages(processor)
    tok = images.text_tokenizer(processor)
    pictures.pending.append(make_image())
    ids, vision = pictures.turn(tok, [{"role": "user", "content": "What?"}])
    assert vision.count == 1 and ids.count(IMAGE_ID) == 15
    ids2, vision2 = pictures.turn(tok, [{"role": "user", "content": "And?"}])
    assert IMAGE_ID not in ids2 and vision2.count == 1  # no new image, the old one kept
    pictures.reset()
    assert pictures.turn(tok, [{"role": "user", "content": "x"}]) == (None, None)


# ---------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def image_server(vision_path, picture_files, tmp_path_factory):
    import huggingface_hub.constants as hf_constants
    from server_runs import running_server

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf") / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        argv = [
            "--model",
            str(vision_path),
            "--port",
            "0",
            "--max-tokens",
            str(CANVAS),
            "--max-images",
            "2",
            "--max-image-bytes",
            "30000",
            "--allowed-image-dir",
            str(picture_files / "allowed"),
        ]
        with running_server(argv) as served:
            yield served[0].server_address[1]


def image_message(*urls, text="What is it?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def test_server_answers_image_url_parts_with_the_openai_client(image_server, loaded, picture_files):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{image_server}/v1", api_key="x", max_retries=0, timeout=240)
    reply = client.chat.completions.create(
        model="default_model", messages=image_message(data_url()), temperature=0.0, seed=0, max_tokens=CANVAS
    )
    model, processor = loaded
    mx.random.seed(0)
    # (temperature 0 is no sampler, on both servers as in the CLI: DiffusionGemma's own draw)
    expected = mld.generate(model, processor, image_message(data_url()), max_tokens=CANVAS)
    assert reply.choices[0].message.content == expected
    # a file under --allowed-image-dir reads the same
    path = str(picture_files / "allowed" / "a.png")
    again = client.chat.completions.create(
        model="default_model", messages=image_message(path), temperature=0.0, seed=0, max_tokens=CANVAS
    )
    assert again.choices[0].message.content == expected


def post_json(port, body):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=240)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def noisy_png(size=120) -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3)).astype(np.uint8)
    return data_url(Image.fromarray(pixels))


@pytest.mark.parametrize(
    "urls,status,word",
    [
        (lambda d: [str(d / "outside.png")], 400, "not under the allowed image directory"),
        (lambda d: [str(d / "allowed" / ".." / "outside.png")], 400, "not under the allowed image directory"),
        (lambda d: ["relative.png"], 400, "not under the allowed image directory"),
        (lambda d: ["http://127.0.0.1:9/cat.png"], 400, "data: URLs"),
        (lambda d: [data_url()] * 3, 400, "at most 2"),
        (lambda d: [noisy_png()], 413, "larger than the limit"),
        (lambda d: ["data:image/png;base64," + base64.b64encode(b"not a png").decode()], 400, "not an image"),
        (lambda d: ["data:image/png;base64," + base64.b64encode(png_bytes()[:300]).decode()], 400, "readable"),
    ],
)
def test_server_refuses_bad_images_with_openai_errors(image_server, picture_files, urls, status, word):
    got, body = post_json(image_server, {"messages": image_message(*urls(picture_files)), "max_tokens": 4})
    assert got == status, body
    assert word in body["error"]["message"] and body["error"]["param"] == "messages"


def test_server_serves_text_requests_and_refuses_video_parts(image_server):
    got, body = post_json(image_server, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    assert got == 200 and body["choices"][0]["message"]["content"] is not None
    video = [{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}]
    got, body = post_json(image_server, {"messages": video, "max_tokens": 4})
    assert got == 400 and "video" in body["error"]["message"]


def test_server_default_policy_reads_no_paths(picture_files):
    policy = images.server_policy(SimpleNamespace())
    assert policy.allowed_dir is None
    with pytest.raises(images.ImageError, match="not allowed"):
        images.open_image(str(picture_files / "allowed" / "a.png"), policy)
    images.open_image(data_url(), policy)  # data: URLs always


# ---------------------------------------------------------------------------- the cheaper step


def test_top_k_self_conditioning_matches_its_definition(loaded):
    """softmax over the k largest scaled logits, times the k embedding rows they name."""
    from model_adapters.families.diffusion_gemma import _top_k_soft_embeddings

    model, _ = loaded
    table = model.model.decoder.embed_tokens
    logits = mx.array(np.random.default_rng(0).standard_normal((2, 5, VOCAB)).astype(np.float32) * 4)
    ours = np.array(_top_k_soft_embeddings(table, logits, 7))
    z, E = np.array(logits), np.array(table.weight)
    top = np.argsort(-z, axis=-1)[..., :7]
    vals = np.take_along_axis(z, top, -1)
    p = np.exp(vals - vals.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.abs(ours - np.einsum("blk,blkd->bld", p, E[top])).max() <= 1e-5
    # k = V is the whole vocabulary: the exact soft embeddings
    exact = np.array(model._soft_embeddings(logits)) / model.embed_scale
    assert np.abs(np.array(_top_k_soft_embeddings(table, logits, VOCAB)) - exact).max() <= 1e-4
    # a quantized table gives its own dequantized rows
    q = table.to_quantized(group_size=32, bits=8)
    deq = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8)
    got = np.array(_top_k_soft_embeddings(q, logits, 7))
    assert np.abs(got - np.einsum("blk,blkd->bld", p, np.array(deq)[top])).max() <= 1e-4


def test_fast_self_conditioning_is_opt_in(loaded):
    model, processor = loaded
    adapter = adapter_for(model, processor)
    prompt = mx.array([[5, 6, 7, 8]])

    def started(**options):  # (a decode's state holds its k)
        return adapter.start(
            prompt, setup=DecodeSetup(resolve(DecodeOptions(max_tokens=CANVAS, **options), adapter, 4))
        )

    assert started().top_k == 0  # the default is the reference's step
    assert started(fast_self_conditioning=True).top_k == 256
    assert started(fast_self_conditioning=True, self_conditioning_k=2).top_k == 2
    kw = dict(max_tokens=2 * CANVAS, seed=0)
    base = mld.generate(model, processor, "Hello", **kw)
    assert base == mld.generate(
        model, processor, "Hello", fast_self_conditioning=True, self_conditioning_k=VOCAB, **kw
    )  # k = V: the exact step
    assert base != mld.generate(model, processor, "Hello", fast_self_conditioning=True, self_conditioning_k=1, **kw)
    with pytest.raises(ValueError, match="self_conditioning_k"):
        mld.generate(model, processor, "Hello", self_conditioning_k=0, max_tokens=CANVAS)


# ---------------------------------------------------------------------------- convert


def test_convert_keeps_the_vision_tower_unquantized_and_the_processor(tmp_path, vision_path, loaded):
    """As mlx-vlm's convert: the text model quantized, the vision tower and projector as
    they are; vision_config and the processor files carried over; images still work."""
    import mlx.nn as nn

    from mlx_lm_diffusion.cli.convert import convert

    out = tmp_path / "q4"
    convert(str(vision_path), str(out), quantize=True, q_bits=4, q_group_size=32)
    model, processor = mld.load(str(out))
    assert images.is_processor(processor)
    enc = model.model.encoder
    assert type(enc.vision_tower.patch_embedder.input_proj) is nn.Linear
    assert type(enc.embed_vision.embedding_projection) is nn.Linear
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.model.decoder.embed_tokens.bits == 8  # the head stays at 8 bits
    full, _ = loaded
    ids, pixels, types = processed(processor)
    vision = VisionInputs(mx.array(pixels), mx.array(types))
    canvas = mx.array([list(range(CANVAS))])
    a = np.array(model(mx.array(ids), canvas=canvas, vision=vision))
    b = np.array(full(mx.array(ids), canvas=canvas, vision=vision))
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.9  # quantization noise, the same model
    assert isinstance(mld.generate(model, processor, "What?", image=[make_image()], max_tokens=CANVAS, seed=0), str)


# ---------------------------------------------------------------------------- video


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    cv2 = pytest.importorskip("cv2")
    path = tmp_path_factory.mktemp("video") / "v.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4, (32, 24))
    for i in range(8):
        frame = np.zeros((24, 32, 3), np.uint8)
        frame[:, :, 0] = i * 30
        frame[5:10, i * 3 : i * 3 + 6] = 255
        writer.write(frame)
    writer.release()
    return path


def test_video_frames_go_through_the_vision_tower(loaded, vision_path, video_file):
    """mlx-vlm's processor takes video (frames as patches with their positions); there is
    no reference decode (transformers' DiffusionGemma takes no video, and mlx-vlm 0.7.10's
    own DiffusionGemma drops the frame positions), so: the frames' features fill exactly
    the video tokens, the video changes the answer, and --video reaches it."""
    model, processor = loaded
    tokens, vision = images.request_inputs(model, processor, "What happens?", {"video": [str(video_file)]})[1:]
    assert vision.position_ids is not None and vision.mm_token_type_ids is not None
    enc = model.model.encoder
    features = enc.embed_vision(enc.vision_tower(vision.pixel_values, vision.position_ids))
    from mlx_lm_diffusion.testing.gemma_vision_checkpoints import VIDEO_ID

    assert features.shape[-2] == tokens.count(VIDEO_ID) > 0
    kw = dict(max_tokens=CANVAS, seed=0)
    with_video = mld.generate(model, processor, "What happens?", video=[str(video_file)], **kw)
    assert with_video != mld.generate(model, processor, "What happens?", **kw)
    r = run_cli(
        "--model",
        str(vision_path),
        "--prompt",
        "What happens?",
        "--video",
        str(video_file),
        "--max-tokens",
        str(CANVAS),
        "--seed",
        "0",
        "--verbose",
        "False",
        "--ignore-chat-template",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == with_video + "\n"
    with pytest.raises(ValueError, match="not both"):
        mld.generate(model, processor, "x", image=[make_image()], video=[str(video_file)], **kw)
    with pytest.raises(ValueError, match="no video at"):
        mld.generate(model, processor, "x", video=["/nonexistent.mp4"], **kw)


def test_without_mlx_vlm_the_checkpoint_loads_text_only(vision_path, monkeypatch):
    """mlx-vlm is the `vision` extra: without it DiffusionGemma loads as before, text only."""
    from model_adapters.families.diffusion_gemma import ModelArgs

    monkeypatch.setitem(sys.modules, "mlx_vlm.models.gemma4.config", None)  # (import fails)
    cfg = json.loads((vision_path / "config.json").read_text())
    with pytest.warns(UserWarning, match="vision"):
        args = ModelArgs.from_dict(cfg)
    assert args.vision is None


def test_a_prompt_with_images_neither_reuses_nor_keeps_encoder_kv(loaded):
    """Prompt KV reuse matches token ids; image tokens' KV depend on the pixels, so a
    prompt with images reuses nothing and leaves nothing for another prompt."""
    model, processor = loaded
    ids, pixels, types = processed(processor)
    adapter = adapter_for(model, processor)
    text_state = adapter.start(mx.array(ids))
    kept = adapter.export_prefix(text_state, ids.shape[1])
    assert kept is not None  # text: the causal encoder's KV is kept
    setup = DecodeSetup(vision=VisionInputs(mx.array(pixels), mx.array(types)))
    assert adapter.reuse_length(kept, mx.array(ids), setup=setup) == 0
    state = adapter.start(mx.array(ids), reuse=kept, setup=setup)
    assert state.cache[0].offset == ids.shape[1]  # encoded whole, with the image
    assert adapter.export_prefix(state, ids.shape[1]) is None
