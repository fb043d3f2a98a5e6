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
