"""offload_activations(): the tensors autograd saves for the backward pass kept in a
TensorStore (pinned host memory under its budget, spilled to its volume beyond it)."""
from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Literal

import torch

from memascend import errors
from memascend.torch._common import dtype_name, is_kept_dtype, offload_of

if TYPE_CHECKING:
    from memascend import TensorStore

_local = threading.local()
_instances = itertools.count()  # each ActivationOffload names its slots apart

# A saved tensor's lease is read-only; torch.frombuffer warns once a process that it will
# not stop a write through the tensor (_unpack_cuda only reads it, copying to the GPU).
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning, module=r"memascend\.torch\.activations")


class _ParamView:
    """A saved tensor that is a parameter or a view of one: kept as how to remake it, and
    the model.load_state_dict()s of it so far: one since, before the backward pass, is
    refused there as torch refuses a parameter changed in place (its gradient would be
    taken at values the forward pass never used)."""
    __slots__ = ("owner", "index", "size", "stride", "offset", "whole", "loads")

    def __init__(self, owner, index, t, whole):
        self.owner, self.index, self.whole = owner, index, whole
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.loads = owner._loads.get(index, 0)


class _Kept:
    """A saved tensor kept as it is (a parameter, a view of one, one too small to store),
    with its version: autograd checks none that a hook returns, so one changed in place
    before the backward pass is caught here, as PyTorch catches it without hooks. A tensor
    with a history is kept detached (its version counter shared): an output its own node
    saves (tanh's, softmax's) held as it is holds that node, which holds this, a cycle
    through C++ that Python's collector never frees (a forward without a backward kept its
    graph for good); autograd gives an unpacked tensor its history back."""
    __slots__ = ("t", "version")

    def __init__(self, t):
        self.t, self.version = (t if t.grad_fn is None else t.detach()), t._version

    def unpack(self):
        if self.t._version != self.version:
            raise _modified(self.t.device, self.t.dtype, self.t.shape, self.t._version,
                            self.version)
        return self.t


def _modified(device, dtype, shape, now, then):
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{device.type} {dtype} {list(shape)}] is at version {now}; "
        f"expected version {then} instead (it was saved for the backward pass, through "
        "memascend.torch's saved-tensor hooks)")


def pack(t):
    """saved_tensors_hooks' pack: parameters by reference, activations to the store.

    Called for every tensor autograd saves, so an activation, the common case, takes no
    Parameter isinstance check (a Python-level __instancecheck__, two a tensor before):
    OFFLOADED's keys are ids of live parameters (an offload's entries go before it and
    the parameters it holds), checked to be parameters on a hit, and a plain torch.Tensor
    is not one."""
    base = t if t._base is None else t._base
    entry = offload_of(base)
    if entry is not None and isinstance(base, torch.nn.Parameter):
        return _ParamView(entry[0], entry[1], t, t is base)
    # A parameter, or a view of one (nn.Linear saves weight.t()), is kept as it is.
    if type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter):
        return _Kept(t)
    active = getattr(_local, "activations", None)
    if active:
        return active[-1]._pack(t)
    return _Kept(t)


def unpack(x):
    if isinstance(x, _ParamView):
        if x.owner._loads.get(x.index, 0) != x.loads:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: parameter {x.index} was loaded by load_state_dict() "
                "after the forward pass saved it (memascend.torch)")
        p = x.owner._ensure(x.index)
        return p if x.whole else p.data.as_strided(x.size, x.stride, x.offset)
    if isinstance(x, (_Saved, _Kept)):
        return x.unpack()
    return x


class _Saved:
    """One saved activation in the store; its slot is free again once the graph lets go."""
    __slots__ = ("owner", "id", "shape", "dtype", "device", "nbytes", "event", "source",
                 "version", "position", "__weakref__")

    def __init__(self, owner, tid, t, base, event=None):
        self.owner, self.id = owner, tid
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.event = event  # on a GPU: the copy out to the store
        # The tensor whose memory was saved (`t`'s base where `t` is a view), while it lives
        # (a weak reference), and the version then (a base and its views share one): the
        # same memory saved again is this one (its address alone would not do: once it is
        # freed, torch's allocator hands the address to the next tensor of that size), and
        # one modified in place after it was saved is caught at unpack, as PyTorch does.
        self.source = weakref.ref(base)
        self.version = t._version
        self.position = None  # on a GPU: its place in the forward's order of saves

    def check_version(self):
        t = self.source()
        if t is not None and t._version != self.version:
            raise _modified(self.device, self.dtype, self.shape, t._version, self.version)

    def unpack(self):
        self.check_version()
        return self.owner._unpack(self)

    def __del__(self):
        # Taken before the owner's lock: a save that finds this object in the owner's
        # table while it dies (its weak reference not cleared yet) sees no owner and makes
        # a new one, rather than handing out a slot about to be freed.
        owner, self.owner = self.owner, None
        if owner is not None:
            owner._free(self)


class ActivationOffload:
    """What offload_activations() returns: a context manager (saved_tensors_hooks)."""

    def __init__(self, store: TensorStore, min_bytes: int, read_ahead: int) -> None:
        self._store = store
        self._min_bytes = int(min_bytes)
        self._read_ahead = int(read_ahead)
        self._free_slots = {}  # nbytes -> [tensor id]
        self._slots = 0
        self._prefix = f"memascend.activation.{next(_instances)}"
        self._hooks = []  # one per entry: the same offload may be entered inside itself
        self.saved_bytes = 0  # bytes saved through the store (so far)
        self.peak_bytes = 0   # the most held at once
        self.deduplicated = 0  # saves of a tensor already saved (stored once)
        self._held = 0
        self._live = weakref.WeakValueDictionary()  # (address, geometry) -> its _Saved
        self._order = []  # this forward's saves on a GPU, in order (the backward reads back)
        self._pending = None  # on a GPU: leases until their copies complete
        self._side = {}       # on a GPU: each device's stream of the copies out
        self._host_event = None  # on a GPU: memascend.torch.cuda.host_event
        self._to_free = []    # slots let go while a copy of theirs was in flight
        # Autograd runs a backward pass's hooks on a thread per device (and a _Saved may die
        # on any thread): one lock over the bookkeeping, re-entered where a collection
        # frees a _Saved inside it.
        self._lock = threading.RLock()

    # -- on a GPU
    def _gpu(self, device):
        if self._pending is None:
            from memascend.torch.cuda import PendingLeases, host_event
            self._pending = PendingLeases()
            self._host_event = host_event
        if device not in self._side:  # a stream of the tensor's device: its copy runs there
            self._side[device] = torch.cuda.Stream(device)
        return self._pending

    def _reap(self):
        """Leases of completed copies let go; slots whose copies are done freed."""
        self._pending.reap(limit=self._store.host_budget // 2)
        if self._to_free:
            todo, self._to_free = self._to_free, []  # what _free adds meanwhile is kept
            for tid, nbytes in todo:
                if self._pending.holds(tid):
                    self._to_free.append((tid, nbytes))
                else:
                    self._free_slot(tid, nbytes)

    def _pack_cuda(self, t, tid, nbytes):
        """Copies `t` out to the tensor's pinned block on a side stream; its lease goes once
        the copy's event has completed (the block is CUDA-registered when the store's
        host_backing is 'cuda', so the copy is true DMA)."""
        pending = self._gpu(t.device)
        lease = self._store.acquire(tid, overwrite=True)  # a reused slot: no stale read
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        side = self._side[t.device]
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            torch.frombuffer(lease, dtype=torch.uint8).copy_(src.view(-1).view(torch.uint8),
                                                            non_blocking=True)
        src.record_stream(side)  # not reused by torch before the copy has read it
        event = self._host_event()
        event.record(side)
        pending.add(event, lease, nbytes, tid)
        return event

    def _unpack_cuda(self, saved):
        pending = self._gpu(saved.device)
        self._reap()
        self._read_ahead_from(saved)
        stream = torch.cuda.current_stream(saved.device)
        if saved.event is not None and not saved.event.query():
            stream.wait_event(saved.event)  # its bytes are still on their way out
        lease = self._store.acquire(saved.id)
        out = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
        out.view(-1).view(torch.uint8).copy_(torch.frombuffer(lease, dtype=torch.uint8),
                                             non_blocking=True)
        event = self._host_event()
        event.record(stream)
        pending.add(event, lease, saved.nbytes, saved.id)
        return out

    def _read_ahead_from(self, saved):
        """The backward pass reads back in reverse order of saving: the next few saved
        before this one are read from the volume ahead (a hint to the store)."""
        k = saved.position
        if k is None or k >= len(self._order) or self._order[k] != saved.id:
            return
        for j in range(k - 1, max(-1, k - 1 - self._read_ahead), -1):
            self._store.prefetch(self._order[j])

    # -- the hooks
    def _pack(self, t):
        with self._lock:
            return self._pack_held(t)

    def _pack_held(self, t):
        if t.numel() * t.element_size() < self._min_bytes or t.is_sparse or \
                not is_kept_dtype(t.dtype):
            return _Kept(t)
        # Saved twice (as several ops save their input, each through a view of its own:
        # F.linear flattens a 3-D input anew each call): stored once, if it is the same
        # memory of the same tensor, still alive and unchanged since.
        base = t if t._base is None else t._base
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        same = self._live.get(key)
        if same is not None and same.owner is self and same.source() is base and \
                same.version == t._version:
            self.deduplicated += 1
            return same
        if t.device.type == "cuda":
            self._gpu(t.device)
            self._reap()
        nbytes = t.numel() * t.element_size()
        free = self._free_slots.get(nbytes)
        if free:
            tid = free.pop()
        else:
            tid = self._store.register(f"{self._prefix}.{self._slots}", nbytes,
                                       dtype_name(t.dtype, "an activation"), durable=False)
            self._slots += 1
        event = None
        if t.device.type == "cpu":
            src = t.detach().contiguous()
            self._store.write_from(tid, src.data_ptr(), nbytes)
        elif t.device.type == "cuda":
            event = self._pack_cuda(t, tid, nbytes)
            position = len(self._order)
            self._order.append(tid)
        else:
            raise errors.UnimplementedError(f"offload_activations on {t.device.type}")
        self.saved_bytes += nbytes
        self._held += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)
        saved = _Saved(self, tid, t, base, event)
        if t.device.type == "cuda":
            saved.position = position
        self._live[key] = saved
        return saved

    def _unpack(self, saved):
        with self._lock:
            return self._unpack_held(saved)

    def _unpack_held(self, saved):
        if saved.device.type == "cpu":
            out = torch.empty(saved.shape, dtype=saved.dtype)
            self._store.read_into(saved.id, out.data_ptr(), saved.nbytes)
            return out
        return self._unpack_cuda(saved)

    def _free(self, saved):
        with self._lock:
            self._free_held(saved)

    def _free_held(self, saved):
        self._held -= saved.nbytes
        if not self._held:
            self._order.clear()
        if self._pending is not None and self._pending.holds(saved.id):
            # A copy from or to its block is in flight: the slot is reused only after it.
            self._to_free.append((saved.id, saved.nbytes))
            return
        self._free_slot(saved.id, saved.nbytes)

    def _free_slot(self, tid, nbytes):
        try:
            self._store.discard(tid)
        except errors.Error:
            pass  # a store closed first: nothing to free
        self._free_slots.setdefault(nbytes, []).append(tid)

    def synchronize(self) -> None:
        """Waits for every copy in flight and lets go of its lease."""
        with self._lock:
            if self._pending is not None:
                self._pending.drain()
                self._reap()

    def __enter__(self) -> ActivationOffload:
        stack = getattr(_local, "activations", None)
        if stack is None:
            stack = _local.activations = []
        stack.append(self)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self._hooks.pop().__exit__(*exc)
        _local.activations.pop()
        return False


def offload_activations(store: TensorStore, min_bytes: int = 1 << 16,
                        read_ahead: int = 4) -> ActivationOffload:
    """A context manager: tensors autograd saves for the backward pass while it is open
    (and at least `min_bytes` large) go to `store` (a memascend.TensorStore) as scratch
    tensors: pinned memory under its budget, spilled to its volume beyond it, read back
    when the backward pass needs them. Parameters are never copied. The forward pass
    runs inside the context; the backward may run after it closes.

    A tensor saved twice (or through two views of the same geometry) is stored once. On
    a GPU each saved tensor is copied out on a side stream (make the store with
    ``host_backing="cuda"`` so the copies are DMA), and the backward pass reads the next
    `read_ahead` saved tensors from the volume ahead of their use, in reverse order of
    saving.
    """
    return ActivationOffload(store, min_bytes, read_ahead)
