"""m6: pretraining M6-style Mixture-of-Experts multimodal transformers in PyTorch."""

__version__ = "0.1.0"
