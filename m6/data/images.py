"""Decoding of encoded image bytes (JPEG, PNG, WebP, ...) into normalised model input.

Pipeline: Pillow decode -> EXIF orientation -> RGB (alpha composited on white) -> resize the
shorter side to S (bicubic) -> centre crop (eval) or random crop (train) to S x S -> scale to
[0, 1] -> normalise per channel with IMAGE_MEAN / IMAGE_STD. Output is float32 [3, S, S].
"""

from __future__ import annotations

from collections.abc import Sequence

import io

import numpy as np
from PIL import Image, ImageOps

# ImageNet statistics of RGB pixels in [0, 1]; the usual choice for web image-text data.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)
ALPHA_BACKGROUND_RGB = (255, 255, 255)


class BadRecord(ValueError):
    """A record whose image or text cannot be used (corrupt, truncated, undecodable): the message
    says why; ``reason`` is the skip reason when the raiser knows it (else the catcher decides)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def open_image(data: bytes, draft_size: int | None = None) -> Image.Image:
    """Fully decode ``data`` with Pillow (so truncation is detected) or raise BadRecord saying why."""
    if not data:
        raise BadRecord("empty image data")
    try:
        img = Image.open(io.BytesIO(data))
        if draft_size is not None:
            # JPEG only: decode at a reduced power-of-two scale that still covers draft_size.
            img.draft("RGB", (draft_size, draft_size))
        img.load()
        # A camera JPEG stores its pixels unrotated; the EXIF tag says how it is meant to be seen.
        img = ImageOps.exif_transpose(img)
    except Image.DecompressionBombError as e:
        raise BadRecord(f"image too large: {e}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        # UnidentifiedImageError and "image file is truncated" are both OSErrors.
        raise BadRecord(f"cannot decode image: {e}") from e
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode (L, LA, RGBA, P, CMYK, I;16, ...) to RGB; transparency becomes white."""
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
    try:
        if has_alpha:
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND_RGB, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        if img.mode == "RGB":
            return img
        if img.mode.startswith("I"):
            # 16/32-bit greyscale: Pillow's convert would clip to 255, so rescale to 8 bits first.
            arr = np.asarray(img, dtype=np.float64)
            peak = max(float(arr.max()), 1.0)
            scale = 255.0 / (65535.0 if peak > 255 else 255.0)
            return Image.fromarray(np.clip(arr * scale, 0, 255).astype(np.uint8), "L").convert("RGB")
        return img.convert("RGB")
    except (OSError, ValueError) as e:
        raise BadRecord(f"cannot convert image mode {img.mode} to RGB: {e}") from e


def resize_shorter_side(img: Image.Image, size: int) -> Image.Image:
    """Resize so that the shorter side equals ``size``, keeping the aspect ratio (bicubic)."""
    width, height = img.size
    if width <= 0 or height <= 0:
        raise BadRecord(f"image has zero size {width}x{height}")
    scale = size / min(width, height)
    new_size = (max(size, round(width * scale)), max(size, round(height * scale)))
    if new_size == (width, height):
        return img
    return img.resize(new_size, Image.Resampling.BICUBIC)


def crop_square(
    img: Image.Image, size: int, train: bool, rng: np.random.Generator | None
) -> Image.Image:
    """Crop a ``size`` x ``size`` square: centred for eval, uniformly placed (from ``rng``) for train."""
    width, height = img.size
    if train:
        if rng is None:
            raise ValueError("crop_square(train=True) needs an rng for the random crop")
        left = int(rng.integers(0, width - size + 1))
        top = int(rng.integers(0, height - size + 1))
    else:
        left, top = (width - size) // 2, (height - size) // 2
    return img.crop((left, top, left + size, top + size))


def normalize_image(rgb_HWC: np.ndarray, mean: Sequence[float] = IMAGE_MEAN,
                    std: Sequence[float] = IMAGE_STD) -> np.ndarray:
    """Turn uint8 RGB [H, W, 3] into normalised float32 [3, H, W] (per-channel mean/std of [0, 1] pixels)."""
    pixels = rgb_HWC.astype(np.float32) / 255.0
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(((pixels - mean) / std).transpose(2, 0, 1))


def decode_image(
    data: bytes, image_size: int, train: bool, rng: np.random.Generator | None,
    mean: Sequence[float] = IMAGE_MEAN, std: Sequence[float] = IMAGE_STD,
) -> np.ndarray:
    """Decode encoded image bytes into normalised float32 [3, image_size, image_size]; BadRecord if unusable."""
    if image_size <= 0:
        raise ValueError(f"image_size must be positive, got {image_size}")
    if train and rng is None:
        raise ValueError("decode_image(train=True) needs an rng for the random crop")
    img = open_image(data, draft_size=image_size)
    img = crop_square(resize_shorter_side(to_rgb(img), image_size), image_size, train, rng)
    return normalize_image(np.asarray(img, dtype=np.uint8), mean, std)
