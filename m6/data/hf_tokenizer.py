"""Any Hugging Face ``tokenizer.json`` (byte-level BPE, WordPiece, ...) behind m6's tokenizer interface.

m6 frames every text row with four special-token ROLES (m6.data.batch): ``bos`` opens the source,
``sep`` closes it, ``eos`` closes the target, ``pad`` fills the row. ``img`` is kept for the
interface but no batch ever holds it (images enter the model as patch embeddings), so it may be
absent (None). Each role names a token string of the file's vocabulary; by default m6's own names
(``<pad> <bos> <eos> <sep> <img>``), so files trained by m6.data.bpe_tokenizer load unchanged. Roles
may share a token (BERT: ``[SEP]`` as both sep and eos): m6 finds the source/target boundary and the
end of a row by position and segment id, never by looking for a token id. The file's normalizer,
pre-tokenizer, model and decoder are used exactly as it defines them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import tokenizers

ROLES = ("pad", "bos", "eos", "sep", "img")
OPTIONAL_ROLES = ("img",)  # no batch carries an image token id; a vocabulary may lack one
DEFAULT_SPECIAL_TOKENS: dict[str, str] = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "sep": "<sep>",
                                          "img": "<img>"}
# How a vocabulary entry looks when it is a control token: [PAD], <s>, <|endoftext|>, <unused3>.
_SPECIAL_LOOKING = re.compile(r"^(\[[A-Za-z0-9_]+\]|<\|?[A-Za-z0-9_/]+\|?>)$")
NUM_SHOWN_CANDIDATES = 10


class MissingSpecialTokens(ValueError):
    """Roles whose token is not in the file's vocabulary; ``available`` lists tokens that look special."""

    def __init__(self, path: Path, missing: dict[str, str], available: list[str]) -> None:
        self.path, self.missing, self.available = path, missing, available
        named = ", ".join(f"{token} (role {role})" for role, token in missing.items())
        super().__init__(f"{path}: tokenizer lacks special tokens {named}")


def resolve_special_tokens(special_tokens: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """m6's default names overlaid with ``special_tokens``; ValueError for an unknown or unset required role."""
    mapping: dict[str, str | None] = dict(DEFAULT_SPECIAL_TOKENS)
    for role, token in (special_tokens or {}).items():
        if role not in ROLES:
            raise ValueError(f"unknown special-token role {role!r}; the roles are {', '.join(ROLES)}")
        if token is None and role not in OPTIONAL_ROLES:
            raise ValueError(f"special-token role {role!r} needs a token (only {', '.join(OPTIONAL_ROLES)} may be null)")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError(f"special-token role {role!r}: expected a non-empty token string, got {token!r}")
        mapping[role] = token
    return mapping


def special_looking_tokens(tok: tokenizers.Tokenizer, limit: int = NUM_SHOWN_CANDIDATES) -> list[str]:
    """Up to ``limit`` tokens of ``tok`` a role could map to: its added tokens, else bracketed vocabulary entries."""
    added = sorted(tok.get_added_tokens_decoder().items())
    if added:
        return [token.content for _, token in added[:limit]]
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    return [token for token, _ in vocab if _SPECIAL_LOOKING.match(token)][:limit]


class HFTokenizer:
    """Wraps a ``tokenizer.json`` so it encodes/decodes like ByteTokenizer (no specials added on encode).

    ``special_tokens`` maps roles to token strings (missing roles keep m6's default names).
    """

    def __init__(self, path: str | Path, special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.path = Path(path)
        self.special_tokens = resolve_special_tokens(special_tokens)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"{self.path}: not a valid tokenizer.json ({exc})") from exc
        ids = {role: None if token is None else self._tok.token_to_id(token)
               for role, token in self.special_tokens.items()}
        missing = {role: token for role, token in self.special_tokens.items() if token is not None and ids[role] is None}
        if missing:
            raise MissingSpecialTokens(self.path, missing, special_looking_tokens(self._tok))
        self._set_encode_special_tokens()
        self.pad_id: int = ids["pad"]
        self.bos_id: int = ids["bos"]
        self.eos_id: int = ids["eos"]
        self.sep_id: int = ids["sep"]
        self.img_id: int | None = ids["img"]
        self._special_ids = frozenset(i for i in ids.values() if i is not None)

    def _set_encode_special_tokens(self) -> None:
        # Text that literally contains "<eos>" or "[SEP]" is data, not a control token, exactly as with
        # ByteTokenizer; otherwise a corpus could inject specials into the training stream.
        self._tok.encode_special_tokens = True

    def __setstate__(self, state: dict) -> None:
        # Pickling (DataLoader workers under spawn/forkserver) round-trips the tokenizer through its
        # JSON, which does not carry encode_special_tokens: set it again.
        self.__dict__.update(state)
        self._set_encode_special_tokens()

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids, added (special) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Encode text with the file's normalizer, pre-tokenizer and model; adds no special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids with the file's decoder, dropping the role ids (other added tokens, e.g. [UNK], stay)."""
        # Filter ourselves: a hand-made file may hold "<pad>" etc. without marking them special, and
        # an [UNK] or [MASK] in the text is content a reader should see, so skip_special_tokens is off.
        kept = [i for i in (int(x) for x in ids) if i not in self._special_ids]
        return self._tok.decode(kept, skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """True for the ids the roles map to (PAD, BOS, EOS, SEP, and IMG when mapped)."""
        return int(token_id) in self._special_ids

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"
