"""Byte-level UTF-8 tokenizer that needs no vocabulary files.

Ids 0..255 are raw bytes, so any text (Chinese included) round-trips; the special tokens
follow at fixed ids so that checkpoints and batches agree without a vocab file.
"""

from __future__ import annotations

from collections.abc import Iterable

NUM_BYTES = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
SEP_ID = 259
IMG_ID = 260  # marks the image segment; the model may use it, the text stream never contains it
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID, "<sep>": SEP_ID, "<img>": IMG_ID}


class ByteTokenizer:
    """Maps text to UTF-8 byte ids (0..255) plus five fixed special ids (256..260)."""

    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    sep_id: int = SEP_ID
    img_id: int = IMG_ID

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids: 256 bytes + 5 specials = 261."""
        return NUM_BYTES + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        """Encode text as its UTF-8 bytes; adds no special tokens."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text, skipping special ids; invalid byte runs become U+FFFD."""
        # Accept tensors / numpy arrays too: int() turns 0-d elements into plain ints.
        data = bytes(i for i in (int(x) for x in ids) if 0 <= i < NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """True for ids that are not bytes (PAD, BOS, EOS, SEP, IMG)."""
        return token_id >= NUM_BYTES

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

