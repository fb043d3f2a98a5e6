"""Write the embedded sample corpus: image-caption tar shards and a text file, deterministically.

    python -m m6.data.make_sample --out data/sample [--pairs 1536] [--shard-size 512] [--docs 1024]

The images are rendered scenes of coloured shapes (the synthetic task's renderer, without pixel
noise so the PNGs stay small) captioned with what is where; the text file holds counting, copying
and sentence documents for the text-only tasks. Same arguments, same files: the main job
(configs/tiny.yaml) trains on them through the real loader (tar -> tokenizer -> tasks -> model)
with no download.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence

import numpy as np
from PIL import Image

from m6.data.prepare import ShardWriter
from m6.data.synthetic import caption_for, make_text_only_sample, render_shapes, sample_shapes

SAMPLE_SEED = 20261121
IMAGE_SIZE = 32
# The per-channel pixel mean and std (0-1 scale) configs/tiny.yaml normalises this corpus with
# (its data.image_mean / data.image_std): a config copied from it for other images keeps them, and
# the banner says so.
SAMPLE_IMAGE_MEAN = (0.1316, 0.1278, 0.1253)
SAMPLE_IMAGE_STD = (0.1468, 0.1267, 0.1318)


def is_sample_corpus_statistics(mean: Sequence[float], std: Sequence[float]) -> bool:
    """Whether ``mean``/``std`` are this corpus's statistics (copied from configs/tiny.yaml)."""
    return (len(mean) == len(SAMPLE_IMAGE_MEAN) and len(std) == len(SAMPLE_IMAGE_STD)
            and all(abs(a - b) < 5e-5 for a, b in zip([*mean, *std], [*SAMPLE_IMAGE_MEAN, *SAMPLE_IMAGE_STD])))


def is_sample_corpus_path(path: str) -> bool:
    """Whether a data.sources path names this corpus's files (``sample-*.tar`` or ``text.txt`` in a
    folder named ``sample``, as ``--out data/sample`` writes them)."""
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(os.path.normpath(path))) == "sample" and (
        name.startswith("sample-") and name.endswith(".tar") or name == "text.txt")


def sample_png(index: int, seed: int = SAMPLE_SEED) -> tuple[bytes, str]:
    """PNG bytes and caption of pair ``index``."""
    rng = np.random.default_rng([seed, index])
    specs = sample_shapes(rng)
    # No pixel noise: noise defeats PNG compression, and the loader's crop already varies the input.
    pixels = render_shapes(specs, IMAGE_SIZE, rng, noise_std=0.0)  # float [3, H, W] in [0, 1]
    rgb = (pixels.transpose(1, 2, 0) * 255.0).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG", optimize=True)
    return buf.getvalue(), caption_for(specs)


def text_document(index: int, seed: int = SAMPLE_SEED) -> str:
    """One line of the text corpus."""
    sample = make_text_only_sample(np.random.default_rng([seed, 1, index]))
    return f"{sample.source} {sample.target}"


def write_sample(out_dir: str, pairs: int, shard_size: int, docs: int) -> tuple[int, int]:
    """Write ``sample-NNNNNN.tar`` shards and ``text.txt`` into ``out_dir``; returns (shards, pairs)."""
    os.makedirs(out_dir, exist_ok=True)
    writer = ShardWriter(out_dir, "sample", shard_size)
    for i in range(pairs):
        png, caption = sample_png(i)
        writer.write(f"{i:09d}", png, "png", caption)
    writer.close()
    with open(os.path.join(out_dir, "text.txt"), "w", encoding="utf-8") as f:
        f.writelines(text_document(i) + "\n" for i in range(docs))
    return writer.num_shards, pairs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--pairs", type=int, default=1536)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--docs", type=int, default=1024)
    args = p.parse_args(argv)
    if min(args.pairs, args.shard_size, args.docs) <= 0:
        p.error("--pairs, --shard-size and --docs must be > 0")
    shards, pairs = write_sample(args.out, args.pairs, args.shard_size, args.docs)
    print(f"wrote {pairs} image-caption pairs in {shards} shards and {args.docs} text documents to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
