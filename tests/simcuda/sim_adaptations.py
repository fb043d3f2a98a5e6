"""The two places where a simulated run must differ from a GPU run for the simulation to work, and
why neither changes what m6 does.

1. The checkpoint writer accepts only plain tensor types as leaves (m6.checkpoint.state_tree: exactly
   what torch.load(weights_only=True) rebuilds). On a GPU a cuda tensor is a plain torch.Tensor; here
   it is a SimTensor, the harness's stand-in for one, so SimTensor joins the accepted types. The
   check itself stays strict for users: a tensor subclass in a real state dict is not something
   weights-only loading rebuilds, so m6 is right to refuse it.
2. memory.offload=optimizer+params materialises the model on the host and then points each
   parameter's ``.data`` at a device buffer and back. A plain tensor's storage cannot be swapped
   for a SimTensor's, so after materialising on the host the parameters are made host SimTensors
   (same values, same requires_grad; nothing else holds them yet): every later ``p.data = ...``
   then moves them between host and device as on a GPU.
"""

from __future__ import annotations

import torch

from sim_tensor import SimTensor, host_parameters


def install() -> None:
    from m6.checkpoint import state_tree
    from m6.model import M6Model

    state_tree._TENSOR_TYPES = state_tree._TENSOR_TYPES + (SimTensor,)
    materialize = M6Model.materialize

    def materialize_then_host_sim_tensors(self, device, seed):
        materialize(self, device, seed)
        if torch.device(device).type == "cpu":
            host_parameters(self)
    M6Model.materialize = materialize_then_host_sim_tensors
