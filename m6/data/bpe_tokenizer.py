"""Training m6's byte-level BPE tokenizer (Hugging Face `tokenizers`); it loads as an HFTokenizer.

A trained tokenizer lives in one `tokenizer.json`. Its first five ids are the special tokens
(<pad>, <bos>, <eos>, <sep>, <img> = 0..4, m6's default role names); every byte is in the base
alphabet, so any UTF-8 text (Chinese, emoji, characters never seen in training) round-trips exactly
with no unknown token.

    python -m m6.data.bpe_tokenizer train --input a.txt b.jsonl --vocab-size 32000 --out tok.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from m6.data.hf_tokenizer import DEFAULT_SPECIAL_TOKENS, HFTokenizer

# Order fixes the ids of a freshly trained tokenizer: <pad>=0, <bos>=1, <eos>=2, <sep>=3, <img>=4.
SPECIAL_TOKENS = tuple(DEFAULT_SPECIAL_TOKENS[role] for role in ("pad", "bos", "eos", "sep", "img"))
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the specials


def iter_documents(path: str | Path) -> Iterator[str]:
    """Yield the documents of a .txt file (one per line) or a .jsonl file (its "text" field)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    is_jsonl = path.suffix == ".jsonl"
    try:
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                line = line.rstrip("\n")
                if not is_jsonl:
                    yield line
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'{path}:{line_no}: record has no string "text" field')
                yield record["text"]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from exc


def _write_atomic(text: str, out_path: Path) -> None:
    """Write text to out_path via a temp file in the same folder, so readers never see half a file."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train_bpe(
    files: Sequence[str | Path], vocab_size: int, out_path: str | Path, min_frequency: int = 2
) -> HFTokenizer:
    """Train a byte-level BPE on the files' documents, write tokenizer.json to out_path, load it."""
    if not files:
        raise ValueError("train_bpe: no input files given")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} must be >= {MIN_VOCAB_SIZE} (256 bytes + 5 specials)")
    if min_frequency < 1:
        raise ValueError(f"min_frequency={min_frequency} must be >= 1")
    for path in files:  # fail before training, naming the file, rather than mid-stream
        if not Path(path).is_file():
            raise FileNotFoundError(f"input file not found: {path}")

    tok = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False keeps encode/decode an exact round trip (no invented leading space).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so bytes absent from the corpus still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def documents() -> Iterator[str]:
        for path in files:
            yield from iter_documents(path)

    tok.train_from_iterator(documents(), trainer=trainer)
    out_path = Path(out_path)
    _write_atomic(tok.to_str(), out_path)
    return HFTokenizer(out_path)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: `train --input FILES... --vocab-size N --out PATH [--min-frequency 2]`."""
    parser = argparse.ArgumentParser(prog="python -m m6.data.bpe_tokenizer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE tokenizer and write tokenizer.json")
    train.add_argument("--input", nargs="+", required=True, help=".txt (one document per line) or .jsonl")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    train.add_argument("--min-frequency", type=int, default=2)
    args = parser.parse_args(argv)

    try:
        tok = train_bpe(args.input, args.vocab_size, args.out, min_frequency=args.min_frequency)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"vocab_size={tok.vocab_size} path={tok.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
