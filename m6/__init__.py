"""m6: pretraining M6-style Mixture-of-Experts multimodal transformers in PyTorch.

The Python API (the CLI ``m6-train`` is the same three calls):

    import m6
    cfg = m6.load_config("configs/tiny.yaml", ["train.max_steps=50"])
    history = m6.Trainer(cfg).fit()                      # or Trainer(cfg, dataset=my_samples)
"""

__version__ = "0.1.0"

# Resolved on first use (PEP 562): `import m6.config` must not pull in torch.distributed and the
# training stack, and the layers below m6.train never import it.
_EXPORTS = {"Trainer": ("m6.train.loop", "Trainer"), "load_config": ("m6.config", "load"),
            "Config": ("m6.config", "Config"), "Sample": ("m6.data.batch", "Sample")}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'm6' has no attribute {name!r}")
    import importlib

    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)


__all__ = ["Config", "Sample", "Trainer", "load_config", "__version__"]
