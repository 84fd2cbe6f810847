"""DiffusionGemma through the step-schedule protocol (shared/seeds/004): the uniform canvas's
committing mode against an oracle written here (the protocol's section 4 with uniform noise
in the [MASK] token's place), the `images` extension (data: URLs under the server's rules),
through the server's protocol route, and the requests it refuses.
"""

import base64
import http.client
import io
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_arsenal.diffusion import uniform_canvas

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api.protocol import run_request, validate_response
from mlx_lm_diffusion.decoding.schedules import quotas
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.testing.gemma_vision_checkpoints import IMAGE_ID, make_image, write_gemma_with_vision

TEXT = "Look: <|image|> what?"
NEW = 8


@pytest.fixture(scope="module")
def vision_path(tmp_path_factory):
    return write_gemma_with_vision(tmp_path_factory.mktemp("gemma_protocol"))


@pytest.fixture(scope="module")
def loaded(vision_path):
    return mld.load(str(vision_path))


def data_url(picture=None) -> str:
    out = io.BytesIO()
    (picture or make_image()).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def request(processor, text=TEXT, steps=4, schedule="cosine", temperatures=None, **extra):
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    return {
        **dict(
            prompt_tokens=ids,
            target_length=len(ids) + NEW,
            num_steps=steps,
            mask_schedule=schedule,
            temperature_schedule=temperatures or [0.0] * steps,
            top_p=1.0,
            seed=0,
        ),
        **extra,
    }


def oracle(model, processor, req, pictures=()):
    """The protocol's greedy loop on a uniform canvas, written from the spec: the prompt
    (images expanded by the processor itself) encoded once; each step the decoder sees the
    committed tokens and fresh uniform noise elsewhere, self-conditioned on the previous
    step's logits; the schedule's k_t most confident open positions take their argmax."""
    text = processor.tokenizer.decode(req["prompt_tokens"])
    if pictures:
        out = processor(text=[text], images=list(pictures), add_special_tokens=False)
        prompt = mx.array(out["input_ids"])
        vision = images.VisionInputs(out["pixel_values"], mx.array(out["mm_token_type_ids"]))
    else:
        prompt, vision = mx.array([req["prompt_tokens"]]), None
    shift = prompt.shape[1] - len(req["prompt_tokens"])
    M = req["target_length"] - len(req["prompt_tokens"])
    cache = model.make_kv_cache()
    model.encode(prompt, cache, vision) if vision is not None else model.encode(prompt, cache)
    mx.random.seed(req["seed"])
    tokens, open_ = np.zeros(M, dtype=np.int64), np.ones(M, dtype=bool)
    confidence, trace, previous = np.zeros(M), [], None
    for t, k in enumerate(quotas(req["mask_schedule"], M, req["num_steps"])):
        noise = np.array(uniform_canvas((1, M), model.vocab_size))[0]
        noisy = mx.array(np.where(open_, noise, tokens)[None])
        logits = model.decode(noisy, cache, previous)
        previous = logits
        probs = np.array(mx.softmax(logits.astype(mx.float32), axis=-1))[0]
        best, conf = probs.argmax(-1), probs.max(-1)
        chosen = sorted(np.flatnonzero(open_)[np.argsort(-conf[open_], kind="stable")[:k]].tolist())
        tokens[chosen], confidence[chosen], open_[chosen] = best[chosen], conf[chosen], False
        if chosen:
            P = len(req["prompt_tokens"])
            trace.append(
                {"step": t, "token_indices": [P + i for i in chosen], "unmasked_tokens": best[chosen].tolist()}
            )
    assert shift >= 0
    return req["prompt_tokens"] + tokens.tolist(), trace, confidence


@pytest.mark.parametrize("schedule,steps", [("cosine", 4), ("linear", 8), ("sigmoid", 3)])
@pytest.mark.parametrize("with_image", [False, True])
def test_protocol_decodes_diffusion_gemma_as_the_oracle(loaded, schedule, steps, with_image):
    model, processor = loaded
    pictures = [make_image(40, 24)] if with_image else []
    req = request(
        processor, steps=steps, schedule=schedule, **({"images": [data_url(p) for p in pictures]} if pictures else {})
    )
    response = run_request(model, processor, req)
    validate_response(response)
    final, trace, confidence = oracle(model, processor, req, pictures)
    assert response["final_tokens"] == final
    assert response["per_step_unmasked"] == trace
    np.testing.assert_allclose(response["confidence"], confidence, atol=1e-5)
    assert response["termination_reason"] == "max_steps_reached"


def test_the_image_changes_the_decode_and_two_images_expand_in_place(loaded):
    model, processor = loaded
    text = run_request(model, processor, request(processor))
    seen = run_request(model, processor, request(processor, images=[data_url()]))
    assert seen["final_tokens"][:13] == text["final_tokens"][:13]  # the request's positions
    assert len(seen["final_tokens"]) == len(text["final_tokens"])
    assert seen["final_tokens"] != text["final_tokens"]
    two = [make_image(40, 24), make_image(24, 40)]
    req = request(processor, text="a <|image|> b <|image|> c", images=[data_url(p) for p in two])
    response = run_request(model, processor, req)
    final, trace, _ = oracle(model, processor, req, two)
    assert response["final_tokens"] == final and response["per_step_unmasked"] == trace


def test_sampled_steps_follow_temperature_and_top_p(loaded):
    """Sampling (temperature > 0, top_p < 1): seeded, so repeatable; every position is
    committed exactly once and each confidence is a probability."""
    model, processor = loaded
    req = request(processor, steps=4, temperatures=[1.0, 0.8, 0.5, 0.0], images=[data_url()], top_p=0.9)
    a, b = run_request(model, processor, req), run_request(model, processor, req)
    assert a == b
    committed = sorted(i for s in a["per_step_unmasked"] for i in s["token_indices"])
    P = len(req["prompt_tokens"])
    assert committed == list(range(P, P + NEW))
    assert all(0.0 < c <= 1.0 for c in a["confidence"])


def test_confidence_threshold_extension_on_the_uniform_canvas(loaded):
    model, processor = loaded
    response = run_request(model, processor, request(processor, steps=8, schedule="linear", confidence_threshold=1e-6))
    assert response["termination_reason"] == "confidence_threshold_met"
    assert len(response["per_step_unmasked"]) == 1  # all committed at the first step


@pytest.mark.parametrize(
    "change,word",
    [
        ({"images": ["data:image/png;base64," + base64.b64encode(b"not a png").decode()]}, "not an image"),
        ({"images": ["http://127.0.0.1:9/cat.png"]}, "data: URLs"),
        ({"images": ["/etc/hostname"]}, "not allowed"),
        ({"images": [data_url(), data_url()]}, "1 image tokens (id 262) for 2 images"),
        ({"images": [data_url()] * 9}, "at most 8"),
        ({"images": []}, None),  # no images: the text path
        ({"seed_canvas": "prompt + zeros"}, "seed_canvas marks free positions"),
        ({"images": [1]}, "invalid InferenceRequest at images/0"),
    ],
)
def test_bad_protocol_requests_are_value_errors(loaded, change, word):
    model, processor = loaded
    req = {**request(processor), **change}
    if req.get("seed_canvas") == "prompt + zeros":
        req["seed_canvas"] = req["prompt_tokens"] + [0] * NEW
    if word is None:
        validate_response(run_request(model, processor, req))
        return
    with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
        run_request(model, processor, req)


def test_images_on_a_model_without_a_vision_tower(llada):
    model, tok = llada
    req = dict(
        prompt_tokens=[5, 6, IMAGE_ID],
        target_length=8,
        num_steps=2,
        mask_schedule="linear",
        temperature_schedule=[0.0, 0.0],
        top_p=1.0,
        images=[data_url()],
    )
    with pytest.raises(ValueError, match="takes no images"):
        run_request(model, tok, req)


# ---------------------------------------------------------------------------- the server route


@pytest.fixture(scope="module")
def protocol_server(vision_path, tmp_path_factory):
    import huggingface_hub.constants as hf_constants
    from server_runs import running_server

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf") / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        argv = ["--model", str(vision_path), "--port", "0", "--max-images", "2", "--max-image-bytes", "30000"]
        with running_server(argv) as served:
            yield served[0].server_address[1]


def post_protocol(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=240)
    conn.request("POST", "/v1/diffusion/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def noisy_png(size=120) -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3)).astype(np.uint8)
    return data_url(Image.fromarray(pixels))


def test_server_protocol_route_with_an_image(protocol_server, loaded):
    model, processor = loaded
    req = request(processor, images=[data_url()])
    status, body = post_protocol(protocol_server, req)
    assert status == 200, body
    validate_response(body)
    final, trace, _ = oracle(model, processor, req, [make_image()])
    assert body["final_tokens"] == final and body["per_step_unmasked"] == trace


@pytest.mark.parametrize(
    "urls,status,word",
    [
        (lambda: [data_url()] * 3, 400, "at most 2"),
        (lambda: [noisy_png()], 413, "larger than the limit"),
        (lambda: ["data:image/png;base64," + base64.b64encode(b"not a png").decode()], 400, "not an image"),
        (lambda: ["data:text/plain;base64,aGk="], 400, "data:image/"),
        (lambda: ["http://127.0.0.1:9/cat.png"], 400, "data: URLs"),
        (lambda: ["/etc/hostname"], 400, "not allowed"),
        (lambda: [data_url(), data_url()], 400, "image tokens"),
    ],
)
def test_server_protocol_route_refuses_bad_images(protocol_server, loaded, urls, status, word):
    _, processor = loaded
    got, body = post_protocol(protocol_server, request(processor, images=urls()))
    assert got == status, body
    assert word in body["error"]["message"] and body["error"]["param"] == "images"
    got, body = post_protocol(protocol_server, request(processor))  # the server goes on
    assert got == 200, body
