"""A tiny DiffusionGemma with its vision tower and its processor files, written offline.

The model is transformers' own `DiffusionGemmaForBlockDiffusion` (random weights at a
useful scale, vision tower included) saved with `save_pretrained`; the processor is
mlx-vlm's `DiffusionGemma4Processor` (Gemma 4's image processor, patch 4, pooling 2, at
most 16 soft tokens an image) over a byte-level tokenizer that knows Gemma 4's image
tokens, saved with the processor's `save_pretrained`. Images are made with PIL.
"""

from __future__ import annotations

from pathlib import Path

from mlx_lm_diffusion.testing.checkpoints import EOS_ID, SPECIALS, VOCAB, _byte_of
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import diffusion_gemma_config

BOI, IMAGE, EOI, VIDEO = "<|image>", "<|image|>", "<image|>", "<|video|>"
BOI_ID, IMAGE_ID, EOI_ID, VIDEO_ID = 261, 262, 263, 264  # after the test tokenizer's specials
PATCH, POOL, MAX_SOFT_TOKENS = 4, 2, 16

# Gemma-style content parts: an image part becomes the image placeholder
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}"
    + IMAGE
    + "{% elif p['type'] == 'video' %}"
    + VIDEO
    + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def image_tokenizer():
    """The test tokenizer (byte-level BPE, no merges) plus Gemma 4's image and video tokens,
    named as the Gemma 4 processors read them (tokenizer.image_token, .boi_token, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS + [BOI, IMAGE, EOI, VIDEO]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet(), key=_byte_of))}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    assert vocab[IMAGE] == IMAGE_ID and vocab[VIDEO] == VIDEO_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI, "video_token": VIDEO},
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def image_config(**kwargs):
    config = diffusion_gemma_config(**kwargs)
    v = config.vision_config
    v.patch_size, v.pooling_kernel_size, v.position_embedding_size = PATCH, POOL, 64
    v.default_output_length = MAX_SOFT_TOKENS
    config.boi_token_id, config.image_token_id, config.eoi_token_id = BOI_ID, IMAGE_ID, EOI_ID
    config.video_token_id = VIDEO_ID
    return config


def write_gemma_with_vision(path: Path, seed: int = 4, vocab_size: int = VOCAB, **config_kwargs) -> Path:
    """transformers' save_pretrained of the model (vision tower at a useful scale too), and
    mlx-vlm's DiffusionGemma4Processor save_pretrained of the processor files.

    `vocab_size`: the model's vocabulary (its embeddings and tied head), e.g. DiffusionGemma's
    released 262,144; the processor's tokenizer keeps its own few tokens, all below it."""
    import torch
    from mlx_vlm.models.diffusion_gemma import DiffusionGemma4Processor
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4VideoProcessor

    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import random_diffusion_gemma

    if vocab_size <= VIDEO_ID:
        raise ValueError(f"vocab_size must exceed the tokenizer's ids (up to {VIDEO_ID}), got {vocab_size}")
    path.mkdir(parents=True, exist_ok=True)
    model = random_diffusion_gemma(image_config(vocab_size=vocab_size, **config_kwargs), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the default initialisation leaves the vision tower near zero
        for name, p in model.named_parameters():
            if "vision" not in name:
                continue
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path))
    sizes = dict(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=MAX_SOFT_TOKENS)
    processor = DiffusionGemma4Processor(
        image_processor=Gemma4ImageProcessor(**sizes),
        video_processor=Gemma4VideoProcessor(
            patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=70, num_frames=2
        ),
        tokenizer=image_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=MAX_SOFT_TOKENS,
    )
    processor.save_pretrained(str(path))
    return path


def make_image(width: int = 20, height: int = 12, seed: int = 0):
    """A small RGB picture with structure (gradients and a square), made with PIL."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack(
        [x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), rng.integers(0, 256, (height, width))], axis=-1
    ).astype(np.uint8)
    pixels[height // 4 : height // 2, width // 4 : width // 2] = (255, 255, 0)
    return Image.fromarray(pixels, "RGB")


__all__ = [
    "write_gemma_with_vision",
    "make_image",
    "image_tokenizer",
    "BOI_ID",
    "IMAGE_ID",
    "EOI_ID",
    "VIDEO_ID",
    "VOCAB",
    "EOS_ID",
]
