from m6.model.m6_model import M6Model, build_ffn

__all__ = ['M6Model', 'build_ffn']
