"""A BERT-style WordPiece tokenizer.json (built offline here) trains m6 through data.special_tokens:
role ids at the right places in real batches, the file's normalizer and decoder, and the config errors."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import train as train_entry
from m6.config import SpecialTokensConfig, load, to_dict
from m6.data.batch import IGNORE_INDEX, SEG_PAD, SEG_SOURCE, SEG_TARGET, Sample, collate
from m6.data.byte_tokenizer import SPECIAL_TOKENS as BYTE_SPECIAL_TOKENS
from m6.data.hf_tokenizer import DEFAULT_SPECIAL_TOKENS, ROLES, HFTokenizer
from m6.data.make_sample import sample_png
from m6.data.pipeline import build_training_data
from m6.data.synthetic import CAPTION_PROMPT

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
BERT_VOCAB_SIZE = 21128  # bert-base-chinese, the vocabulary the M6 paper used
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# bert-base-chinese's layout: [PAD]=0, [unused1..99], [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103.
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
BERT_ROLES = {"pad": "[PAD]", "bos": "[CLS]", "eos": "[SEP]", "sep": "[SEP]", "img": None}

# Each document and what the file's BertNormalizer (lowercase, spaces around CJK characters) and
# WordPiece decoder (## pieces glued, spaces before , and ! cleaned up) make of it.
READABLE = {
    "The Mixture of Experts routes each token": "the mixture of experts routes each token",
    "多模态预训练模型": "多 模 态 预 训 练 模 型",
    "Experts learn different things, unbelievably well!": "experts learn different things, unbelievably well!",
    "图像和文本 together": "图 像 和 文 本 together",
    "A literal [SEP] or <eos> in the text stays text": "a literal [ sep ] or < eos > in the text stays text",
    "Tokens go to the top experts": "tokens go to the top experts",
    "专家混合模型 routes tokens": "专 家 混 合 模 型 routes tokens",
}
CAPTIONS = {
    "A red circle at the top": "a red circle at the top",
    "一个蓝色的方块 in the middle": "一 个 蓝 色 的 方 块 in the middle",
    "Two shapes, one Green": "two shapes, one green",
    "左上角的圆 at the left": "左 上 角 的 圆 at the left",
}


def write_bert_tokenizer(path: Path) -> Path:
    """Train a WordPiece vocabulary on the documents, lay it out like bert-base-chinese, save tokenizer.json."""
    trained = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    trained.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True)
    trained.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # min_frequency 3: words seen once or twice stay in ## pieces, so decoding has pieces to glue.
    trainer = trainers.WordPieceTrainer(vocab_size=400, min_frequency=3, special_tokens=BERT_SPECIALS,
                                        show_progress=False)
    corpus = [*READABLE, *CAPTIONS, CAPTION_PROMPT, "[brackets] and <angles> for the masks"]
    trained.train_from_iterator(corpus * 2, trainer=trainer)
    learned = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]) if t not in BERT_SPECIALS]
    tokens = ["[PAD]", *(f"[unused{i}]" for i in range(1, 100)), "[UNK]", "[CLS]", "[SEP]", "[MASK]", *learned]
    tokens += [f"[unused{i}]" for i in range(100, 100 + BERT_VOCAB_SIZE - len(tokens))]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(BERT_SPECIALS)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bert_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert_tokenizer(tmp_path_factory.mktemp("bert") / "tokenizer.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text source (one document a line) and a JSONL manifest of images with captions."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "docs.txt").write_text("\n".join(READABLE) + "\n", encoding="utf-8")
    (root / "img").mkdir()
    lines = []
    for i, caption in enumerate(CAPTIONS):
        (root / "img" / f"{i}.png").write_bytes(sample_png(i)[0])
        lines.append(json.dumps({"image": f"img/{i}.png", "text": caption}, ensure_ascii=False))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def bert_overrides(tokenizer: Path, corpus: Path, run_dir: Path) -> list[str]:
    roles = [f"data.special_tokens.{role}=" + ("null" if token is None else f'"{token}"')
             for role, token in BERT_ROLES.items()]
    return [
        f"run.dir={run_dir}", "model.vocab_size=21128", "model.d_model=32", "model.num_layers=2", "model.num_heads=2",
        "model.ffn_dim=64", "model.max_text_len=128", "model.moe.num_experts=4", "data.kind=files",
        f"data.sources=[{{path: '{corpus}/captions.jsonl', format: jsonl}}, {{path: '{corpus}/docs.txt', format: text}}]",
        f"data.tokenizer={tokenizer}", *roles,
        # caption and denoise both have the record's whole text as target: every row can be checked.
        "data.tasks={caption: 1.0, denoise: 1.0}", "data.seq_len=128", "data.num_workers=0", "data.eval_samples=2",
        "train.global_batch_size=4", "train.max_steps=3", "train.eval_every=0", "train.eval_batches=1",
        "logging.every=1", "logging.console=false", "checkpoint.every=0", "checkpoint.async_save=false",
    ]


# ---------------------------------------------------------------- the tokenizer on its own
def test_roles_map_by_name_to_the_files_ids(bert_file: Path) -> None:
    tok = HFTokenizer(bert_file, BERT_ROLES)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, tok.img_id) == (PAD, CLS, SEP, SEP, None)
    assert tok.vocab_size == BERT_VOCAB_SIZE
    assert [i for i in range(BERT_VOCAB_SIZE) if tok.is_special(i)] == [PAD, CLS, SEP]


def test_normalizer_pre_tokenizer_and_decoder_are_the_files(bert_file: Path) -> None:
    tok = HFTokenizer(bert_file, BERT_ROLES)
    raw = Tokenizer.from_file(str(bert_file))
    pieces = raw.id_to_token
    ids = tok.encode("Unbelievably 多模态!")
    assert [pieces(i) for i in ids[-4:]] == ["多", "模", "态", "!"]  # Chinese split per character
    assert pieces(ids[0]) == "u" and all(pieces(i).startswith("##") for i in ids[1:-4])  # lowercased, ## pieces
    assert tok.decode(ids) == "unbelievably 多 模 态!"
    for text, readable in {**READABLE, **CAPTIONS}.items():
        assert tok.decode(tok.encode(text)) == readable


def test_decode_drops_role_ids_and_shows_other_added_tokens(bert_file: Path) -> None:
    tok = HFTokenizer(bert_file, BERT_ROLES)
    words = tok.encode("tokens go to the top")
    assert tok.decode([CLS, *words, SEP, *words, SEP, PAD, PAD]) == "tokens go to the top tokens go to the top"
    assert tok.decode([CLS, *tok.encode("tokens go"), UNK, MASK, SEP]) == "tokens go [UNK] [MASK]"


def test_literal_special_strings_are_text_also_after_pickling(bert_file: Path) -> None:
    """A corpus cannot inject control ids; DataLoader workers started by spawn get a pickled copy."""
    tok = HFTokenizer(bert_file, BERT_ROLES)
    for copy in (tok, pickle.loads(pickle.dumps(tok))):
        ids = copy.encode("a [SEP] b [CLS] [PAD] [MASK]")
        assert not set(ids) & {PAD, UNK, CLS, SEP, MASK}, ids


def test_defaults_are_m6s_names_everywhere() -> None:
    assert DEFAULT_SPECIAL_TOKENS == to_dict(SpecialTokensConfig()) == dict(zip(ROLES, BYTE_SPECIAL_TOKENS))


def test_eos_shared_with_sep_changes_only_the_eos_ids(bert_file: Path) -> None:
    """m6 finds the source/target boundary and the row's end by position: with eos == sep the segments
    and which positions carry labels are those of distinct tokens; only the eos id itself differs."""
    shared = HFTokenizer(bert_file, BERT_ROLES)
    distinct = HFTokenizer(bert_file, {**BERT_ROLES, "eos": "[MASK]"})
    samples = [Sample(None, "tokens go", "to the top experts"), Sample(None, "多模态", "预训练模型"),
               Sample(None, "a red", "circle at the top of a long row that will not fit " * 4)]
    a, b = (collate(samples, tok, 24, (3, 8, 8)) for tok in (shared, distinct))
    assert torch.equal(a.segment_ids, b.segment_ids) and torch.equal(a.labels != IGNORE_INDEX, b.labels != IGNORE_INDEX)
    differ = a.text_ids != b.text_ids
    assert torch.equal(a.text_ids[differ], torch.full_like(a.text_ids[differ], SEP))
    assert torch.equal(b.text_ids[differ], torch.full_like(b.text_ids[differ], MASK))
    assert int(differ.sum()) == 2  # rows 0 and 1 end with eos; row 2 is cut before its eos


# ---------------------------------------------------------------- training through the CLI
def test_bert_vocabulary_trains_and_batches_hold_the_mapped_ids(bert_file, corpus, tmp_path, capsys) -> None:
    overrides = bert_overrides(bert_file, corpus, tmp_path / "run")
    assert train_entry.main(["--config", TINY, *overrides]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 3 and all(0 < loss < 12 for loss in losses), losses  # ln(21128) = 9.96 at the start

    # The same config through the same pipeline: the micro-batches of the run's first steps.
    data = build_training_data(load(TINY, overrides), rank=0, world_size=1)
    tok = data.tokenizer
    documents = {"docs.txt": list(READABLE), "captions.jsonl": list(CAPTIONS)}
    readable = {**READABLE, **CAPTIONS}
    prompt = [CLS, *tok.encode(CAPTION_PROMPT), SEP]
    seen = Counter()
    for _ in range(4):
        batches, _ = data.loader.next_step()
        for loaded in batches:
            batch = loaded.batch
            for b, (path, key) in enumerate(loaded.origins):
                line = int(key.split(":")[0].removeprefix("line "))
                text = documents[Path(path).name][line - 1]
                ids, seg = batch.text_ids[b].tolist(), batch.segment_ids[b]
                source = [i for i, s in zip(ids, seg.tolist()) if s == SEG_SOURCE]
                target = [i for i, s in zip(ids, seg.tolist()) if s == SEG_TARGET]
                assert source[0] == CLS and source[-1] == SEP and not {PAD, CLS, SEP} & set(source[1:-1])
                if batch.has_image[b]:  # caption task: the prompt is the source
                    assert source == prompt
                assert target == [*tok.encode(text), SEP]  # eos == [SEP] closes the target
                assert tok.decode(target) == readable[text]
                assert all(i == PAD for i, s in zip(ids, seg.tolist()) if s == SEG_PAD)
                labelled = batch.labels[b] != IGNORE_INDEX
                assert batch.labels[b][labelled].tolist() == target  # [SEP] predicts t_1 ... t_n predicts [SEP]
                seen[Path(path).name] += 1
    data.loader.close()
    assert seen["docs.txt"] > 0 and seen["captions.jsonl"] > 0


# ---------------------------------------------------------------- errors: exit code 2, one line
def _train_error(capsys, overrides: list[str]) -> str:
    code = train_entry.main(["--config", TINY, *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "config error: " in err and "Traceback" not in err, err
    return err


def test_token_missing_from_the_vocabulary_is_named(bert_file, corpus, tmp_path, capsys) -> None:
    err = _train_error(capsys, [*bert_overrides(bert_file, corpus, tmp_path / "r"), "data.special_tokens.bos=<s>"])
    assert "data.special_tokens.bos='<s>'" in err and str(bert_file) in err
    assert "[PAD], [UNK], [CLS], [SEP], [MASK]" in err and "data.special_tokens.eos" not in err


def test_m6_names_on_a_bert_file_list_every_missing_role(bert_file, corpus, tmp_path, capsys) -> None:
    keep = [o for o in bert_overrides(bert_file, corpus, tmp_path / "r") if not o.startswith("data.special_tokens")]
    err = _train_error(capsys, keep)
    for role, token in DEFAULT_SPECIAL_TOKENS.items():
        assert f"data.special_tokens.{role}='{token}'" in err
    assert "data.special_tokens.img may be null" in err


def test_unknown_role_is_a_config_error(bert_file, corpus, tmp_path, capsys) -> None:
    err = _train_error(capsys, [*bert_overrides(bert_file, corpus, tmp_path / "r"), 'data.special_tokens.cls="[CLS]"'])
    assert "data.special_tokens.cls" in err and "pad, bos, eos, sep, img" in err
    assert not (tmp_path / "r").exists()  # refused before any work


def test_mapping_on_the_byte_tokenizer_is_a_config_error(tmp_path, capsys) -> None:
    err = _train_error(capsys, [f"run.dir={tmp_path / 'r'}", "data.tokenizer=byte", 'data.special_tokens.pad="[PAD]"'])
    assert "data.special_tokens.pad='[PAD]'" in err and "byte tokenizer" in err and "data.tokenizer" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override, expected", [
    ("data.special_tokens.eos=null", "data.special_tokens.eos: expected str, got None"),
    ("data.special_tokens.pad=[PAD]", 'quote it, "[PAD]"'),
    ("model.vocab_size=21127", "set model.vocab_size=21128"),
])
def test_other_mapping_mistakes_are_config_errors(bert_file, corpus, tmp_path, capsys, override, expected) -> None:
    err = _train_error(capsys, [*bert_overrides(bert_file, corpus, tmp_path / "r"), override])
    assert expected in err, err
