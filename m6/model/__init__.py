"""The M6 transformer: embeddings, prefix-LM attention, blocks with dense or MoE FFNs, FLOP and
parameter accounting. Knows nothing of process groups; declares its recomputable parts."""

from m6.model.m6_model import M6Model, block_recomputable_parts, build_ffn, build_meta_model
from m6.model.recomputable import RecomputablePart

__all__ = ["M6Model", "RecomputablePart", "block_recomputable_parts", "build_ffn", "build_meta_model"]
