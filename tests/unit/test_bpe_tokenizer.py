"""Byte-level BPE tokenizer: exact round trips, fixed special ids, loader dispatch, errors, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from m6.data.bpe_tokenizer import HFTokenizer, main, train_bpe
from m6.data.byte_tokenizer import ByteTokenizer
from m6.data.tokenizer import load_tokenizer

ENGLISH = ["the model", "mixture of experts", "routes each token", "to the top experts", "multimodal"]
CHINESE = ["多模态预训练", "专家混合模型", "图像和文本", "中文分词测试"]
EMOJI = ["🙂", "🚀", "🐼", "👍🏽"]

ROUND_TRIP_CASES = [
    "",
    "the model routes each token",
    "多模态预训练 with experts 🚀",
    "   leading and trailing   ",
    "tabs\t\tand\nnew\n\nlines\r\n",
    "ሰላም ዓለም — Ελληνικά, עברית, ∮ E⋅da = Q",  # scripts never seen in training
    "\x00\x01\x7f control bytes",
    "🧪🦩 unseen emoji, and ZWJ 👩‍👩‍👧",
    "literal <eos> and <pad> in text stay text",
    "a" * 200,
]


def write_corpus(path: Path, num_lines: int = 400, seed: int = 0) -> Path:
    """Write a small mixed English / Chinese / emoji corpus, one document per line."""
    rng = random.Random(seed)
    pool = ENGLISH + CHINESE + EMOJI
    lines = [" ".join(rng.choice(pool) for _ in range(rng.randint(3, 8))) for _ in range(num_lines)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    root = tmp_path_factory.mktemp("bpe")
    corpus = write_corpus(root / "corpus.txt")
    return train_bpe([str(corpus)], vocab_size=400, out_path=root / "tok" / "tokenizer.json")


def test_special_ids_are_first_five(trained: HFTokenizer) -> None:
    got = (trained.pad_id, trained.bos_id, trained.eos_id, trained.sep_id, trained.img_id)
    assert got == (0, 1, 2, 3, 4)
    assert all(trained.is_special(i) for i in range(5)) and not trained.is_special(5)
    assert 261 < trained.vocab_size <= 400  # bytes + specials + some learned merges


@pytest.mark.parametrize("text", ROUND_TRIP_CASES)
def test_round_trip_is_exact(trained: HFTokenizer, text: str) -> None:
    ids = trained.encode(text)
    assert all(0 <= i < trained.vocab_size for i in ids)
    assert trained.decode(ids) == text


def test_random_unicode_round_trips(trained: HFTokenizer) -> None:
    rng = random.Random(1)
    # Skip surrogates (not encodable as UTF-8); cover BMP and astral planes.
    chars = [c for c in map(chr, rng.sample(range(0x11000), 3000)) if not 0xD800 <= ord(c) <= 0xDFFF]
    for start in range(0, len(chars), 100):
        text = "".join(chars[start : start + 100])
        assert trained.decode(trained.encode(text)) == text


def test_encode_adds_no_specials_and_decode_skips_them(trained: HFTokenizer) -> None:
    ids = trained.encode("the model")
    assert not any(trained.is_special(i) for i in ids)
    framed = [trained.bos_id, *ids, trained.sep_id, trained.img_id, *ids, trained.eos_id, trained.pad_id]
    assert trained.decode(framed) == "the modelthe model"
    # Literal special strings are data, not control ids (same contract as ByteTokenizer).
    assert not any(trained.is_special(i) for i in trained.encode("<eos><pad>"))


def test_frequent_words_compress(trained: HFTokenizer) -> None:
    for text in ["mixture of experts", "多模态预训练", "routes each token"]:
        assert len(trained.encode(text)) < len(text.encode("utf-8")) / 2, text


def test_decode_accepts_tensors(trained: HFTokenizer) -> None:
    import torch
    ids = trained.encode("专家混合模型 🐼")
    assert trained.decode(torch.tensor(ids)) == "专家混合模型 🐼"


def test_reload_gives_same_ids(trained: HFTokenizer) -> None:
    again = HFTokenizer(trained.path)
    text = "多模态预训练 mixture of experts 🚀"
    assert again.encode(text) == trained.encode(text)
    assert again.vocab_size == trained.vocab_size


def test_load_tokenizer_dispatch(trained: HFTokenizer) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    tok = load_tokenizer(str(trained.path))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == trained.vocab_size
    assert isinstance(load_tokenizer(trained.path), HFTokenizer)


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        HFTokenizer(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(missing))


def _hand_made(path: Path, specials: list[str], mark_special: bool = True) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if mark_special:
        tok.add_special_tokens(specials)
    tok.save(str(path))
    return path


def test_missing_special_tokens_named(tmp_path: Path) -> None:
    path = _hand_made(tmp_path / "partial.json", ["<pad>", "<bos>", "<eos>"])
    with pytest.raises(ValueError, match="partial.json") as info:
        HFTokenizer(path)
    assert "<sep>" in str(info.value) and "<img>" in str(info.value)
    assert "<pad>" not in str(info.value)


def test_specials_skipped_even_when_not_marked_special(tmp_path: Path) -> None:
    specials = ["<pad>", "<bos>", "<eos>", "<sep>", "<img>"]
    tok = HFTokenizer(_hand_made(tmp_path / "plain.json", specials, mark_special=False))
    ids = tok.encode("hi 中")
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "hi 中"


def test_malformed_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="broken.json"):
        HFTokenizer(path)


def test_train_rejects_bad_arguments(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", num_lines=20)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe([str(corpus)], vocab_size=100, out_path=tmp_path / "t.json")
    with pytest.raises(FileNotFoundError, match="absent.txt"):
        train_bpe([str(tmp_path / "absent.txt")], vocab_size=300, out_path=tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_cli_writes_loadable_file_from_txt_and_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    txt = write_corpus(tmp_path / "a.txt", num_lines=150, seed=2)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"text": line, "id": i}) for i, line in enumerate(CHINESE * 20)) + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out" / "tokenizer.json"
    rc = main(["train", "--input", str(txt), str(jsonl), "--vocab-size", "320", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert str(out) in printed
    tok = load_tokenizer(str(out))
    assert f"vocab_size={tok.vocab_size}" in printed
    assert isinstance(tok, HFTokenizer) and tok.pad_id == 0
    assert tok.decode(tok.encode("图像和文本 🚀")) == "图像和文本 🚀"
    assert len(tok.encode("专家混合模型")) < len("专家混合模型".encode("utf-8"))  # jsonl text was used
    assert not [p.name for p in out.parent.iterdir() if p.name != "tokenizer.json"]  # no temp left


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("missing.txt", None, "missing.txt"),
        ("bad.jsonl", '{"text": "ok"}\n{oops\n', "bad.jsonl:2"),
        ("notext.jsonl", '{"body": "x"}\n', "notext.jsonl:1"),
        ("latin1.txt", b"caf\xe9\n", "latin1.txt"),
    ],
)
def test_cli_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str, content: str | bytes | None, needle: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    out = tmp_path / "tok.json"
    rc = main(["train", "--input", str(path), "--vocab-size", "300", "--out", str(out)])
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_cli_bad_vocab_size_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    txt = write_corpus(tmp_path / "a.txt", num_lines=10)
    assert main(["train", "--input", str(txt), "--vocab-size", "10", "--out", str(tmp_path / "t.json")]) == 2
    assert "vocab_size" in capsys.readouterr().err
