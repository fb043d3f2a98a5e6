"""The text tokenizers m6 can load, and ``load_tokenizer(spec)``, the one way the data pipeline gets one.

Two kinds share one interface (encode, decode, is_special, vocab_size and the five special ids):
ByteTokenizer (m6.data.byte_tokenizer; no vocabulary file) and HFTokenizer (m6.data.bpe_tokenizer;
a trained byte-level BPE ``tokenizer.json``). Training a BPE tokenizer:

    python -m m6.data.tokenizer train --input a.txt b.jsonl --vocab-size 32000 --out tok.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from m6.data.bpe_tokenizer import HFTokenizer, main
from m6.data.byte_tokenizer import ByteTokenizer

TextTokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str | Path | None) -> TextTokenizer:
    """None or "byte" -> ByteTokenizer; anything else is the path of a tokenizer.json."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "load_tokenizer"]


if __name__ == "__main__":
    # `python -m m6.data.tokenizer train ...` is the BPE trainer's CLI (m6.data.bpe_tokenizer.main).
    sys.exit(main())
