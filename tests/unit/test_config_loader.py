"""Unit tests for m6.config_loader against a small stand-alone schema (not the real m6 config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from m6.config_loader import (
    ConfigError,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)


@dataclass
class MoE:
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    router: Literal["topk", "sinkhorn"] = "topk"


@dataclass
class Model:
    dim: int = 64
    dropout: Optional[float] = None
    moe: MoE = field(default_factory=MoE)
    layer_kinds: list[str] = field(default_factory=lambda: ["dense", "moe"])
    patch_size: tuple[int, ...] = (16, 16)


@dataclass
class Train:
    max_steps: int = 100
    lr: float = 3e-4
    compile: bool = False
    micro_batch_size: int | Literal["auto"] = "auto"
    data_weights: dict[str, float] = field(default_factory=dict)
    run_name: str | None = None


@dataclass
class Root:
    model: Model = field(default_factory=Model)
    train: Train = field(default_factory=Train)

    def validate(self) -> None:
        if self.model.moe.top_k > self.model.moe.num_experts:
            raise ConfigError("model.moe.top_k: must be <= model.moe.num_experts")


@dataclass
class Opt:
    moe: Optional[MoE] = None


def errmsg(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return str(info.value)


def test_defaults_and_fresh_factories():
    a, b = from_dict(Root, {}), from_dict(Root, {})
    assert a == Root()
    assert a.model.moe.num_experts == 8 and a.train.micro_batch_size == "auto"
    a.model.layer_kinds.append("x")
    assert b.model.layer_kinds == ["dense", "moe"]


def test_nested_values_and_int_to_float():
    cfg = from_dict(Root, {"model": {"moe": {"num_experts": 64, "capacity_factor": 2}}})
    assert cfg.model.moe.num_experts == 64 and cfg.model.moe.top_k == 2  # siblings keep defaults
    assert cfg.model.moe.capacity_factor == 2.0 and type(cfg.model.moe.capacity_factor) is float
    assert cfg.model.dim == 64


@pytest.mark.parametrize("bad", [1, 0, "true", "yes", None])
def test_bool_is_strict(bad):
    msg = errmsg(from_dict, Root, {"train": {"compile": bad}})
    assert "train.compile: expected bool" in msg
    assert from_dict(Root, {"train": {"compile": True}}).train.compile is True


def test_int_rejects_bool_and_float():
    assert "train.max_steps: expected int, got True (bool)" in errmsg(from_dict, Root, {"train": {"max_steps": True}})
    assert "expected int, got 1.5 (float)" in errmsg(from_dict, Root, {"train": {"max_steps": 1.5}})


def test_wrong_type_message():
    msg = errmsg(from_dict, Root, {"train": {"max_steps": "ten"}})
    assert msg == "train.max_steps: expected int, got 'ten' (str)"


def test_literal_error_lists_allowed_values():
    msg = errmsg(from_dict, Root, {"model": {"moe": {"router": "hash"}}})
    assert "model.moe.router" in msg and "'hash'" in msg
    assert "'topk'" in msg and "'sinkhorn'" in msg


def test_unknown_key_suggestions():
    msg = errmsg(from_dict, Root, {"modle": {}})
    assert msg == "unknown config key 'modle'; did you mean 'model'?"
    msg = errmsg(from_dict, Root, {"model": {"moe": {"num_expert": 4}}})
    assert msg == "unknown config key 'model.moe.num_expert'; did you mean 'model.moe.num_experts'?"
    msg = errmsg(from_dict, Root, {"model": {"zzz": 1}})  # nothing close: list the valid keys
    assert "'model.zzz'" in msg and "dim, dropout, moe, layer_kinds, patch_size" in msg


def test_section_must_be_mapping():
    assert "model.moe: expected a mapping" in errmsg(from_dict, Root, {"model": {"moe": 3}})
    assert "config: expected a mapping" in errmsg(from_dict, Root, [1])


def test_optional_accepts_none_and_value():
    assert from_dict(Root, {"model": {"dropout": None}}).model.dropout is None
    assert from_dict(Root, {"model": {"dropout": 0}}).model.dropout == 0.0
    assert from_dict(Root, {"train": {"run_name": "r1"}}).train.run_name == "r1"
    assert "model.dropout: expected float | None" in errmsg(from_dict, Root, {"model": {"dropout": "x"}})


def test_list_tuple_dict():
    cfg = from_dict(
        Root,
        {"model": {"layer_kinds": ["moe"], "patch_size": [14, 14]}, "train": {"data_weights": {"coco": 1, "web": 0.5}}},
    )
    assert cfg.model.layer_kinds == ["moe"]
    assert cfg.model.patch_size == (14, 14)
    assert cfg.train.data_weights == {"coco": 1.0, "web": 0.5}
    assert "model.layer_kinds[1]: expected str, got 3 (int)" in errmsg(from_dict, Root, {"model": {"layer_kinds": ["a", 3]}})
    assert "model.patch_size[0]: expected int" in errmsg(from_dict, Root, {"model": {"patch_size": ["a"]}})
    assert "train.data_weights.coco: expected float" in errmsg(from_dict, Root, {"train": {"data_weights": {"coco": "x"}}})
    assert "model.layer_kinds: expected list[str]" in errmsg(from_dict, Root, {"model": {"layer_kinds": "moe"}})


def test_int_or_literal_union():
    assert from_dict(Root, {"train": {"micro_batch_size": 3}}).train.micro_batch_size == 3
    assert from_dict(Root, {"train": {"micro_batch_size": "auto"}}).train.micro_batch_size == "auto"
    msg = errmsg(from_dict, Root, {"train": {"micro_batch_size": "foo"}})
    assert msg == "train.micro_batch_size: expected int | 'auto', got 'foo' (str)"
    errmsg(from_dict, Root, {"train": {"micro_batch_size": True}})


def test_parse_override_values():
    assert parse_override("model.moe.num_experts=16") == (["model", "moe", "num_experts"], 16)
    assert parse_override("train.lr=1e-3") == (["train", "lr"], 1e-3)  # YAML 1.1 would give a str
    assert parse_override("train.compile=true")[1] is True
    assert parse_override("train.run_name=null")[1] is None
    assert parse_override("model.patch_size=[1,2]")[1] == [1, 2]
    assert parse_override("x=bf16")[1] == "bf16"
    assert parse_override("x=a=b")[1] == "a=b"


@pytest.mark.parametrize("bad", ["model.moe.num_experts", "=3", "a..b=3"])
def test_override_bad_form(bad):
    assert "key=value" in errmsg(parse_override, bad)


def test_apply_overrides():
    raw = {"model": {"dim": 32}}
    out = apply_overrides(raw, ["model.moe.num_experts=16", "train.data_weights.coco=0.5", "model.dim=48"], Root)
    assert raw == {"model": {"dim": 32}}  # the caller's dict is untouched
    cfg = from_dict(Root, out)
    assert cfg.model.moe.num_experts == 16 and cfg.model.dim == 48
    assert cfg.train.data_weights == {"coco": 0.5}
    cfg = from_dict(Root, apply_overrides({}, ["model.moe={num_experts: 4, top_k: 1}"], Root))
    assert cfg.model.moe == MoE(num_experts=4, top_k=1)


def test_override_unknown_key_uses_schema():
    # `model` is absent from the YAML, yet the suggestion comes from the schema.
    msg = errmsg(apply_overrides, {}, ["model.moe.num_expert=4"], Root)
    assert msg == "unknown config key 'model.moe.num_expert'; did you mean 'model.moe.num_experts'?"
    assert "not a section" in errmsg(apply_overrides, {}, ["train.max_steps.x=1"], Root)


def test_override_type_checked():
    msg = errmsg(load_config, Root, None, ["train.max_steps=ten"])
    assert msg == "train.max_steps: expected int, got 'ten' (str)"


def test_round_trip(tmp_path):
    cfg = Root(
        model=Model(dim=128, dropout=0.1, moe=MoE(num_experts=32, router="sinkhorn"), patch_size=(14, 14)),
        train=Train(lr=1e-10, micro_batch_size=4, data_weights={"coco": 0.25}, run_name="1e-3"),
    )
    path = tmp_path / "resolved.yaml"
    dump_yaml(cfg, path)
    assert load_config(Root, path) == cfg
    assert to_dict(cfg)["model"]["patch_size"] == [14, 14]
    assert [p.name for p in tmp_path.iterdir()] == ["resolved.yaml"]  # no temp file left behind


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert str(missing) in errmsg(load_config, Root, missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: 3\n  moe: [1, 2\n")
    msg = errmsg(load_config, Root, bad)
    # The bracket left open on line 3 is named, not the end of the file where the parser gave up.
    assert msg.startswith(f"{bad}:3: invalid YAML: expected ',' or ']', but got '<stream end>' at line 4, column 1, "
                          "while parsing a flow sequence that starts at line 3, column 8\n"), msg
    top = tmp_path / "top.yaml"
    top.write_text("- 1\n- 2\n")
    assert "top level must be a mapping" in errmsg(load_config, Root, top)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(Root, empty) == Root()


def test_yaml_typo_names_its_line_and_shows_it(tmp_path):
    """A key without its ':' reads as a value running into the next line, where the parser stops:
    the error names the typo's line and shows both lines, with carets."""
    bad = tmp_path / "typo.yaml"
    bad.write_text("model:\n  dim 3\n  moe: 1\n")
    assert errmsg(load_config, Root, bad) == (
        f"{bad}:2: invalid YAML: mapping values are not allowed here at line 3, column 6, in a value that starts "
        "at line 2, column 3 (a ':' missing after a key, or line 3 indented differently from the line above?)\n"
        "  2 |   dim 3\n"
        "    |   ^\n"
        "  3 |   moe: 1\n"
        "    |      ^")
    tab = tmp_path / "tab.yaml"
    tab.write_text("model:\n\tdim: 3\n")
    assert errmsg(load_config, Root, tab) == (
        f"{tab}:2: invalid YAML: found character '\\t' that cannot start any token at line 2, column 1\n"
        "  2 |  dim: 3\n"
        "    | ^")


def test_load_applies_overrides_and_validate(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  moe:\n    num_experts: 4\n")
    assert load_config(Root, path, ["model.moe.top_k=4"]).model.moe.top_k == 4
    assert "model.moe.top_k" in errmsg(load_config, Root, path, ["model.moe.top_k=5"])


def test_optional_section_keeps_inner_error():
    assert from_dict(Opt, {"moe": None}).moe is None
    assert from_dict(Opt, {"moe": {"top_k": 1}}).moe == MoE(top_k=1)
    assert "did you mean 'moe.top_k'" in errmsg(from_dict, Opt, {"moe": {"top_kk": 1}})
    assert from_dict(Opt, apply_overrides({}, ["moe.top_k=1"], Opt)).moe == MoE(top_k=1)


@dataclass
class Source:
    path: str = ""
    weight: float = 1.0


@dataclass
class Data:
    sources: list[Source] = field(default_factory=list)
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])


@dataclass
class WithLists:
    data: Data = field(default_factory=Data)


def test_list_elements_are_overridden_by_index():
    raw = {"data": {"sources": [{"path": "a.tar", "weight": 0.9}, {"path": "b.txt"}]}}
    cfg = from_dict(WithLists, apply_overrides(raw, ["data.sources.0.path=/abs/a.tar", "data.sources[1].weight=0.5",
                                                     "data.mean.2=0.25"], WithLists))
    assert cfg.data.sources == [Source("/abs/a.tar", 0.9), Source("b.txt", 0.5)]
    assert cfg.data.mean == [0.5, 0.5, 0.25]
    assert raw["data"]["sources"][0]["path"] == "a.tar"  # the caller's dict is untouched


def test_an_index_one_past_the_end_adds_an_element():
    cfg = from_dict(WithLists, apply_overrides({}, ["data.sources.0.path=x.tar", "data.sources.1.path=y.txt",
                                                    "data.sources.1.weight=0.1"], WithLists))
    assert cfg.data.sources == [Source("x.tar"), Source("y.txt", 0.1)]


@pytest.mark.parametrize("override, expected", [
    ("data.sources.2.path=x", "data.sources.2: data.sources has 0 element(s), so the index must be at most 0"),
    ("data.sources.first.path=x", "data.sources is a list: index it with a number, e.g. data.sources.0"),
    ("data.sources.0.pth=x", "unknown config key 'data.sources.0.pth'; did you mean 'data.sources.0.path'?"),
])
def test_bad_list_overrides_name_the_key(override, expected):
    assert expected in errmsg(apply_overrides, {}, [override], WithLists)
