"""The Hugging Face MoE families m6 imports and exports: for each, its config.json <-> m6's
``model`` section, and one name map between HF's tensors and m6's.

A tensor map says how one m6 tensor is made of HF tensors:

- ``copy``: the same tensor under another name (norms, embeddings, the router, o_proj);
- ``rows``: HF's tensors stacked along dim 0 (m6's one ``attn.qkv`` Linear is q_proj | k_proj |
  v_proj, rows ``num_heads*head_dim``, ``num_kv_heads*head_dim``, ``num_kv_heads*head_dim``);
- ``experts``: HF's per-expert Linear weights (``experts.{j}.<proj>.weight``, [out, in]) transposed
  and stacked into m6's [E, in, out] (``w_in``/``w_gate`` [E, D, F], ``w_out`` [E, F, D]).

Import reads the HF tensors of one map at a time; export writes them back from one m6 tensor.
A config field m6 cannot express is a CheckpointMismatch naming it (the field and config.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from m6.checkpoint.errors import CheckpointMismatch
from m6.config import ModelConfig, head_dim, is_moe_block, num_kv_heads, to_dict

TensorKind = Literal["copy", "rows", "experts"]


@dataclass(frozen=True)
class TensorMap:
    """m6 tensor ``m6`` <- HF tensors ``hf`` (``rows``: each HF tensor's dim-0 size)."""

    m6: str
    hf: tuple[str, ...]
    kind: TensorKind = "copy"
    rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face architecture: its names and its config translation."""

    name: str  # as docs name it
    architecture: str  # config.json "architectures"[0], what export writes
    model_type: str
    moe_prefix: str  # the MoE FFN's module under model.layers.{i}
    expert_projs: tuple[str, str, str]  # HF names of the gate, up and down projections of an expert
    to_m6: Callable[["ConfigReader"], dict]
    to_hf: Callable[[dict], dict]


class ConfigReader:
    """config.json's fields, each read once by name; an unsupported value is an error naming it."""

    def __init__(self, hf: dict, source: str) -> None:
        self.hf, self.source = hf, source

    def get(self, *names: str, default: Any = None) -> Any:
        for name in names:
            if self.hf.get(name) is not None:
                return self.hf[name]
        return default

    def require(self, *names: str) -> Any:
        value = self.get(*names)
        if value is None:
            raise CheckpointMismatch(f"{self.source}: required field {names[0]} is missing")
        return value

    def unsupported(self, name: str, value: Any, why: str) -> CheckpointMismatch:
        return CheckpointMismatch(f"{self.source}: {name}={value!r} cannot be expressed in m6: {why}")

    def expect(self, name: str, allowed: tuple, why: str) -> None:
        value = self.hf.get(name)
        if value not in allowed:
            raise self.unsupported(name, value, why)


def _common(c: ConfigReader) -> dict:
    """The fields every family shares: sizes, RMSNorm, RoPE, grouped-query attention, dropless
    softmax top-k SwiGLU experts."""
    d_model = c.require("hidden_size")
    num_heads = c.require("num_attention_heads")
    c.expect("hidden_act", ("silu",), "m6's SwiGLU experts use SiLU")
    rope = c.get("rope_parameters", "rope_scaling", default={}) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise c.unsupported("rope_parameters.rope_type", rope.get("rope_type", rope.get("type")),
                            "m6's RoPE is the unscaled (default) one")
    if c.get("attention_dropout", default=0.0):
        raise c.unsupported("attention_dropout", c.get("attention_dropout"),
                            "m6's model.dropout also drops residual branches; import with 0 and set model.dropout")
    return {
        "vocab_size": c.require("vocab_size"),
        "d_model": d_model,
        "num_layers": c.require("num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": c.get("num_key_value_heads", default=num_heads),
        "head_dim": c.get("head_dim", default=d_model // num_heads),
        "max_text_len": c.require("max_position_embeddings"),
        "norm": "rmsnorm",
        "norm_eps": c.require("rms_norm_eps"),
        "positions": "rope",
        "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", default=10000.0))),
        "tie_embeddings": bool(c.get("tie_word_embeddings", default=False)),
        "init_std": c.get("initializer_range", default=0.02),
        "dropout": 0.0,
        "linear_bias": False,
        "ffn_activation": "swiglu",
        "moe": {
            "num_experts": c.require("num_local_experts", "num_experts"),
            "top_k": c.require("num_experts_per_tok"),
            "capacity_factor": None,  # HF's MoE blocks are dropless
            "activation": "swiglu",
            "score_function": "softmax",
            "aux_loss_coef": c.get("router_aux_loss_coef", default=0.0),
            "z_loss_coef": 0.0,
        },
    }


def _hf_common(m: dict) -> dict:
    """m6 ``model`` section -> the config.json fields every family shares."""
    moe = m["moe"]
    return {
        "vocab_size": m["vocab_size"], "hidden_size": m["d_model"], "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m.get("num_kv_heads") or m["num_heads"],
        "head_dim": m.get("head_dim") or m["d_model"] // m["num_heads"],
        "max_position_embeddings": m["max_text_len"], "rms_norm_eps": m["norm_eps"], "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_theta"]}, "rope_theta": m["rope_theta"],
        "tie_word_embeddings": m["tie_embeddings"], "initializer_range": m["init_std"], "attention_dropout": 0.0,
        "num_experts_per_tok": moe["top_k"], "router_aux_loss_coef": moe["aux_loss_coef"],
        "torch_dtype": "float32", "use_cache": True,
    }


def _no_sliding_window(c: ConfigReader) -> None:
    if c.get("use_sliding_window", default=False) or ("use_sliding_window" not in c.hf and c.get("sliding_window")):
        raise c.unsupported("sliding_window", c.get("sliding_window"), "m6 attends over the whole sequence "
                            "(sliding-window attention is not a model option)")


def _dense_prefix(c: ConfigReader) -> int:
    """Qwen's mlp_only_layers as m6's model.moe.first_dense_blocks (only a prefix 0..k-1 fits)."""
    dense = sorted(c.get("mlp_only_layers", default=[]) or [])
    if dense != list(range(len(dense))):
        raise c.unsupported("mlp_only_layers", dense, "m6 has dense FFNs only in the first blocks "
                            "(model.moe.first_dense_blocks)")
    return len(dense)


def _mixtral_to_m6(c: ConfigReader) -> dict:
    _no_sliding_window(c)
    m = _common(c)
    m["ffn_dim"] = c.require("intermediate_size")
    m["moe"].update(normalize_weights=True, router_jitter=float(c.get("router_jitter_noise", default=0.0)))
    return m


def _mixtral_to_hf(m: dict) -> dict:
    _require_m6(m, "Mixtral", norm_topk=True, qk_norm="none", attention_bias=False, shared=False, dense=False)
    return {**_hf_common(m), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": _expert_ffn(m), "num_local_experts": m["moe"]["num_experts"],
            "router_jitter_noise": m["moe"].get("router_jitter", 0.0), "sliding_window": None}


def _qwen_moe(c: ConfigReader, m: dict) -> dict:
    """Qwen2-MoE and Qwen3-MoE: decoder_sparse_step, mlp_only_layers, norm_topk_prob."""
    _no_sliding_window(c)
    m["ffn_dim"] = c.get("intermediate_size", default=c.require("moe_intermediate_size"))
    m["moe"].update(ffn_dim=c.require("moe_intermediate_size"), every=c.get("decoder_sparse_step", default=1),
                    first_dense_blocks=_dense_prefix(c), normalize_weights=bool(c.get("norm_topk_prob", default=False)))
    return m


def _qwen2_moe_to_m6(c: ConfigReader) -> dict:
    m = _qwen_moe(c, _common(c))
    m["attention_bias"] = bool(c.get("qkv_bias", default=True))
    shared = c.get("shared_expert_intermediate_size", default=0)
    if shared:
        m["moe"].update(num_shared_experts=1, shared_expert_ffn_dim=shared, shared_expert_gate=True)
    return m


def _qwen3_moe_to_m6(c: ConfigReader) -> dict:
    c.expect("attention_bias", (False, None), "m6's model.attention_bias covers q/k/v only (o_proj has none)")
    m = _qwen_moe(c, _common(c))
    m["qk_norm"] = "head"
    return m


def _olmoe_to_m6(c: ConfigReader) -> dict:
    c.expect("attention_bias", (False, None), "m6's model.attention_bias covers q/k/v only (o_proj has none)")
    c.expect("clip_qkv", (None,), "m6 does not clip q/k/v")
    m = _common(c)
    m["ffn_dim"] = c.require("intermediate_size")
    m["qk_norm"] = "full"
    m["moe"].update(normalize_weights=bool(c.get("norm_topk_prob", default=False)),
                    z_loss_coef=float(c.get("router_z_loss_coef", default=0.0) or 0.0))
    return m


def _qwen_hf(m: dict) -> dict:
    moe = m["moe"]
    return {**_hf_common(m), "intermediate_size": m["ffn_dim"], "moe_intermediate_size": _expert_ffn(m),
            "num_experts": moe["num_experts"], "decoder_sparse_step": moe.get("every", 1),
            "mlp_only_layers": list(range(moe.get("first_dense_blocks", 0))),
            "norm_topk_prob": moe["normalize_weights"], "use_sliding_window": False, "sliding_window": None}


def _qwen2_moe_to_hf(m: dict) -> dict:
    moe = m["moe"]
    _require_m6(m, "Qwen2-MoE", qk_norm="none", shared=None, dense=True)
    if moe.get("num_shared_experts", 0) and not moe.get("shared_expert_gate", False):
        raise CheckpointMismatch("model.moe.shared_expert_gate=false: Qwen2-MoE's shared expert is gated")
    if moe.get("num_shared_experts", 0) > 1:
        raise CheckpointMismatch(f"model.moe.num_shared_experts={moe['num_shared_experts']}: Qwen2-MoE has one "
                                 f"shared expert")
    return {**_qwen_hf(m), "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "qkv_bias": m.get("attention_bias", False),
            "shared_expert_intermediate_size": (moe.get("shared_expert_ffn_dim") or _expert_ffn(m))
            if moe.get("num_shared_experts") else 0}


def _qwen3_moe_to_hf(m: dict) -> dict:
    _require_m6(m, "Qwen3-MoE", qk_norm="head", attention_bias=False, shared=False, dense=True)
    return {**_qwen_hf(m), "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "attention_bias": False}


def _olmoe_to_hf(m: dict) -> dict:
    _require_m6(m, "OLMoE", qk_norm="full", attention_bias=False, shared=False, dense=False)
    moe = m["moe"]
    return {**_hf_common(m), "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
            "intermediate_size": _expert_ffn(m), "num_experts": moe["num_experts"],
            "norm_topk_prob": moe["normalize_weights"], "router_z_loss_coef": moe.get("z_loss_coef", 0.0),
            "attention_bias": False, "clip_qkv": None}


def _expert_ffn(m: dict) -> int:
    return m["moe"].get("ffn_dim") or m["ffn_dim"]


def _require_m6(m: dict, family: str, norm_topk: bool | None = None, qk_norm: str | None = None,
                attention_bias: bool | None = None, shared: bool | None = None, dense: bool = False) -> None:
    """The m6 model options a family's architecture fixes; a differing one is an error naming the key."""
    moe = m["moe"]
    fixed = {"model.norm": (m.get("norm"), "rmsnorm"), "model.positions": (m.get("positions"), "rope"),
             "model.linear_bias": (m.get("linear_bias"), False), "model.moe.activation": (moe.get("activation"), "swiglu"),
             "model.moe.score_function": (moe.get("score_function"), "softmax"),
             "model.moe.routed_scaling_factor": (moe.get("routed_scaling_factor", 1.0), 1.0),
             "model.moe.num_prototypes": (moe.get("num_prototypes", 1), 1),
             "model.moe.expert_bias_update_rate": (moe.get("expert_bias_update_rate", 0.0), 0.0)}
    if norm_topk is not None:
        fixed["model.moe.normalize_weights"] = (moe.get("normalize_weights"), norm_topk)
    if qk_norm is not None:
        fixed["model.qk_norm"] = (m.get("qk_norm", "none"), qk_norm)
    if attention_bias is not None:
        fixed["model.attention_bias"] = (m.get("attention_bias", False), attention_bias)
    if shared is False:
        fixed["model.moe.num_shared_experts"] = (moe.get("num_shared_experts", 0), 0)
    if not dense:
        fixed["model.moe.every"] = (moe.get("every", 1), 1)
        fixed["model.moe.first_dense_blocks"] = (moe.get("first_dense_blocks", 0), 0)
    for key, (value, want) in fixed.items():
        if value != want:
            raise CheckpointMismatch(f"{key}={value!r}: the Hugging Face {family} architecture needs {want!r}")


FAMILIES = {f.model_type: f for f in (
    HFFamily("Mixtral", "MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"),
             _mixtral_to_m6, _mixtral_to_hf),
    HFFamily("Qwen2-MoE", "Qwen2MoeForCausalLM", "qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
             _qwen2_moe_to_m6, _qwen2_moe_to_hf),
    HFFamily("Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
             _qwen3_moe_to_m6, _qwen3_moe_to_hf),
    HFFamily("OLMoE", "OlmoeForCausalLM", "olmoe", "mlp", ("gate_proj", "up_proj", "down_proj"),
             _olmoe_to_m6, _olmoe_to_hf),
)}


def family_of_hf(hf: dict, source: str) -> HFFamily:
    """The family a config.json describes (by its architectures, else its model_type)."""
    by_arch = {f.architecture: f for f in FAMILIES.values()}
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in by_arch:
            return by_arch[arch]
    if not archs and hf.get("model_type") in FAMILIES:
        return FAMILIES[hf["model_type"]]
    names = ", ".join(f"{f.name} ({f.architecture})" for f in FAMILIES.values())
    what = f"architectures={archs}" if archs else f"model_type={hf.get('model_type')!r}"
    raise CheckpointMismatch(f"{source}: {what} is not a family m6 imports; m6 imports {names}")


def family_of_m6(m: dict) -> HFFamily:
    """The family an m6 ``model`` section exports as: q/k norm over the full projection is OLMoE's,
    per head Qwen3-MoE's, q/k/v biases or shared experts Qwen2-MoE's; else Mixtral's (if
    ``to_hf`` then finds an option the family cannot hold, it names it)."""
    qk_norm = m.get("qk_norm", "none")
    if qk_norm == "full":
        return FAMILIES["olmoe"]
    if qk_norm == "head":
        return FAMILIES["qwen3_moe"]
    if m.get("attention_bias") or m["moe"].get("num_shared_experts", 0) or not m["moe"].get("normalize_weights", True):
        return FAMILIES["qwen2_moe"]
    return FAMILIES["mixtral"]


def to_m6_model(hf: dict, source: str) -> tuple[HFFamily, dict]:
    """config.json -> (its family, m6's ``model`` section as a dict)."""
    family = family_of_hf(hf, source)
    return family, family.to_m6(ConfigReader(hf, source))


def expected_hf_shapes(tmap: TensorMap, shape: torch.Size) -> list[torch.Size]:
    """The shapes of ``tmap``'s HF tensors when its m6 tensor has ``shape``."""
    if tmap.kind == "copy":
        return [shape]
    if tmap.kind == "rows":
        return [torch.Size([r, *shape[1:]]) for r in tmap.rows]
    return [torch.Size([shape[2], shape[1]])] * shape[0]  # experts: [E, in, out] <- E x [out, in]


def tensor_maps(family: HFFamily, cfg: ModelConfig) -> list[TensorMap]:
    """Every m6 tensor that comes from (and goes back to) the HF checkpoint, in HF's layer order."""
    m = to_dict(cfg)
    q_rows, kv_rows = cfg.num_heads * head_dim(cfg), num_kv_heads(cfg) * head_dim(cfg)
    maps = [TensorMap("text_embed.tokens.weight", ("model.embed_tokens.weight",))]
    for i in range(m["num_layers"]):
        hf, b = f"model.layers.{i}.", f"blocks.{i}."
        attn = f"{hf}self_attn."
        maps += [TensorMap(f"{b}attn_norm.weight", (f"{hf}input_layernorm.weight",)),
                 TensorMap(f"{b}attn.qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "rows",
                           (q_rows, kv_rows, kv_rows))]
        if m.get("attention_bias"):
            maps.append(TensorMap(f"{b}attn.qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "rows",
                                  (q_rows, kv_rows, kv_rows)))
        maps.append(TensorMap(f"{b}attn.out.weight", (f"{attn}o_proj.weight",)))
        if m.get("qk_norm", "none") != "none":
            maps += [TensorMap(f"{b}attn.q_norm.weight", (f"{attn}q_norm.weight",)),
                     TensorMap(f"{b}attn.k_norm.weight", (f"{attn}k_norm.weight",))]
        maps.append(TensorMap(f"{b}ffn_norm.weight", (f"{hf}post_attention_layernorm.weight",)))
        if is_moe_block(cfg, i):
            moe = f"{hf}{family.moe_prefix}."
            gate, up, down = family.expert_projs
            experts = range(m["moe"]["num_experts"])
            maps.append(TensorMap(f"{b}ffn.router.weight", (f"{moe}gate.weight",)))
            for m6_name, proj in (("w_gate", gate), ("w_in", up), ("w_out", down)):
                maps.append(TensorMap(f"{b}ffn.experts.{m6_name}",
                                      tuple(f"{moe}experts.{j}.{proj}.weight" for j in experts), "experts"))
            if m["moe"].get("num_shared_experts", 0):
                for m6_name, proj in (("fc_gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj")):
                    maps.append(TensorMap(f"{b}ffn.shared_experts.{m6_name}.weight",
                                          (f"{moe}shared_expert.{proj}.weight",)))
                if m["moe"].get("shared_expert_gate", False):
                    maps.append(TensorMap(f"{b}ffn.shared_expert_gate.weight", (f"{moe}shared_expert_gate.weight",)))
        else:
            for m6_name, proj in (("fc_gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj")):
                maps.append(TensorMap(f"{b}ffn.{m6_name}.weight", (f"{hf}mlp.{proj}.weight",)))
    maps.append(TensorMap("final_norm.weight", ("model.norm.weight",)))
    if not m["tie_embeddings"]:
        maps.append(TensorMap("lm_head.weight", ("lm_head.weight",)))
    return maps
