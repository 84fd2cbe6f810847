"""Images (and video) for the doors: reading them safely, mlx-vlm's processor, prompts.

One job: turn what a caller gives (a prompt or chat messages, plus images as paths, PIL
images or data: URLs, videos as paths) into the prompt's token ids and the
`VisionInputs` the DiffusionGemma adapter encodes. The processor is mlx-vlm's
`DiffusionGemma4Processor` (imported, with mlx-vlm's loader); it expands each image
placeholder into the image's soft tokens and gives the pixel values.

Reading an image is all-or-nothing: it is opened from its header in one of
ALLOWED_FORMATS (PNG, JPEG, WebP, GIF, BMP: never a PIL plugin that runs a program, as
EPS runs Ghostscript), its size, frames and the request's total pixels checked against
the limits, and only then decoded in full (a truncated file fails here, not half-way
through a decode).
Remote URLs are never fetched. Local paths are read in the Python door and the CLI; the
server reads them only under a directory its operator allows (`ImagePolicy.allowed_dir`).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from model_adapters.gemma_vision import VisionInputs

MAX_IMAGES = 8  # per request
MAX_IMAGE_BYTES = 20 * 1000 * 1000  # an encoded image
MAX_IMAGE_PIXELS = 40 * 1000 * 1000  # a decoded image (width * height): decompression bombs
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS  # all of one request's images together
# The formats an image may be in, the only PIL plugins ever tried: none of them runs an
# external program (PIL's EPS plugin runs Ghostscript on the bytes; PDF, PSD, ICNS, ...
# are never needed for a photo).
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """A bad image: `status` is the HTTP status a server answers it with (400, or 413
    for an image past the size limits)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImagePolicy:
    """What an image source may be. The Python door and the CLI read any local path; the
    server reads paths only under `allowed_dir` (None: no paths at all)."""

    allow_paths: bool = True
    allowed_dir: Optional[Path] = None
    max_images: int = MAX_IMAGES
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_request_pixels: int = MAX_REQUEST_PIXELS


LOCAL = ImagePolicy()


# ----------------------------------------------------------------------------- reading


def _data_url_bytes(url: str, policy: ImagePolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ImageError("an image data: URL must read data:image/<type>;base64,<data>")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ImageError(f"an image is larger than the limit of {policy.max_bytes} bytes", status=413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"an image data: URL is not valid base64 ({e})") from None


def _path_bytes(source: str, policy: ImagePolicy) -> bytes:
    name = source[len("file://") :] if source.startswith("file://") else source
    path = Path(name).expanduser()
    if not policy.allow_paths:
        if policy.allowed_dir is None:
            raise ImageError("local image paths are not allowed here; send the image as a data: URL")
        root = policy.allowed_dir.resolve()
        resolved = path.resolve()
        if not path.is_absolute() or not resolved.is_relative_to(root):
            raise ImageError(f"image path {name!r} is not under the allowed image directory")
        path = resolved
    try:
        stat = path.stat()
    except OSError:
        raise ImageError(f"no image at {name!r}") from None
    if not S_ISREG(stat.st_mode):  # a FIFO or a device would block the read, or never end
        raise ImageError(f"image {name!r} is not a regular file")
    size = stat.st_size
    if size > policy.max_bytes:
        raise ImageError(f"image {name!r} is larger than the limit of {policy.max_bytes} bytes", status=413)
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"cannot read image {name!r}: {e.strerror or e}") from None


def _header(data: bytes, what: str, policy: ImagePolicy):
    """The image opened from its header only (nothing decoded yet), in an allowed format,
    one frame, within the size limit."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.UnidentifiedImageError:
        raise ImageError(f"{what} is not an image in an allowed format ({', '.join(ALLOWED_FORMATS)})") from None
    except Image.DecompressionBombError:
        raise ImageError(f"{what} is past the decoded size limit", status=413) from None
    except Exception as e:  # PIL raises several kinds for damaged headers
        raise ImageError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None
    if image.width * image.height > policy.max_pixels:
        raise ImageError(
            f"{what} has {image.width}x{image.height} pixels, past the limit of {policy.max_pixels}", status=413
        )
    if getattr(image, "is_animated", False):
        raise ImageError(f"{what} is animated; send a single frame")
    return image


def _decode(image: Any, what: str):
    """Decode an image opened by `_header` in full (a truncated file fails here)."""
    from PIL import Image, ImageOps

    try:
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except Image.DecompressionBombError:
        raise ImageError(f"{what} is past the decoded size limit", status=413) from None
    except Exception as e:  # PIL raises several kinds for damaged data
        raise ImageError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None


def _opened(source: Any, policy: ImagePolicy) -> Tuple[Any, str]:
    """(the image from its header, what to call it in errors), or (a PIL image as given, None)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        if source.width * source.height > policy.max_pixels:
            raise ImageError(f"an image has {source.width}x{source.height} pixels, past the limit", status=413)
        return source, None
    if isinstance(source, (bytes, bytearray)):
        if len(source) > policy.max_bytes:
            raise ImageError(f"an image is larger than the limit of {policy.max_bytes} bytes", status=413)
        return _header(bytes(source), "an image", policy), "an image"
    if isinstance(source, Path):
        source = str(source)
    if not isinstance(source, str) or not source:
        raise ImageError(f"an image must be a path, a data: URL or a PIL image, not {type(source).__name__}")
    _check_kind(source)
    if source.startswith("data:"):
        return _header(_data_url_bytes(source, policy), "an image data: URL", policy), "an image data: URL"
    what = f"image {source!r}"
    return _header(_path_bytes(source, policy), what, policy), what


def _check_kind(source: Any) -> None:
    """Refuse a source that is never read, from its text alone: remote URLs."""
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ImageError("remote image URLs are refused (nothing is fetched); images must be data: URLs")


def open_image(source: Any, policy: ImagePolicy = LOCAL):
    """A PIL RGB image from a PIL image, raw bytes, a data: URL or a local path (as the
    policy allows), in one of ALLOWED_FORMATS. Remote URLs are refused: nothing is fetched."""
    return open_images([source], policy)[0]


def open_images(sources: Any, policy: ImagePolicy = LOCAL) -> list:
    """Every image of a request, read in full before anything runs: the count checked
    first, then every header (format, size, one frame) and the request's total pixels,
    and only then is anything decoded."""
    if sources is None:
        return []
    items = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    if len(items) > policy.max_images:
        raise ImageError(f"{len(items)} images in one request; at most {policy.max_images}")
    opened = [_opened(s, policy) for s in items]
    total = sum(image.width * image.height for image, _ in opened)
    if total > policy.max_request_pixels:
        raise ImageError(
            f"the request's images have {total} pixels together, past the limit of {policy.max_request_pixels}",
            status=413,
        )
    return [image.convert("RGB") if what is None else _decode(image, what) for image, what in opened]


def open_videos(sources: Any) -> list:
    """Each video path as (T, C, H, W) frames, with mlx-vlm's reader and its sampling."""
    from mlx_vlm.utils import load_video

    items = [] if sources is None else list(sources) if isinstance(sources, (list, tuple)) else [sources]
    frames = []
    for path in items:
        if not Path(str(path)).is_file():
            raise ImageError(f"no video at {str(path)!r}")
        try:
            video, _ = load_video(str(path))
        except Exception as e:
            raise ImageError(f"video {str(path)!r} cannot be read ({type(e).__name__}: {e})") from None
        frames.append(video)
    return frames


# ----------------------------------------------------------------------------- processor


VISION_HINT = 'the vision extra: pip install -e ".[vision]" in a clone of mlx-lm-diffusion (mlx-vlm, Pillow, OpenCV)'


def require_vision() -> None:
    """ValueError naming the extra to install when images cannot be read here."""
    try:
        import mlx_vlm  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as e:
        raise ValueError(f"images and video need {VISION_HINT}; missing: {e.name}") from None


def load_processor(model_path: Path, config: dict) -> Any:
    """mlx-vlm's DiffusionGemma processor of a checkpoint with a vision tower and
    processor files, or None."""
    if config.get("model_type") != "diffusion_gemma" or not config.get("vision_config"):
        return None
    if not any((model_path / name).exists() for name in ("processor_config.json", "preprocessor_config.json")):
        return None
    # (mlx-vlm is the `vision` extra; the model has a vision tower only when it is installed)
    import mlx_vlm.models.diffusion_gemma  # noqa: F401  (registers the processor with AutoProcessor)
    from mlx_vlm.utils import load_processor as mlx_vlm_load_processor

    return mlx_vlm_load_processor(model_path, add_detokenizer=False)


def is_processor(obj: Any) -> bool:
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")


def text_tokenizer(tokenizer: Any) -> Any:
    """mlx-lm's TokenizerWrapper for a tokenizer or a processor's tokenizer (one per
    processor, kept on it, so an added EOS token stays)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if isinstance(tokenizer, TokenizerWrapper):
        return tokenizer
    if is_processor(tokenizer):
        wrapped = getattr(tokenizer, "_mlx_lm_tokenizer", None)
        if wrapped is None:
            wrapped = TokenizerWrapper(tokenizer.tokenizer)
            tokenizer._mlx_lm_tokenizer = wrapped
        return wrapped
    return TokenizerWrapper(tokenizer)


# ----------------------------------------------------------------------------- prompts

_IMAGE_PARTS = ("image", "image_url", "input_image")


def _part_source(part: dict) -> Any:
    """The image of an image content part: OpenAI's {"image_url": {"url": ...}} or a
    string, mlx-vlm's {"image": ...}, {"url": ...} or {"path": ...}."""
    for key in ("image_url", "image", "url", "path"):
        value = part.get(key)
        if isinstance(value, dict):
            value = value.get("url")
        if value is not None:
            return value
    raise ImageError("an image content part names no image (give image_url.url)")


def chat_messages(messages: Sequence[dict]) -> Tuple[List[dict], list, list]:
    """Messages for the chat template (image parts as {"type": "image"}, video parts as
    {"type": "video"}, text parts kept) and the image and video sources in order."""
    out, images, videos = [], [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_PARTS:
                images.append(_part_source(part))
                parts.append({"type": "image"})
            elif kind == "video":
                videos.append(part.get("video") or part.get("path"))
                parts.append({"type": "video"})
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise ImageError(f"content part type {kind!r} is not supported (text, image_url, image, video)")
        out.append({**message, "content": parts})
    return out, images, videos


def has_media(messages: Any) -> bool:
    """Whether chat messages carry an image or video part."""
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS + ("video",) for p in m["content"])
        for m in messages
    )


def _placeholders(processor: Any, text: str, n: int, token: str, kind: str) -> str:
    """`text` with one placeholder per image: the caller's, else added at the start."""
    have = text.count(token)
    if have > n:
        raise ImageError(f"the prompt has {have} {kind} placeholders ({token}) but {n} {kind}s were given")
    return token * (n - have) + text


def vision_prompt(
    processor: Any, text: str, images: list, videos: list, add_special_tokens: bool = True
) -> Tuple[List[int], VisionInputs]:
    """The processor's token ids and pixel values for `text` (one placeholder per image,
    added at the start when the text has none) with decoded images and video frames."""
    if images and videos:  # (their pixel values come in two layouts: one kind a request)
        raise ImageError("give images or videos in one request, not both")
    if images:
        text = _placeholders(processor, text, len(images), processor.image_token, "image")
    if videos:
        text = _placeholders(processor, text, len(videos), processor.video_token, "video")
    try:
        inputs = processor(
            text=[text], images=images or None, videos=videos or None, add_special_tokens=add_special_tokens
        )
    except ImageError:
        raise
    except Exception as e:
        raise ImageError(f"the processor cannot prepare these images ({type(e).__name__}: {e})") from None
    ids = [int(t) for t in mx.array(inputs["input_ids"]).reshape(-1).tolist()]
    types = inputs.get("mm_token_type_ids")
    types = None if types is None else mx.array(types).reshape(1, -1)
    positions = inputs.get("video_position_ids") if videos else None
    positions = None if positions is None else mx.array(positions)
    return ids, VisionInputs(inputs["pixel_values"], types, count=len(images) + len(videos), position_ids=positions)


def templated(tokenizer: Any, messages: List[dict], **template_kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)


def request_inputs(model: Any, tokenizer: Any, prompt: Any, kwargs: dict) -> Tuple[Any, Any, Optional[VisionInputs]]:
    """The Python door's hook: pops `image`, `video` (and a prepared `vision`) from the
    keyword options; returns (mlx-lm tokenizer, prompt, vision). `prompt` may be chat
    messages (a list of dicts, rendered with the chat template) with image parts."""
    image, video = kwargs.pop("image", None), kwargs.pop("video", None)
    vision = kwargs.pop("vision", None)
    processor = tokenizer if is_processor(tokenizer) else None
    wrapped = text_tokenizer(tokenizer)
    messages = isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)
    media = image is not None or video is not None or (messages and has_media(prompt))
    if vision is not None and not getattr(model, "has_vision", False):
        raise ImageError("this model takes no images (no vision tower)")
    if not media:
        if messages:
            prompt = wrapped.apply_chat_template(list(prompt), add_generation_prompt=True)
        return wrapped, prompt, vision
    if not getattr(model, "has_vision", False):
        raise ImageError(
            "this model takes no images (no vision tower): images need a checkpoint with one (DiffusionGemma's)"
        )
    if processor is None:
        raise ImageError(
            "images need the checkpoint's processor: pass the processor that load() returned in place of the tokenizer"
        )
    text, images, videos, special = prompt, [], [], True
    if messages:
        chat, images, videos = chat_messages(prompt)
        text, special = templated(wrapped, chat), False
    elif not isinstance(prompt, str):
        raise ImageError(
            "with images, give the prompt as text or chat messages (the processor places each image's tokens)"
        )
    images = open_images(list(images) + _as_list(image))
    videos = open_videos(list(videos) + _as_list(video))
    ids, vision = vision_prompt(processor, text, images, videos, add_special_tokens=special)
    return wrapped, ids, vision


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


__all__ = [
    "ImageError",
    "ImagePolicy",
    "open_image",
    "open_images",
    "open_videos",
    "load_processor",
    "is_processor",
    "text_tokenizer",
    "chat_messages",
    "has_media",
    "vision_prompt",
    "request_inputs",
    "VisionInputs",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
]


# ----------------------------------------------------------------------------- conversations

IMAGE_COMMAND = "/image"


class ConversationImages:
    """The chat REPL's images: `/image PATH` attaches an image (read in full at once) to
    the next message; every decode re-reads the whole conversation, so the pixel values
    of every earlier turn's images are kept, in order, with the conversation."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.pending: list = []
        self.pixels: list = []  # one (1, C, H, W) array per image of the conversation

    def attach(self, argument: str) -> str:
        """A line saying what was attached (ValueError for a bad image or no processor)."""
        if self.processor is None:
            raise ImageError("this model takes no images (no vision tower and processor)")
        path = argument.strip()
        if not path:
            raise ImageError(f"give a path: {IMAGE_COMMAND} PATH")
        self.pending.append(open_image(path))
        return f"[image {path} attached to the next message ({len(self.pending)} pending)]"

    def reset(self) -> None:
        self.pending, self.pixels = [], []

    def turn(self, tokenizer: Any, messages: List[dict]) -> Tuple[List[int], Optional[VisionInputs]]:
        """The turn's prompt ids (the pending images before the last message's text) and
        the conversation's vision inputs, or (None, None) when this turn and the
        conversation have no image (the text path builds the prompt as before)."""
        if not self.pending and not self.pixels:
            return None, None
        new, self.pending = self.pending, []
        if new:
            last = dict(messages[-1])
            last["content"] = [{"type": "image"} for _ in new] + [{"type": "text", "text": last["content"]}]
            messages = messages[:-1] + [last]
        if getattr(tokenizer, "has_chat_template", False):
            text, special = templated(tokenizer, messages), False
        else:
            text, special = messages[-1]["content"][-1]["text"] if new else messages[-1]["content"], True
        ids, vision = vision_prompt(self.processor, text, new, [], add_special_tokens=special) if new else (None, None)
        if ids is None:
            ids = tokenizer.encode(text, add_special_tokens=special)
        else:
            pv = vision.pixel_values
            self.pixels.extend(
                pv[i : i + 1] if not isinstance(pv, list) else mx.array(pv[i])[None] for i in range(len(new))
            )
        return list(ids), VisionInputs(list(self.pixels), None, count=len(self.pixels))


# ----------------------------------------------------------------------------- the server


def protocol_prompt(
    model: Any, processor: Any, prompt: List[int], sources: Sequence[str], policy: Optional[ImagePolicy] = None
) -> Tuple[List[int], VisionInputs]:
    """The step-schedule protocol's `images` extension: `prompt` (token ids) holds one
    image token per image where it goes; each becomes that image's tokens as the
    processor expands them (its begin token, soft tokens, end token). Images are data:
    URLs under the server's rules (`policy`: default data: URLs only, default limits),
    all read before anything runs."""
    policy = policy or ImagePolicy(allow_paths=False)
    if not getattr(model, "has_vision", False) or not is_processor(processor):
        raise ImageError(
            "this model takes no images (the protocol's images need a checkpoint with a vision tower and its processor)"
        )
    token = int(processor.image_token_id)
    if len(sources) > policy.max_images:
        raise ImageError(f"{len(sources)} images in one request; at most {policy.max_images}")
    places = [i for i, t in enumerate(prompt) if t == token]
    if len(places) != len(sources):
        raise ImageError(
            f"prompt_tokens hold {len(places)} image tokens (id {token}) for {len(sources)} "
            "images: put one image token where each image goes"
        )
    pictures = open_images(list(sources), policy)
    ids, pixels, last = [], [], 0
    for place, picture in zip(places, pictures):
        segment, vision = vision_prompt(processor, processor.image_token, [picture], [], add_special_tokens=False)
        ids += prompt[last:place] + segment
        pv = vision.pixel_values
        pixels.append(mx.array(pv[0])[None] if isinstance(pv, list) else pv)
        last = place + 1
    ids += prompt[last:]
    return ids, VisionInputs(pixels, None, count=len(pixels))


def add_server_arguments(parser: Any) -> None:
    group = parser.add_argument_group("images (DiffusionGemma)")
    group.add_argument(
        "--allowed-image-dir",
        type=Path,
        default=None,
        help="A directory whose files requests may name as images (image_url.url a path "
        "or file:// URL under it); off by default: images are data: URLs only",
    )
    group.add_argument(
        "--max-images",
        type=int,
        default=MAX_IMAGES,
        help=f"Images in one request at most (default {MAX_IMAGES}; more are a 400)",
    )
    group.add_argument(
        "--max-image-bytes",
        type=int,
        default=MAX_IMAGE_BYTES,
        help=f"Largest encoded image (default {MAX_IMAGE_BYTES}; larger is a 413)",
    )


def server_policy(cli_args: Any) -> ImagePolicy:
    """Clients name no local paths unless the operator allowed a directory."""
    allowed = getattr(cli_args, "allowed_image_dir", None)
    return ImagePolicy(
        allow_paths=False,
        allowed_dir=None if allowed is None else Path(allowed),
        max_images=getattr(cli_args, "max_images", MAX_IMAGES) or MAX_IMAGES,
        max_bytes=getattr(cli_args, "max_image_bytes", MAX_IMAGE_BYTES) or MAX_IMAGE_BYTES,
    )


def check_served_messages(
    messages: Sequence[dict], policy: ImagePolicy, takes_images: Callable[[], bool] = lambda: True
) -> list:
    """Every image of a chat request, read in full on the handler thread (ImageError with
    the status to answer); video parts are not served. A model without a vision tower
    (`takes_images()` False) refuses images before any is decoded."""
    _, sources, videos = chat_messages(messages)
    if videos:
        raise ImageError("video content parts are not served; use the Python API or the CLI (--video)")
    for source in sources:
        _check_kind(source)
    if sources and not takes_images():
        raise ImageError("the served model takes no images (no vision tower and processor)")
    return open_images(sources, policy)


_processors: dict = {}


def served_processor(model_provider: Any) -> Any:
    """The served checkpoint's processor (loaded once per model), or None."""
    key = getattr(model_provider, "model_key", None)
    if key not in _processors:
        from mlx_lm.utils import _download, load_config

        path = _download(key[0]) if key else None
        _processors[key] = None if path is None else load_processor(Path(path), load_config(Path(path)))
    return _processors[key]


def served_prompt(
    model_provider: Any, tokenizer: Any, messages: List[dict], pictures: list, template_kwargs: dict
) -> Tuple[List[int], VisionInputs]:
    """A chat request's prompt ids and vision inputs, through the served processor."""
    processor = served_processor(model_provider)
    if processor is None or not getattr(model_provider.model, "has_vision", False):
        raise ImageError("the served model takes no images (no vision tower and processor)")
    chat, _, _ = chat_messages(messages)
    text = templated(tokenizer, chat, **template_kwargs)
    return vision_prompt(processor, text, pictures, [], add_special_tokens=False)
