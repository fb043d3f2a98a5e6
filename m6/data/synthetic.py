"""A built-in image-caption task that is learnable and can only be solved by looking at the image.

Each image holds 1-2 coloured shapes (circle, square, triangle), small or large, in distinct cells
of a 3x3 grid, drawn with numpy on a dark noisy background. The caption names size, colour, shape
and cell of each, in reading order, e.g. "a large red circle at the top left and a small blue
square at the bottom". Text-only continuation samples are mixed in so the text path also trains
without an image. Sample i depends only on (seed, i): identical on every machine and sharding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from m6.data.batch import MultimodalBatch, Sample

NUM_CHANNELS = 3
GRID_SIZE = 3
CAPTION_PROMPT = "describe:"
BACKGROUND_RGB = (0.1, 0.1, 0.1)
NOISE_STD = 0.02
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.1),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1),
    "cyan": (0.1, 0.85, 0.9),
    "magenta": (0.9, 0.1, 0.85),
    "white": (0.95, 0.95, 0.95),
    "orange": (1.0, 0.55, 0.0),
}
SHAPES = ("circle", "square", "triangle")
# Half-extent of a shape as a fraction of a grid cell; the jitter keeps every shape in its cell.
SIZES: dict[str, float] = {"small": 0.26, "large": 0.40}
MAX_JITTER = 0.08
# (row, col) of the 3x3 grid -> phrase used in captions.
POSITIONS: dict[tuple[int, int], str] = {
    (0, 0): "at the top left", (0, 1): "at the top", (0, 2): "at the top right",
    (1, 0): "on the left", (1, 1): "in the center", (1, 2): "on the right",
    (2, 0): "at the bottom left", (2, 1): "at the bottom", (2, 2): "at the bottom right",
}
# Per-channel statistics of raw pixels, measured over 4096 samples at 32x32; images are
# normalised with them so the model sees roughly zero mean / unit std input.
PIXEL_MEAN = (0.1277, 0.1239, 0.1204)
PIXEL_STD = (0.1504, 0.1298, 0.1308)
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    """One drawn object: its size, colour, shape and grid cell (row, col)."""

    size: str
    colour: str
    shape: str
    cell: tuple[int, int]

    def phrase(self) -> str:
        """Caption fragment, e.g. 'a small red circle at the top left'."""
        return f"a {self.size} {self.colour} {self.shape} {POSITIONS[self.cell]}"


def sample_shapes(rng: np.random.Generator) -> list[ShapeSpec]:
    """Draw 1-2 objects in distinct cells, sorted in reading order so the caption is a function of the image."""
    num_objects = int(rng.integers(1, 3))
    cells = rng.choice(GRID_SIZE * GRID_SIZE, size=num_objects, replace=False)
    specs = [
        ShapeSpec(
            size=str(rng.choice(list(SIZES))),
            colour=str(rng.choice(list(COLOURS))),
            shape=str(rng.choice(SHAPES)),
            cell=(int(c) // GRID_SIZE, int(c) % GRID_SIZE),
        )
        for c in cells
    ]
    return sorted(specs, key=lambda s: s.cell)


def caption_for(specs: list[ShapeSpec]) -> str:
    """Caption naming every object in order, joined by ' and '."""
    return " and ".join(spec.phrase() for spec in specs)


def render_shapes(specs: list[ShapeSpec], image_size: int, rng: np.random.Generator,
                  noise_std: float = NOISE_STD) -> np.ndarray:
    """Draw objects on a noisy background; returns raw RGB in [0, 1], float32 [3, image_size, image_size]."""
    cell_px = image_size / GRID_SIZE
    coords = np.arange(image_size, dtype=np.float32) + 0.5  # pixel centres
    yy, xx = np.meshgrid(coords, coords, indexing="ij")
    image = np.empty((NUM_CHANNELS, image_size, image_size), dtype=np.float32)
    image[:] = np.asarray(BACKGROUND_RGB, dtype=np.float32)[:, None, None]
    for spec in specs:
        jitter_y, jitter_x = rng.uniform(-MAX_JITTER, MAX_JITTER, size=2) * cell_px
        cy = (spec.cell[0] + 0.5) * cell_px + jitter_y
        cx = (spec.cell[1] + 0.5) * cell_px + jitter_x
        r = SIZES[spec.size] * cell_px
        dy, dx = yy - cy, xx - cx
        if spec.shape == "circle":
            mask = dy**2 + dx**2 <= r**2
        elif spec.shape == "square":
            # Shrunk so a square and a circle of the same size cover similar areas.
            mask = (np.abs(dy) <= 0.88 * r) & (np.abs(dx) <= 0.88 * r)
        else:  # triangle, apex up: half-width grows linearly from 0 at the top to r at the base
            mask = (dy >= -r) & (dy <= r) & (np.abs(dx) <= (dy + r) / 2)
        image[:, mask] = np.asarray(COLOURS[spec.colour], dtype=np.float32)[:, None]
    if noise_std:
        image += rng.normal(0.0, noise_std, size=image.shape).astype(np.float32)
    return np.clip(image, 0.0, 1.0)


def normalize_image(raw: np.ndarray) -> np.ndarray:
    """Map raw RGB [3, H, W] in [0, 1] to the model's input scale with PIXEL_MEAN / PIXEL_STD."""
    mean = np.asarray(PIXEL_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(PIXEL_STD, dtype=np.float32)[:, None, None]
    return ((raw - mean) / std).astype(np.float32)


def denormalize_image(image: np.ndarray) -> np.ndarray:
    """Inverse of normalize_image: [3, H, W] model input back to raw RGB."""
    mean = np.asarray(PIXEL_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(PIXEL_STD, dtype=np.float32)[:, None, None]
    return image * std + mean


def make_text_only_sample(rng: np.random.Generator) -> Sample:
    """A text continuation with a predictable rest: counting, copying, or a caption split in two."""
    kind = int(rng.integers(3))
    if kind == 0:
        start, count = int(rng.integers(0, 90)), int(rng.integers(6, 11))
        numbers = [str(n) for n in range(start, start + count)]
        half = count // 2
        return Sample(None, "count: " + " ".join(numbers[:half]), " ".join(numbers[half:]))
    if kind == 1:
        words = [NUMBER_WORDS[int(d)] for d in rng.integers(0, 10, size=int(rng.integers(2, 6)))]
        return Sample(None, "repeat: " + " ".join(words) + " =", " ".join(words))
    words = caption_for(sample_shapes(rng)).split(" ")
    cut = max(1, len(words) // 2)
    return Sample(None, " ".join(words[:cut]), " ".join(words[cut:]))


class SyntheticImageCaptionDataset(torch.utils.data.Dataset):
    """Map-style dataset of Samples: image->caption, plus a fraction of text-only continuations.

    This rank sees global indices ``rank, rank + world_size, ...`` (num_samples // world_size of
    them, so every rank has the same length); the sample at a global index never depends on sharding.
    """

    def __init__(
        self,
        num_samples: int,
        image_size: int = 32,
        seed: int = 0,
        text_only_fraction: float = 0.2,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if num_samples < world_size:
            raise ValueError(f"num_samples={num_samples} is smaller than world_size={world_size}")
        if image_size < GRID_SIZE * 3:
            raise ValueError(f"image_size={image_size} is too small to draw a {GRID_SIZE}x{GRID_SIZE} grid")
        if not 0.0 <= text_only_fraction <= 1.0:
            raise ValueError(f"text_only_fraction must be in [0, 1], got {text_only_fraction}")
        self.num_samples = num_samples
        self.image_size = image_size
        self.seed = seed
        self.text_only_fraction = text_only_fraction
        self.rank = rank
        self.world_size = world_size

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image, for collate."""
        return (NUM_CHANNELS, self.image_size, self.image_size)

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def global_index(self, local_index: int) -> int:
        """Global sample index behind this rank's ``local_index``."""
        if not 0 <= local_index < len(self):
            raise IndexError(f"index {local_index} out of range for {len(self)} local samples")
        return self.rank + local_index * self.world_size

    def __getitem__(self, local_index: int) -> Sample:
        return self.sample_at(self.global_index(local_index))

    def sample_at(self, global_index: int) -> Sample:
        """The sample at ``global_index``, generated from (seed, global_index) only."""
        rng = np.random.default_rng([self.seed, global_index])
        if rng.random() < self.text_only_fraction:
            return make_text_only_sample(rng)
        specs = sample_shapes(rng)
        image = normalize_image(render_shapes(specs, self.image_size, rng))
        return Sample(image=image, source=CAPTION_PROMPT, target=caption_for(specs))


def shuffled_images(batch: MultimodalBatch, generator: torch.Generator) -> MultimodalBatch:
    """Copy of ``batch`` whose images [B, C, H, W] are deranged among rows with has_image; text is shared."""
    image_rows = torch.nonzero(batch.has_image, as_tuple=False).flatten()
    num_rows = image_rows.numel()
    images = batch.images.clone()
    if num_rows >= 2:
        order = torch.randperm(num_rows, generator=generator, device=generator.device).to(image_rows.device)
        # Each row takes the image of the next row in a random cycle, so no row keeps its own image
        # (a plain permutation would leave ~1 row unshuffled and blunt the eval's contrast).
        receivers = image_rows[order]
        donors = image_rows[order.roll(-1)]
        images[receivers] = batch.images[donors]
    return dataclasses.replace(batch, images=images)
