"""The GPU side of memascend.torch: the SDK's device paths (memascend/device_training.h)
driven from PyTorch's streams.

Nothing here stages through torch's pinned cache or pageable memory: gradients go from
the GPU into the store's pinned blocks (CUDA-registered) on a copy stream of their own,
parameters come back from those blocks on another, each fenced by CUDA events that the
compute stream (torch's current stream) waits on; host leases are let go only once the
copy that reads or writes them has completed.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from memascend import _core, errors
from memascend.torch._common import dtype_name, offloaded

if TYPE_CHECKING:
    from memascend.torch.optimizer import OffloadedAdamW

_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def stream_handle(device: torch.device) -> int:
    """torch's current stream on `device`, as the cudaStream_t the SDK takes."""
    return torch.cuda.current_stream(device).cuda_stream


def host_event() -> torch.cuda.Event:
    """An event the host may wait on (PendingLeases): made blocking, so a wait sleeps in
    the driver; torch's default event busy-waits a CPU for as long as the GPU takes (Note
    [blocking events], src/prim/cuda_memory.cpp)."""
    return torch.cuda.Event(blocking=True)


class _DeviceBytes:
    """Device memory owned by the SDK, seen by torch through __cuda_array_interface__."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


def device_tensor(address: int, elements: int, dtype_code: str, shape: Sequence[int],
                  device: torch.device) -> torch.Tensor:
    """A tensor over `elements` values at device `address` (SDK memory, not torch's):
    valid until the SDK's lease on it ends."""
    dtype = _TORCH_DTYPES[dtype_code]
    nbytes = elements * torch.empty((), dtype=dtype).element_size()
    raw = torch.as_tensor(_DeviceBytes(address, nbytes), device=device)
    return raw.view(dtype).view(shape)


class PendingLeases:
    """Store leases held until the copy that uses them has completed (a CUDA event, made
    by host_event: the waits here sleep)."""

    def __init__(self) -> None:
        self._pending = collections.deque()  # (event, lease, nbytes, key)
        self._keys = collections.Counter()    # key -> leases pending
        self.bytes = 0

    def add(self, event: torch.cuda.Event, lease: _core.Lease, nbytes: int,
            key: Hashable = None) -> None:
        self._pending.append((event, lease, nbytes, key))
        self._keys[key] += 1
        self.bytes += nbytes

    def holds(self, key: Hashable) -> bool:
        """Whether a lease added under `key` is still pending."""
        return self._keys.get(key, 0) > 0

    def _done(self, lease, nbytes, key):
        lease.release()
        self.bytes -= nbytes
        self._keys[key] -= 1
        if not self._keys[key]:
            del self._keys[key]

    def reap(self, limit: int | None = None) -> None:
        """Lets go of the leases whose copies are done; waits for the oldest while more
        than `limit` bytes are held."""
        while self._pending:
            event, lease, nbytes, key = self._pending[0]
            ready = event.query()
            if not ready and (limit is None or self.bytes <= limit):
                break
            # Taken before the wait (which lets go of the GIL): another thread reaping
            # meanwhile cannot let go of this one, nor this thread of the next unwaited.
            self._pending.popleft()
            if not ready:
                event.synchronize()
            self._done(lease, nbytes, key)

    def drain(self) -> None:
        while self._pending:
            event, lease, nbytes, key = self._pending.popleft()
            event.synchronize()
            self._done(lease, nbytes, key)


class OptimizerCuda:
    """An OffloadedAdamW's device paths: gradients out (DeviceGradients) and parameters in
    (DeviceParameters), each on a copy stream of its own."""

    def __init__(self, opt: OffloadedAdamW, device: torch.device,
                 offload_gradients: bool | None) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.opt = opt
        self.device = device
        self.grad_stream = torch.cuda.Stream(device)
        self.param_stream = torch.cuda.Stream(device)
        # A quarter of the store's budget may hold gradient parts whose copies are in flight.
        self.grads = _core.DeviceGradients(opt._core, copy_stream=self.grad_stream.cuda_stream,
                                           max_inflight=opt._store.host_budget // 4,
                                           device=device.index)
        # No device budget until offload_parameters asks for one: copies into the
        # parameters' own memory only.
        self.params = _core.DeviceParameters(opt._core, device_budget=0,
                                             copy_stream=self.param_stream.cuda_stream,
                                             device=device.index)
        self.budget = 0
        self.explicit = offload_gradients
        self.sent = set()      # parameters whose gradient went out this step
        self.begun = False     # the SDK's backward begun (begin_backward) this step
        self._hooks = []
        if offload_gradients:
            self.hook_gradients()

    # -- gradients
    def hook_gradients(self) -> None:
        """Each gradient goes out as soon as backward has accumulated it (torch >= 2.1)."""
        if self._hooks:
            return
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise errors.UnimplementedError(
                f"offload_gradients needs torch >= 2.1 (post-accumulate-grad hooks); this is "
                f"{torch.__version__}")
        for i, p in enumerate(self.opt._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, i=i: self._on_gradient(i, p)))

    def _begin(self):
        if not self.begun:
            self.opt._core.begin_backward(0.0)
            self.begun = True

    def _send(self, i, g):
        g = g.detach()
        if g.dtype != self.opt._dtype:
            g = g.to(self.opt._dtype)
        if not g.is_contiguous():
            g = g.contiguous()
        self._begin()
        self.grads.offload(i, g.data_ptr(), g.numel(), dtype_name(g.dtype, "a gradient"),
                           stream_handle(self.device))
        # The copy stream reads the memory: torch must not hand it out before that is done.
        g.record_stream(self.grad_stream)
        self.sent.add(i)

    def _on_gradient(self, i, p):
        if i in self.sent:
            raise errors.FailedPreconditionError(
                f"parameter {i} got a second gradient before step(): its first one went to "
                "the store already (offload_gradients). For gradient accumulation make the "
                "optimizer with offload_gradients=False (gradients then leave at step())")
        g = p.grad
        if g is None:
            return
        self.opt._grad(i, p)  # the checks of step(): dense, the right size
        self._send(i, g)
        p.grad = None

    def gradients_in(self, scale: float) -> None:
        """At step(): the gradients not sent yet go now; then every copy is waited for
        and checked (DeviceGradients.finish); `scale` is what they carry."""
        opt = self.opt
        self._begin()
        for i, p in enumerate(opt._params):
            if i in self.sent:
                continue
            g = p.grad
            if g is None:  # updated with a zero gradient, as DeepSpeed does
                z = torch.zeros(opt._numels[i], dtype=opt._dtype)
                opt._core.set_gradient(i, z.data_ptr(), z.numel(), opt._dt)
                continue
            opt._grad(i, p)  # the checks: dense, the right size
            self._send(i, g)
        self.grads.finish()
        if scale > 0:
            opt._core.set_gradient_scale(scale)
        self.sent.clear()
        self.begun = False

    def drop_gradients(self) -> None:
        """A step skipped (a GradScaler saw inf/NaN): what went out is not used."""
        self.grads.finish()
        self.sent.clear()
        self.begun = False

    # -- parameters
    def copy_parameter(self, i: int, p: torch.Tensor) -> None:
        """Parameter i's current values from the store into its own device memory."""
        if not p.data.is_contiguous():
            raise errors.FailedPreconditionError(
                f"parameter {i} is not contiguous on the GPU; OffloadedAdamW writes its new "
                "values in place")
        self.params.copy_to(i, p.data.data_ptr(), stream_handle(self.device))

    def parameters_out(self) -> None:
        """After an update: each parameter kept on the GPU gets its new values; the device
        copies of offloaded ones are dropped (the next acquire brings the new ones)."""
        for i, p in enumerate(self.opt._params):
            if offloaded(p):
                self.params.invalidate(i)
            else:
                self.copy_parameter(i, p)

    def use_device_budget(self, budget: int, read_ahead: int) -> None:
        """Parameters acquired on the device (offload_parameters), within `budget` bytes."""
        if self.budget:
            raise errors.FailedPreconditionError(
                "offload_parameters is applied already to this optimizer's parameters")
        old = self.params
        self.params = _core.DeviceParameters(self.opt._core, device_budget=int(budget),
                                             read_ahead=int(read_ahead),
                                             copy_stream=self.param_stream.cuda_stream,
                                             device=self.device.index)
        old.close()
        self.budget = int(budget)
        if self.explicit is None:
            self.hook_gradients()

    def stats(self) -> dict[str, Any]:
        return {"device_parameters": self.params.stats(), "device_gradients": self.grads.stats()}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for obj in (self.params, self.grads):
            obj.close()
