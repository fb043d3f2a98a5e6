"""CPU offload of model states (``memory.offload``): the update runs on the host, weights stream back.

optimizer:        fp32 master weights, their gradients and the AdamW moments live in host memory
                  (pinned when CUDA is present, so copies are asynchronous). A gradient streams to
                  the host as soon as it is final for this micro-batch (``grads_final``, called by
                  the gradient sync). One that no other rank shares (every parameter at world 1,
                  the experts when the expert-data-parallel size is 1) leaves at the end of EVERY
                  micro-batch's backward, parameter by parameter as backward writes it, and is
                  summed on the host in fp32 (m6.memory.grad_stream): with accumulation the device
                  never holds it past its own backward (with 16-bit host gradients it accumulates
                  on the device and leaves once, in the last backward). A replicated gradient must be all-reduced
                  first, and is reduced once per step, in the last micro-batch (reducing it in
                  every micro-batch would multiply its traffic by the accumulation steps), so it
                  accumulates on the device until then and leaves right after its bucket's
                  all-reduce. The copies overlap the backward; clipping needs the global norm, so
                  they are all awaited once before the first group updates. The update runs on the
                  CPU, group by group; group i's new weights copy back to the device (side stream)
                  while group i + 1 updates.
optimizer+params: as above, and the parameters of the streamed layers (the transformer blocks)
                  live on the host too: a layer's weights are copied to the device just before its
                  forward (the next layer's copy is prefetched), released right after it, and
                  fetched again before the layer's backward.
zero:             ZeRO-Offload's layout. The device weights are 16-bit (the compute dtype; the MoE
                  routers' gates stay fp32, as m6 routes in fp32) and stay resident; the fp32 masters (copied from the fp32 initialisation before any
                  weight is rounded) and the optimizer state live on the host. Gradients are made in
                  16-bit by the backward and leave as above (into 16-bit host buffers with
                  memory.host_grad_dtype=compute, fp32 ones otherwise). After the host update each
                  master is cast to 16 bits on the host into a pinned staging buffer and copied to
                  its device weight (m6.memory.half_weight_push: two buffers, the copy of one
                  overlapping the cast into the other), by the copy-back thread, in forward-order
                  segments that the next forward waits for block by block
                  (m6.memory.block_copy_back). The blocks ``streamed_layers`` names have
                  16-bit host homes apart from their masters, streamed as with optimizer+params;
                  their masters are cast into the homes after the update. With 16-bit host
                  gradients and no delayed update their gradients land in the homes too
                  (m6.memory.home_grads): no separate gradient buffer for them.
                  With parallel.shard=optimizer the host states are partitioned
                  (m6.memory.zero_partition): the buckets reduce-scatter, each rank keeps the
                  masters, gradients and optimizer state of its dim-0 chunks, copies its chunks
                  back and the ranks all-gather the 16-bit weights.

With device == cpu the host copies are separate CPU tensors, so every path (hooks, gradient
streaming, separate master, update, copy back, fetch / release) runs and is tested on CPU.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from m6.memory.block_copy_back import BlockCopyBack
from m6.memory.grad_stream import HostGradAccumulator
from m6.memory.half_weight_push import HalfWeightPush
from m6.memory.home_grads import HomeGradLanding
from m6.memory.grouped_apply import GroupedApply
from m6.memory.zero_partition import WeightGathers, ZeroPartition

OFFLOAD_MODES = ("none", "optimizer", "optimizer+params", "zero")


def _host_copy(t: torch.Tensor, pin: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A detached host copy of ``t`` in ``dtype`` (pinned when ``pin``), never sharing ``t``'s storage."""
    out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=pin)
    out.copy_(t.detach())
    return out


class _OnBackward(torch.autograd.Function):
    """Identity on ``tensors``; calls ``callback`` when the gradients of all of them are ready."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


def _wrap_tensors(values: tuple, callback: Callable[[], None]) -> tuple:
    """``values`` with every tensor that requires grad routed through one _OnBackward node."""
    positions = [i for i, v in enumerate(values) if torch.is_tensor(v) and v.requires_grad]
    if not positions:
        return values
    wrapped = _OnBackward.apply(callback, *(values[i] for i in positions))
    out = list(values)
    for i, w in zip(positions, wrapped):
        out[i] = w
    return tuple(out)


class _StreamedLayer:
    """One layer's parameters: host home (the master; with zero a 16-bit copy of it), and a device
    buffer freed when unused."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, pin: bool,
                 home_dtype: torch.dtype = torch.float32, keep_fp32: frozenset[int] = frozenset()) -> None:
        self.params = params
        self.homes = [_host_copy(p, pin, torch.float32 if id(p) in keep_fp32 else home_dtype) for p in params]
        self.buffers = [torch.empty(p.shape, dtype=h.dtype, device=device) for p, h in zip(params, self.homes)]
        self.ready: torch.cuda.Event | None = None
        self.resident = True
        self.release()

    def release(self) -> None:
        """Point the params at their host homes and free the device storage.

        Autograd saved the layer's weights (or views of them); those share the buffers' storage,
        which ``fetch`` re-allocates and refills before the layer's backward reads it.
        """
        if not self.resident:
            return
        if self.ready is not None:  # a prefetch never waited for: its copy must land before the free
            torch.cuda.current_stream().wait_event(self.ready)
            self.ready = None
        for p, home, buf in zip(self.params, self.homes, self.buffers):
            p.data = home
            buf.untyped_storage().resize_(0)
        self.resident = False


class ParamStreamer:
    """Keeps ``layers``' parameters on the host, each layer on the device only around its use.

    Module hooks applied from outside: the model's code is unchanged. Forward pre-hook: fetch
    this layer (waiting for its copy) and prefetch the next; forward hook: release. In training,
    an autograd node on the layer's outputs fetches it again before its backward (and prefetches
    the previous layer), and one on its inputs releases it once its backward has run: every
    backward node of the layer lies between the two, whatever order autograd runs them in.
    """

    def __init__(self, layers: Sequence[nn.Module], device: torch.device, copy_stream,
                 home_dtype: torch.dtype = torch.float32, keep_fp32: frozenset[int] = frozenset()) -> None:
        """``home_dtype``: the dtype of the host homes and device buffers (zero: 16-bit), except
        for the params whose ids ``keep_fp32`` holds."""
        self.device = device
        self.copy_stream = copy_stream
        pin = device.type == "cuda"
        self.layers = [_StreamedLayer([p for p in layer.parameters() if p.requires_grad], device, pin, home_dtype,
                                      keep_fp32)
                       for layer in layers]
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre_forward(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post_forward(i)))

    def homes(self) -> dict[int, torch.Tensor]:
        """id(param) -> its host home, which is also its master copy for the optimizer."""
        return {id(p): h for layer in self.layers for p, h in zip(layer.params, layer.homes)}

    def fetch(self, i: int, wait: bool) -> None:
        """Allocate layer i's device buffers and copy the host weights in (async on CUDA)."""
        if not 0 <= i < len(self.layers):
            return
        layer = self.layers[i]
        if not layer.resident:
            for buf, home in zip(layer.buffers, layer.homes):
                # Allocated on the compute stream, so releasing it there later is ordered after use.
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            if self.copy_stream is not None:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.copy_stream):
                    for buf, home in zip(layer.buffers, layer.homes):
                        buf.copy_(home, non_blocking=True)
                    layer.ready = torch.cuda.Event()
                    layer.ready.record()
            else:
                for buf, home in zip(layer.buffers, layer.homes):
                    buf.copy_(home)
            for p, buf in zip(layer.params, layer.buffers):
                p.data = buf
            layer.resident = True
        if wait and layer.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(layer.ready)
            layer.ready = None

    def release_all(self) -> None:
        for layer in self.layers:
            layer.release()

    def _pre_forward(self, i: int):
        def hook(module, args, kwargs):
            self.fetch(i, wait=True)
            self.fetch(i + 1, wait=False)  # prefetch: its copy overlaps this layer's compute
            if torch.is_grad_enabled():
                args = _wrap_tensors(tuple(args), lambda: self.layers[i].release())
            return args, kwargs
        return hook

    def _post_forward(self, i: int):
        def refetch() -> None:
            self.fetch(i, wait=True)
            self.fetch(i - 1, wait=False)  # backward runs the layers in reverse

        def hook(module, args, output):
            self.layers[i].release()
            if not torch.is_grad_enabled():
                return output
            if torch.is_tensor(output):
                return _wrap_tensors((output,), refetch)[0]
            return type(output)(_wrap_tensors(tuple(output), refetch))
        return hook


@dataclass
class HalfGradSet:
    """One step's 16-bit host gradients as its update reads them (memory.host_grad_dtype=compute):
    the buffers the step filled (id(master) -> buffer), fp16's power-of-two divisors (id(master)
    -> host scalar; None for bf16) and the clip's multiplier (unscale x clip)."""

    filled: dict[int, torch.Tensor]
    divisors: dict[int, torch.Tensor] | None
    multiplier: float


class HostOffload:
    """Master weights, gradients and optimizer state on the host; the update runs there.

    ``params`` are the model's trainable parameters in model order; the optimizer is built over
    ``master(p)`` for each, so its state_dict has the layout of a plain run's (checkpoints are
    interchangeable). Gradients arrive through ``grads_final`` once they are final.
    """

    def __init__(self, params: Sequence[nn.Parameter], device: torch.device,
                 streamed_layers: Sequence[nn.Module] = (), grad_dtype: torch.dtype = torch.float32,
                 separate_homes: bool = False, weight_dtype: torch.dtype | None = None,
                 keep_fp32: Sequence[nn.Parameter] = (), grads_in_homes: bool = False,
                 partition: ZeroPartition | None = None) -> None:
        """``grad_dtype``: the host gradients' dtype (memory.host_grad_dtype). fp32: they are the
        masters' ``.grad``. 16-bit: they stay in their own buffers, each written once per step
        (nothing is added on the host: with accumulation they arrive final from the last backward)
        and the update reads them group by group (``materialize_grads``).
        ``separate_homes`` (the delayed update): a streamed parameter's master is a copy of its host
        home, not the home itself, so an update running beside the next forward never changes the
        weights that forward fetches; the masters are copied to the homes as to the device.
        ``weight_dtype`` (memory.offload=zero): the 16-bit dtype the weights take on the device
        (and in the streamed blocks' homes); the masters stay fp32 on the host, apart from them.
        ``keep_fp32`` (zero): parameters whose device weights stay fp32 copies of their masters (the
        MoE routers' gates, whose routing decisions m6 keeps in fp32, as DeepSpeed's MoE gate does).
        ``grads_in_homes`` (zero, 16-bit host gradients, no delayed update): a streamed parameter's
        gradient lands in its 16-bit home (m6.memory.home_grads), no buffer of its own.
        ``partition`` (zero with parallel.shard=optimizer, m6.memory.zero_partition): the masters,
        host gradients and optimizer state are this rank's dim-0 chunks of the split parameters;
        the gradients arrive as chunks (``chunks_final``) and the weights go back as chunks, then
        all-gathered (``gathers``)."""
        self.device = device
        self.partition = partition
        self.gathers: WeightGathers | None = None  # attach_block_copy_back makes them when partitioned
        self.grad_dtype = grad_dtype
        self.weight_dtype = weight_dtype
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        pin = device.type == "cuda"
        self.params = list(params)
        # zero: the fp32 masters, taken from the fp32 initialisation before any weight is rounded.
        # Partitioned: only this rank's chunk of each split parameter.
        zero_masters = {id(p): _host_copy(partition.host_rows(p, p.detach()) if partition else p, pin)
                        for p in self.params} if weight_dtype is not None else {}
        fp32_ids = frozenset(id(p) for p in keep_fp32)
        self.streamer = ParamStreamer(streamed_layers, device, self.copy_stream, weight_dtype or torch.float32,
                                      fp32_ids) if streamed_layers else None
        homes = self.streamer.homes() if self.streamer else {}
        self._streamed_homes = homes
        self.masters: dict[int, torch.Tensor] = {}
        # Params copied back from their masters each step (to the device; a streamed one's, with
        # separate_homes or zero, to its host home).
        self.resident: list[tuple[nn.Parameter, torch.Tensor]] = []
        # zero: the casts of the masters to the device's 16-bit weights, through pinned staging.
        self._half_push = HalfWeightPush(weight_dtype, device, self.copy_stream) if weight_dtype is not None else None
        for p in self.params:
            if weight_dtype is not None:
                self.masters[id(p)] = zero_masters[id(p)]
                if id(p) not in homes:  # the streamer rounded the streamed ones into their homes already
                    p.data = p.data.to(device=device, dtype=torch.float32 if id(p) in fp32_ids else weight_dtype)
                    if partition is not None and partition.of(p) is not None:
                        partition.pad_resident(p)
                self.resident.append((p, self.masters[id(p)]))
            elif id(p) in homes and separate_homes:  # copied back into the home, where p.data points while idle
                self.masters[id(p)] = _host_copy(homes[id(p)], pin)
                self.resident.append((p, self.masters[id(p)]))
            elif id(p) in homes:
                self.masters[id(p)] = homes[id(p)]
            else:
                if p.device != device:  # materialised on the host for optimizer+params
                    p.data = p.data.to(device)
                self.masters[id(p)] = _host_copy(p, pin)
                self.resident.append((p, self.masters[id(p)]))
        # zero's streamed homes that take their parameters' gradients (None: every gradient has its own buffer).
        self.home_grads = HomeGradLanding(homes, grad_dtype) if grads_in_homes else None
        landing = self.home_grads.buffers if self.home_grads is not None else {}
        self._grad_buffers = {id(p): landing[id(p)] if id(p) in landing else
                              torch.empty(self.masters[id(p)].shape, dtype=grad_dtype, pin_memory=pin)
                              for p in self.params}
        # 16-bit host gradients: id(master) -> its buffer, for those this step filled (the masters'
        # .grad stays None until the update reads them), and the multiplier the clip chose (unscale x clip).
        self._filled: dict[int, torch.Tensor] = {}
        self.grad_multiplier = 1.0
        # fp16 host gradients: per parameter, the power of two its buffer was divided by (see
        # _fit_fp16's docstring), written by the device next to the gradient's copy.
        self._fp16_divisors = {id(self.masters[id(p)]): torch.ones((), pin_memory=pin) for p in self.params} \
            if grad_dtype == torch.float16 else None
        # id(p) of the params whose host buffer holds this step's sum so far (the next micro-batch adds to it).
        self._summed: set[int] = set()
        # Delayed update (m6.memory.delayed_update): the masters' .grad may still feed the update in
        # flight while the next backward streams, so the stream does not attach them (attach_grads does),
        # and the next step's gradients go to a second buffer set (hand_over_grads).
        self.defer_grads = False
        self._spare_grad_buffers: dict[int, torch.Tensor] | None = None
        # 16-bit host gradients under the delayed update: the step handed to the update in flight
        # (its buffers, divisors, multiplier), and the divisors' second set the next backward writes.
        self._update_half: HalfGradSet | None = None
        self._spare_fp16_divisors: dict[int, torch.Tensor] | None = None
        self._pushed: torch.cuda.Event | None = None  # recorded after push_weights' copies (CUDA)
        # zero: the copies back in forward-order segments, each waited for by the forward that reads
        # it first (m6.memory.block_copy_back; attached by the trainer, which knows the blocks).
        self.block_copy_back: BlockCopyBack | None = None
        # Recorded after the latest gradient copy: the copy stream runs its copies in order, so when
        # this one is done all are, and the step waits once, not once per parameter.
        self._grads_copied: torch.cuda.Event | None = None
        self._accumulator = HostGradAccumulator(device, self.copy_stream)  # micro-batch 2 on: host += device

    def master(self, p: nn.Parameter) -> torch.Tensor:
        return self.masters[id(p)]

    def masters_of(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        return [self.masters[id(p)] for p in params]

    def master_names(self, model: nn.Module) -> dict[int, str]:
        """id(master) -> the model parameter's name (checkpoints index optimizer state by name)."""
        return {id(self.masters[id(p)]): n for n, p in model.named_parameters() if id(p) in self.masters}

    # ---- gradients: device -> host ------------------------------------------------------------
    def grads_final(self, params: Sequence[nn.Parameter]) -> None:
        """Called by the gradient sync once these params' gradients are final for this micro-batch:
        stream them now (added to the host sum when an earlier micro-batch already streamed one)."""
        for p in params:
            if p.grad is not None and id(p) in self.masters:
                self._stream_grad(p)

    def chunks_final(self, pairs: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Partitioned: the gradient sync reduce-scattered these params; each reduced chunk (this
        rank's rows of the step's gradient, on the device) leaves for its host buffer now."""
        for p, grad in pairs:
            self._stream_grad(p, grad)

    def _stream_grad(self, p: nn.Parameter, grad: torch.Tensor | None = None) -> None:
        """Copy ``grad`` (default: ``p.grad``, the whole gradient) to ``p``'s host buffer."""
        grad = p.grad if grad is None else grad
        buf, master = self._grad_buffers[id(p)], self.masters[id(p)]
        if self.half_grads and id(master) in self._filled:
            # ParameterUpdate.backward keeps these on the device until the step's last backward.
            raise RuntimeError("memory.host_grad_dtype=compute: a second gradient for one parameter in a step "
                               "(16-bit host gradients are not summed on the host)")
        if id(p) in self._summed:  # this step's sum is on the host already: add to it
            self._accumulator.add(grad, buf)
            p.grad = None
            return
        if self._fp16_divisors is not None:
            grad = _fit_fp16(grad, self._fp16_divisors[id(master)])
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                buf.copy_(grad, non_blocking=True)
                grad.record_stream(self.copy_stream)  # the allocator keeps it until the copy is done
                self._grads_copied = torch.cuda.Event()
                self._grads_copied.record()
        else:
            buf.copy_(grad)  # 16-bit host gradients: cast in the copy (on the device, before it crosses)
        if self.home_grads is not None:  # a streamed home now holds the gradient until the update recasts it
            self.home_grads.landed(id(p))
        self._summed.add(id(p))
        if self.half_grads:
            self._filled[id(master)] = buf
        elif not self.defer_grads:
            master.grad = buf
        p.grad = None  # the device copy is no longer needed: this is the memory offload saves

    @property
    def half_grads(self) -> bool:
        return self.grad_dtype != torch.float32

    def host_grads(self, masters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The host gradients of ``masters`` that this step filled: their ``.grad`` (fp32), or
        their 16-bit buffers."""
        if not self.half_grads:
            return [m.grad for m in masters if m.grad is not None]
        return [self._filled[id(m)] for m in masters if id(m) in self._filled]

    def host_grad_factors(self, masters: Sequence[torch.Tensor]) -> list[float] | None:
        """What each of ``host_grads(masters)`` is to be multiplied by to give the gradient: the
        power of two an fp16 buffer was divided by to stay finite; None where all are 1 (fp32,
        bf16). Read after ``finish_backward`` (the device wrote them)."""
        if self._fp16_divisors is None:
            return None
        return [float(self._fp16_divisors[id(m)]) for m in masters if id(m) in self._filled]

    def materialize_grads(self, masters: Sequence[torch.Tensor], grads: HalfGradSet | None = None) -> None:
        """16-bit host gradients: give ``masters`` fp32 ``.grad`` for the update (the buffer times
        the multiplier, the clip's unscale and clip in one pass, and fp16's divisor);
        ``release_grads`` after it. ``grads``: the step's set (None: this step's, the synchronous
        update's; the delayed update reads the set handed over to it)."""
        if grads is None:
            grads = HalfGradSet(self._filled, self._fp16_divisors, self.grad_multiplier)
        for m in masters:
            buf = grads.filled.get(id(m))
            if buf is not None:
                divisor = 1.0 if grads.divisors is None else float(grads.divisors[id(m)])
                m.grad = buf.to(torch.float32).mul_(grads.multiplier * divisor)

    @staticmethod
    def release_grads(masters: Sequence[torch.Tensor]) -> None:
        for m in masters:
            m.grad = None

    # ---- the step -----------------------------------------------------------------------------
    def finish_backward(self) -> None:
        """After the step's last backward (and gradient sync): every gradient is on the host.

        Streams what is still on the device (a param whose hook did not fire) and waits for the
        copies. Clipping needs the global norm before any group updates, hence a full wait here
        (one host sync per step); the copies themselves overlapped the backward.
        """
        self.settle_weights()  # the forwards waited for their segments; any weight they did not read too
        for p in self.params:
            if p.grad is not None:
                self._stream_grad(p)
        if self.copy_stream is not None and (self._grads_copied is not None or self._accumulator.pending):
            # One wait for the copy stream's last copy (it runs them in order), whichever kind it was.
            last = torch.cuda.Event()
            last.record(self.copy_stream)
            last.synchronize()
        self._grads_copied = None
        self._accumulator.flush(copies_done=True)  # the later micro-batches' gradients added on the host

    @property
    def rounds_weights(self) -> bool:
        """memory.offload=zero: the model's weights are 16-bit roundings of the host masters, so
        the masters (not the weights) are what a checkpoint saves and a load writes."""
        return self.weight_dtype is not None

    def _copy_back(self, masters: Sequence[torch.Tensor]) -> None:
        ids = {id(m) for m in masters}
        todo = [(p, m) for p, m in self.resident if id(m) in ids]
        if self._half_push is not None:
            # A streamed block's 16-bit home is cast on the host (it is fetched from there); the
            # resident 16-bit weights go through the pinned staging buffers, one copy each chunk;
            # an fp32 one (a router's gate) is copied from its master as in the other modes.
            for p, m in todo:
                if id(p) in self._streamed_homes:  # never partitioned (config.py refuses streamed blocks)
                    self._streamed_homes[id(p)].copy_(m)
                    if self.home_grads is not None:
                        self.home_grads.rewritten(id(p))
            resident = [(p, m) for p, m in todo if id(p) not in self._streamed_homes]
            if self.block_copy_back is not None:
                self.block_copy_back.submit(resident)
                return
            half = [(p, m) for p, m in resident if p.dtype == self.weight_dtype]
            for segment in self.gathers.by_segment(half) if self.gathers is not None else [half]:
                self._half_push.push([(self._device_rows(p), m) for p, m in segment])
            todo = [(p, m) for p, m in resident if p.dtype != self.weight_dtype]
            if not todo:
                return
        if self.copy_stream is not None:
            # Backward kernels still queued may read these weights: overwrite them after those.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for p, m in todo:
                    self._device_rows(p).copy_(m, non_blocking=True)
        else:
            for p, m in todo:
                self._device_rows(p).copy_(m)

    def _device_rows(self, p: nn.Parameter) -> torch.Tensor:
        """Where ``p``'s master is copied on the device: its weight, or this rank's rows of it (partitioned)."""
        return p.data if self.partition is None else self.partition.device_rows(p)

    def attach_block_copy_back(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """zero: copy the resident weights back in forward-order segments, each waited for by the
        forward of ``model`` (the first segment: outside ``blocks``) or of its block."""
        assert self._half_push is not None, "the block copy-back is memory.offload=zero's"
        if self.partition is not None:
            # Partitioned: the chunks go back as each group updates; the all-gathers are what each
            # block's forward waits for (m6.memory.zero_partition).
            self.gathers = WeightGathers(model, blocks, self.partition)
            return
        pairs = [(p, m) for p, m in self.resident if id(p) not in self._streamed_homes]

        def reserve(segments: list[list[tuple[nn.Parameter, torch.Tensor]]]) -> None:
            # Staging for the largest push: one segment's 16-bit weights (m6.memory.estimate counts it so).
            self._half_push.reserve(max((sum(p.numel() for p, _ in s if p.dtype == self.weight_dtype)
                                         for s in segments), default=0))
        self.block_copy_back = BlockCopyBack(model, blocks, pairs, self.push_to_device, self.device, self.copy_stream,
                                             reserve)

    def push_to_device(self, pairs: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """zero: copy ``pairs``' masters to their resident device weights (the 16-bit ones through
        the pinned staging, a router's fp32 gate directly); on CUDA on the current stream, which
        the block copy-back makes the copy stream."""
        self._half_push.push([(p.data, m) for p, m in pairs if p.dtype == self.weight_dtype])
        non_blocking = self.copy_stream is not None
        for p, m in pairs:
            if p.dtype != self.weight_dtype:
                p.data.copy_(m, non_blocking=non_blocking)

    def settle_weights(self) -> None:
        """zero with the block copy-back: every device weight copied back before it is read outside
        a forward (a checkpoint, the run's end); a no-op otherwise."""
        if self.block_copy_back is not None:
            self.block_copy_back.settle()
        if self.gathers is not None:
            self.gathers.settle()

    def masters_read(self) -> Future | None:
        """A Future done once the copy back has read every master handed to it (None: nothing in
        flight); the delayed update waits for it before changing the masters."""
        return self.block_copy_back.masters_read() if self.block_copy_back is not None else None

    def step(self, apply: GroupedApply) -> None:
        """Run the host update group by group; group i's weights copy back while group i+1 updates."""
        self.finish_backward()  # a no-op when the trainer already called it before clipping
        if self.gathers is not None:  # the chunks about to be overwritten were gathered by every peer
            self.gathers.settle()
        if self.block_copy_back is not None:
            self.block_copy_back.begin()
        if self.half_grads:  # each group's fp32 gradients exist only while it updates
            def after(i: int) -> None:
                self.release_grads(apply.groups[i])
                self._copy_back(apply.groups[i])
            apply.step(after_group=after, before_group=lambda i: self.materialize_grads(apply.groups[i]))
        else:
            apply.step(after_group=lambda i: self._copy_back(apply.groups[i]))
        if self.copy_stream is not None and self.block_copy_back is None:
            # Asynchronous: the next forward's kernels wait for the copies, the host does not.
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        if self.gathers is not None:  # after the chunks' copies (ordered on the compute stream, NCCL's input)
            self.gathers.issue()

    def zero_grad(self) -> None:
        """Drop the host gradients (their buffers are kept) and any device gradient left over."""
        self._accumulator.flush()  # an add still landing must not reach next step's sum
        if self.home_grads is not None and self.home_grads.holding:
            # No update recast these homes (a skipped step): their weights back from the unchanged masters.
            if self._grads_copied is not None:  # finish_backward did not wait for the copies: they land first
                self._grads_copied.synchronize()
            self.home_grads.restore(self.masters)
        for p in self.params:
            self.masters[id(p)].grad = None
            p.grad = None
        self._grads_copied = None
        self._filled.clear()
        self._summed.clear()
        self.grad_multiplier = 1.0

    # ---- the delayed update (m6.memory.delayed_update) ----------------------------------------
    def hand_over_grads(self) -> None:
        """The attached gradients now belong to an update running in the background: the next
        backward streams into the other buffer set (allocated here the first time: one more
        gradient per parameter on the host, 4 bytes fp32 or the compute dtype's 2). The masters'
        .grad (fp32) are left to the update; 16-bit gradients go to it as a HalfGradSet (their
        buffers, fp16's divisors, which the next backward writes into a second set of scalars, and
        the clip's multiplier), read by ``background_step``."""
        self._accumulator.flush()
        assert self.home_grads is None, "the delayed update with gradients in the streamed homes (config.py refuses it)"
        pin = self.copy_stream is not None
        if self._spare_grad_buffers is None:
            self._spare_grad_buffers = {k: torch.empty(b.shape, dtype=b.dtype, pin_memory=pin)
                                        for k, b in self._grad_buffers.items()}
        self._grad_buffers, self._spare_grad_buffers = self._spare_grad_buffers, self._grad_buffers
        if self.half_grads:
            assert self._update_half is None, "16-bit gradients handed over while an update still reads others"
            self._update_half = HalfGradSet(self._filled, self._fp16_divisors, self.grad_multiplier)
            if self._fp16_divisors is not None:
                if self._spare_fp16_divisors is None:
                    self._spare_fp16_divisors = {k: torch.ones((), pin_memory=pin) for k in self._fp16_divisors}
                self._fp16_divisors, self._spare_fp16_divisors = self._spare_fp16_divisors, self._fp16_divisors
            self._filled, self.grad_multiplier = {}, 1.0
        for p in self.params:
            p.grad = None
        self._grads_copied = None
        self._summed.clear()

    def background_step(self, apply: GroupedApply) -> None:
        """The delayed update's host step (on its worker thread) over the gradients handed over:
        fp32 ones attached to the masters, or the 16-bit set read back group by group as the
        synchronous step reads it. Nothing is copied to the device (the next step's catch-up does)."""
        if not self.half_grads:
            apply.step()
            return
        grads = self._update_half
        assert grads is not None, "a background step without handed-over 16-bit gradients"
        apply.step(before_group=lambda i: self.materialize_grads(apply.groups[i], grads),
                   after_group=lambda i: self.release_grads(apply.groups[i]))

    def release_update_grads(self) -> None:
        """After the background update: drop the gradients it read (their buffers are kept)."""
        for p in self.params:
            self.masters[id(p)].grad = None
        self._update_half = None

    def attach_grads(self) -> None:
        """After the step's backward (and any update in flight): the masters' .grad are this step's
        sums (fp32; 16-bit gradients stay in their buffers until the update reads them)."""
        if self.half_grads:
            return
        for p in self.params:
            if id(p) in self._summed:
                self.masters[id(p)].grad = self._grad_buffers[id(p)]

    def push_weights(self) -> None:
        """Copy every resident master to its device parameter (after an update that did not copy
        back); on CUDA asynchronous, the next forward's kernels wait for it."""
        if self.block_copy_back is not None:
            self.block_copy_back.begin()
        if self.gathers is not None:  # the chunks about to be overwritten were gathered by every peer
            self.gathers.settle()
        self._copy_back([m for _, m in self.resident])
        if self.copy_stream is not None and self.block_copy_back is None:
            self._pushed = torch.cuda.Event()
            self._pushed.record(self.copy_stream)
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        if self.gathers is not None:
            self.gathers.issue()

    def weights_pushed_event(self) -> torch.cuda.Event | None:
        """The event after the last ``push_weights`` copies (None on CPU): an update must not
        change the masters before it has completed."""
        pushed, self._pushed = self._pushed, None
        return pushed

    def pull_masters(self) -> None:
        """After loading weights into the model (resume): refresh the host masters from them.
        zero: the load wrote the masters themselves (``rounds_weights``): the weights follow them."""
        if self.rounds_weights:
            self.push_weights()
            return
        for p, m in self.resident:
            m.copy_(p.detach())
        if self.streamer is not None:
            # Streamed params point at their homes while idle, so the load already wrote there.
            self.streamer.release_all()


FP16_MAX = torch.finfo(torch.float16).max


def _fit_fp16(grad: torch.Tensor, divisor_out: torch.Tensor) -> torch.Tensor:
    """``grad`` (fp32, on the device, about to be cast to an fp16 host buffer) divided in place by
    the smallest power of two 2**k, k >= 0, that brings its largest magnitude within fp16's range;
    2**k is written to ``divisor_out`` (a host scalar) by the same stream, without a host sync.

    Why: the gradient reaching the host is an fp32 sum (over the ranks' all-reduce, over
    micro-batches, over the tokens of a shared weight), and the loss scale only keeps each rank's
    fp16 backward finite: cast as it is, a sum finite in fp32 would become inf and skip a step
    that fp32 host gradients apply (about world-size times more often at a high scale). A power
    of two changes no mantissa bit, so the usual gradient (k = 0) is stored exactly as before; a
    tensor too large for fp16 loses only the bits that fall below fp16's smallest subnormal. A
    gradient already inf or nan stays non-finite (inf / inf = nan), so the overflow check sees it
    as before."""
    amax = grad.detach().abs().amax().float()
    divisor = torch.exp2(torch.ceil(torch.log2(amax / FP16_MAX)).clamp_(min=0))  # amax 0: log2 -inf -> 1
    divisor_out.copy_(divisor, non_blocking=True)
    return grad.div_(divisor)


def build_offload(mode: str, params: Sequence[nn.Parameter], device: torch.device,
                  streamed_layers: Sequence[nn.Module], grad_dtype: torch.dtype = torch.float32,
                  separate_homes: bool = False, compute_dtype: torch.dtype = torch.float32,
                  keep_fp32: Sequence[nn.Parameter] = (), grads_in_homes: bool = False,
                  partition: ZeroPartition | None = None) -> HostOffload | None:
    """The offload for ``memory.offload``; None for "none"; ``grad_dtype``: the host gradients';
    ``separate_homes``: streamed weights apart from their masters (the delayed update);
    ``compute_dtype``: the forward's, which zero's device weights take (bf16 or fp16), except
    ``keep_fp32``'s (the routers' gates); ``grads_in_homes``: zero's streamed gradients land in
    their homes (m6.memory.home_grads); ``partition``: zero's partitioned host states (m6.memory.zero_partition)."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"memory.offload must be one of {OFFLOAD_MODES}, got {mode!r}")
    if mode == "none":
        return None
    if mode == "zero" and compute_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"memory.offload=zero keeps the device weights in the compute dtype, which is {compute_dtype} "
                         "here: use train.precision=bf16 or fp16")
    layers = list(streamed_layers) if mode in ("optimizer+params", "zero") else []
    return HostOffload(params, device, layers, grad_dtype, separate_homes,
                       weight_dtype=compute_dtype if mode == "zero" else None,
                       keep_fp32=keep_fp32 if mode == "zero" else (),
                       grads_in_homes=grads_in_homes and mode == "zero" and grad_dtype == compute_dtype,
                       partition=partition if mode == "zero" else None)
