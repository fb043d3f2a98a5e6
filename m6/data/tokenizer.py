"""The text tokenizers m6 can load, and ``load_tokenizer(spec, special_tokens)``, the one way the data
pipeline gets one.

Two kinds share one interface (encode, decode, is_special, vocab_size and the five special ids):
ByteTokenizer (m6.data.byte_tokenizer; no vocabulary file, fixed special ids) and HFTokenizer
(m6.data.hf_tokenizer; any Hugging Face ``tokenizer.json``, its special-token roles mapped to tokens
of its vocabulary). Training m6's byte-level BPE tokenizer:

    python -m m6.data.tokenizer train --input a.txt b.jsonl --vocab-size 32000 --out tok.json
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from m6.data.bpe_tokenizer import main
from m6.data.byte_tokenizer import SPECIAL_TOKENS as BYTE_SPECIAL_TOKENS
from m6.data.byte_tokenizer import ByteTokenizer
from m6.data.hf_tokenizer import ROLES, HFTokenizer, resolve_special_tokens

TextTokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str | Path | None, special_tokens: Mapping[str, str | None] | None = None) -> TextTokenizer:
    """None or "byte" -> ByteTokenizer; anything else is the path of a tokenizer.json, its roles mapped
    by ``special_tokens`` (role -> token; roles left out keep m6's names <pad> <bos> <eos> <sep> <img>)."""
    if spec is None or spec == "byte":
        # The byte tokenizer's specials are fixed ids with m6's names: a mapping that renames one
        # could not be honoured, so it is an error rather than silently ignored.
        byte_names = dict(zip(ROLES, BYTE_SPECIAL_TOKENS))
        renamed = {role: token for role, token in resolve_special_tokens(special_tokens).items()
                   if token != byte_names[role]}
        if renamed:
            raise ValueError(f"special tokens {renamed} are mapped, but the byte tokenizer has fixed special ids "
                             f"with m6's names ({', '.join(BYTE_SPECIAL_TOKENS)}) and no vocabulary to map them to")
        return ByteTokenizer()
    return HFTokenizer(spec, special_tokens)


__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "load_tokenizer"]


if __name__ == "__main__":
    # `python -m m6.data.tokenizer train ...` is the BPE trainer's CLI (m6.data.bpe_tokenizer.main).
    sys.exit(main())
