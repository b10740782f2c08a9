"""offload_parameters(): a module's parameters kept in its OffloadedAdamW's state and
loaded just before each use (ZeRO-3 style)."""
from __future__ import annotations

import itertools
import sys
import time
import weakref
from typing import TYPE_CHECKING

import torch

from memascend import errors
from memascend.torch import activations as _activations
from memascend.torch import model_state as _model_state
from memascend.torch._common import OFFLOADED, forget_offload
from memascend.torch._marks import OnBackward, in_backward, outside_units, unit_types, wrap

if TYPE_CHECKING:
    from memascend.torch.optimizer import OffloadedAdamW

_instances = itertools.count()  # each ParameterOffload names its store tensors apart


class ParameterOffload:
    """offload_parameters()'s hooks on a module; ``remove()`` undoes them, parameters and all."""

    def __init__(self, module: torch.nn.Module, optimizer: OffloadedAdamW, window: int,
                 device_budget: int | None = None, read_ahead: int | None = None,
                 units=None) -> None:
        from memascend.torch.optimizer import OffloadedAdamW
        if not isinstance(optimizer, OffloadedAdamW):
            raise errors.InvalidArgumentError("offload_parameters needs an OffloadedAdamW: the "
                                              "parameters live in its state")
        optimizer._check()
        if optimizer._sharded:
            raise errors.UnimplementedError(
                "offload_parameters under torch.distributed: a rank holds only its shard of "
                "each parameter")
        self._opt = optimizer
        self._window = int(window)
        index = {id(p): i for i, p in enumerate(optimizer._params)}
        self._modules = []   # modules with parameters of their own, offloaded
        self._params_of = {}  # id(module) -> [(param, index)]
        units = unit_types(units)
        inside = set()  # ids of the modules below a unit: its hooks load their parameters
        # ...unless also used outside any unit (an instance a unit shares with its model,
        # which module.modules() yields once, inside the first unit): then it has hooks too.
        outside = outside_units(module, units)
        for m in module.modules():
            if id(m) in inside and id(m) not in outside:
                continue
            whole = bool(units) and isinstance(m, units)
            if whole:
                inside.update(id(d) for d in m.modules() if d is not m)
            own = [(p, index[id(p)]) for p in m.parameters(recurse=whole) if id(p) in index]
            if own:
                self._modules.append(m)
                self._params_of[id(m)] = own
        if not self._modules:
            raise errors.InvalidArgumentError("the module has no parameter the optimizer updates")
        self._cuda = optimizer._cuda  # the device path, or None on the CPU
        if self._cuda is not None:
            self._use_device(module, device_budget, read_ahead)
        else:
            self._use_store()
        self._count, self._loads = {}, {}  # param index -> fetches outstanding; -> loads
        self._order = []  # modules in the order of the first forward pass (for prefetch)
        self._position = {}
        self._callback_queued = False
        self._backward = False  # the pass under way (the device path reads ahead along it)
        self._recomputing = {}  # id(module) -> recomputed forwards not ended (checkpointing)
        self._acquired = set()  # on a GPU: parameters whose device copy is leased from the SDK
        self._views = {}  # on a GPU: param index -> (address, its tensor there); Note [device views]
        self._trace = None  # a memascend.torch.StepTrace while one step is traced
        self._names = {id(m): name or type(m).__name__ for name, m in module.named_modules()}
        self._marks = {}  # (pass, id(module)) -> the trace's mark where its compute began
        self._handles = []
        self._hooks = None  # the saved-tensor hooks while the root module runs
        self.fetches = 0
        self.views_made = 0  # on a GPU: device tensors made (Note [device views])
        # A root with parameters of its own (or a unit) sees the forward pass begun before
        # its loads; the saved-tensor hooks come after them (a load that raises enters none).
        first = [(module, module.register_forward_pre_hook(self._root_begins))]
        for m in self._modules:
            first.append((m, m.register_forward_pre_hook(self._pre_forward)))
            self._handles.append(m.register_forward_hook(self._post_forward))
        # The loads before the hooks a module had (weight_norm's computes its weight from
        # the offloaded weight_g and weight_v), the root's pass begun before its own loads.
        for m, h in reversed(first):
            m._forward_pre_hooks.move_to_end(h.id, last=False)
            self._handles.append(h)
        self._handles.append(module.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(module.register_forward_hook(self._root_post_forward))
        # model.state_dict() (torch.save, save_pretrained) gets the real parameters, and
        # model.load_state_dict() writes them (model_state.py), at any level of the model.
        covered = {i for own in self._params_of.values() for _, i in own}
        for m in module.modules():
            if m is module or any(index.get(id(p)) in covered for p in m._parameters.values()):
                self._handles.append(m._register_state_dict_hook(self._state_dict_hook))
                self._handles.append(m._register_load_state_dict_pre_hook(
                    self._load_state_dict_hook, with_module=True))
        optimizer._offloads.append(self)
        me = weakref.ref(self)
        for m in self._modules:
            for p, i in self._params_of[id(m)]:
                OFFLOADED[id(p)] = (me, i)
                self._release(p, i)
        weakref.finalize(self, forget_offload, me, [id(p) for p in optimizer._params])
        # Note [optimizer overlap]: with every parameter loaded through these hooks, each
        # step's update runs in the next forward pass, just before each group's load.
        optimizer._defer_updates(len(covered) == len(optimizer._params))

    # -- Note [device views]: on a GPU a use sets a parameter's data to a tensor over its
    # SDK device block (device_tensor, through __cuda_array_interface__); a release, to an
    # empty tensor. A group is used three times a micro-batch under accumulation or
    # checkpointing, mostly where it was, and the H200 computes a module at batch 1 faster
    # than the hooks run (docs/gpu.md, "The third lease"): so a group's tensor is kept with
    # its address and set again while the SDK returns that address, and releases share
    # one empty tensor per dtype and device. Both are made outside inference mode (`p.data
    # = t` gives p t's dispatch keys). They own nothing; remove() forgets them.
    def _use_device(self, module, device_budget, read_ahead):
        """The device budget: by default room for the largest module twice (in use, and
        the next), or under checkpointing for a layer and a module (Note [recomputed
        parameters]: a layer's recomputed parameters are held through its backward), plus
        the read-ahead, which is twice the largest module."""
        largest, layer = default_device_room(module, self._params_of, self._opt)
        read_ahead = int(read_ahead) if read_ahead is not None else 2 * largest
        budget = (int(device_budget) if device_budget is not None
                  else max(2 * largest, layer + largest) + read_ahead)
        self._cuda.use_device_budget(budget, read_ahead)

    # -- Note [parameter views]: on the CPU a parameter in use is a view of a block of the
    # optimizer's TensorStore, not a tensor of torch's heap. Each parameter has a scratch
    # tensor there, in the model's dtype (the optimizer's: fp32 models store no parameters,
    # they are derived from the master weights, so the view cannot be of the state itself,
    # which is cut in parts and kept in two versions). A fetch leases it for overwrite,
    # derives the parameters into it (load_parameters, as before: bit for bit the same
    # values) and sets p.data to torch.frombuffer over the lease, which keeps the lease alive
    # as long as any tensor views it. A release sets p.data back to an empty tensor; when
    # nothing else views the block, the lease is released and the tensor discarded (its
    # block back in the pool, nothing written to the volume). A view something still holds
    # (a tensor taken from p.data) keeps its lease until it dies; the next fetch derives
    # into the same block, as an optimizer's in-place update would. Nothing writes a block
    # but its fetch: the optimizer's update writes the master weights, and the fetch after it
    # derives again. Leased blocks stay within the budget less what the optimizer needs for
    # one part (min_host_budget: its blocks twice, room against fragmentation); a
    # parameter that finds no such room, or a store that has none, gets a tensor of its own
    # (counted in heap_fetches).
    def _use_store(self):
        opt = self._opt
        size = torch.empty((), dtype=opt._dtype).element_size()
        self._least = opt.min_host_budget(max(opt._numels), opt._part_elements, opt._dtype)
        self._nbytes = [n * size for n in opt._numels]
        self._leases = {}  # param index -> the lease its data views
        self._stale = []  # (weak reference to a lease still viewed after its release, index)
        self._tids = {}  # param index -> its store tensor (none for one the budget cannot hold)
        self.heap_fetches = 0
        prefix = f"memascend.torch.parameters{next(_instances)}.p"
        for own in self._params_of.values():
            for _, i in own:
                if i not in self._tids and self._nbytes[i] + self._least <= opt.host_budget:
                    self._tids[i] = opt._store.register(f"{prefix}{i}", self._nbytes[i], opt._dt,
                                                        list(opt._shapes[i]), durable=False)

    def _leased_bytes(self):
        """Bytes of the blocks that views hold (leases of one tensor share its block)."""
        self._stale = [(r, i) for r, i in self._stale if r() is not None and r().held]
        return sum(self._nbytes[i] for i in set(self._leases) | {i for _, i in self._stale})

    def _host_data(self, i):
        """Parameter i's values on the CPU: a view of its store block (Note [parameter
        views]), or a tensor of its own where the budget leaves no room."""
        opt = self._opt
        lease = None
        if i in self._tids and (self._leased_bytes() + self._nbytes[i] + self._least
                                <= opt.host_budget):
            try:
                lease = opt._store.acquire(self._tids[i], overwrite=True)
            except errors.ResourceExhaustedError:
                lease = None
        if lease is None:
            self.heap_fetches += 1
            h = torch.empty(opt._shapes[i], dtype=opt._dtype)
            opt._core.load_parameters(i, h.data_ptr(), h.numel(), opt._dt)
            return h
        try:
            opt._core.load_parameters(i, lease.address, opt._numels[i], opt._dt)
            view = torch.frombuffer(lease, dtype=opt._dtype).view(opt._shapes[i])
        except BaseException:
            lease.release()
            raise
        self._leases[i] = lease
        return view

    def _drop_view(self, i):
        """After p.data no longer views parameter i's block: the lease released and the
        block discarded, unless a tensor still views it (then its last holder releases it)."""
        lease = self._leases.pop(i, None)
        if lease is None:
            return
        if sys.getrefcount(lease) > 2:  # ours, getrefcount's: a tensor's besides
            self._stale.append((weakref.ref(lease), i))
            return
        lease.release()
        self._leased_bytes()  # forgets the stale leases released since
        if all(j != i for _, j in self._stale):  # else a kept view still leases the block
            self._opt._store.discard(self._tids[i])

    # -- fetch and release
    def _fetch(self, p, i):
        c = self._count.get(i, 0)
        if c == 0 and p.numel() != self._opt._numels[i]:
            opt = self._opt
            want = self._cuda.device if self._cuda is not None else torch.device("cpu")
            if p.dtype != opt._dtype or p.device != want:
                # model.to(dtype or device) under the hooks: the next load would undo it.
                raise errors.FailedPreconditionError(
                    f"parameter {i} became {p.dtype} on {p.device} after offload_parameters; "
                    f"its state is {opt._dtype} on {want}. Change the model's dtype or device "
                    "before making the optimizer (or after opt.close(), which gives the model "
                    "back)")
            t, first = self.trace, opt._next_update
            began = time.perf_counter() if t is not None else 0.0
            opt._update_through(i)  # the previous step's update reaches this group first
            if t is not None:
                loading = time.perf_counter()
                if opt._next_update != first:
                    t.host("update", f"groups {first}-{opt._next_update - 1}", began, loading)
            if self._cuda is not None:
                from memascend.torch.cuda import device_tensor, stream_handle
                dev = self._cuda.device
                address, n, code = self._cuda.params.acquire(i, stream_handle(dev), self._backward)
                self._acquired.add(i)
                # Note [device views]: a group found at the address of its last use gets the
                # tensor made then (a view of SDK memory, owning nothing), not a new one.
                view = self._views.get(i)
                if view is None or view[0] != address:
                    with torch.inference_mode(False):  # kept: never an inference tensor
                        view = (address, device_tensor(address, n, code, opt._shapes[i], dev))
                    self._views[i] = view
                    self.views_made += 1
                p.data = view[1]
            else:
                p.data = self._host_data(i)
            if t is not None:
                t.host("load", f"parameter {i}", loading, time.perf_counter())
            self.fetches += 1
        self._count[i] = c + 1

    def _release(self, p, i, force=False):
        c = self._count.get(i, 0)
        c = 0 if force else max(c - 1, 0)
        self._count[i] = c
        if c == 0:
            if i in self._acquired:
                from memascend.torch.cuda import stream_handle
                self._acquired.discard(i)
                self._cuda.params.release(i, stream_handle(self._cuda.device))
            p.data = _empty(p.dtype, p.device)
            if self._cuda is None:
                self._drop_view(i)

    def _prefetch(self, m, direction):
        if self._cuda is not None:
            return  # the SDK reads ahead by bytes along the recorded order
        k = self._position.get(id(m))
        if k is None:
            return
        # Not a parameter whose planned update already ran (Note [optimizer overlap]; a
        # tied one used again after its update, or one updated ahead of its use): a
        # prefetch would read stale master weights back from the volume and keep them
        # resident beside the new ones (issue 43: 96 MiB on the 100m benchmark).
        opt = self._opt
        updated = opt._next_update if opt._pending_update else 0
        for d in range(1, self._window + 1):
            j = k + d * direction
            if 0 <= j < len(self._order):
                for _, i in self._params_of[id(self._order[j])]:
                    if self._count.get(i, 0) == 0 and i >= updated:
                        opt._core.prefetch_parameters(i)

    # -- forward
    def _root_begins(self, module, inputs):
        if self._callback_queued and not in_backward():
            self._end_backward()  # a backward pass that raised never reached its end
        self._backward = False

    def _root_pre_forward(self, module, inputs):
        if self._hooks is not None:  # a forward that raised never reached its post-hook
            self._hooks.__exit__(None, None, None)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_activations.pack,
                                                               _activations.unpack)
        self._hooks.__enter__()

    def _root_post_forward(self, module, inputs, output):
        began = time.perf_counter()
        self._opt._finish_update()  # groups the forward pass did not load
        if self.trace is not None:
            self.trace.host("update", "the rest", began, time.perf_counter())
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _pre_forward(self, m, inputs):
        if id(m) not in self._position:
            self._position[id(m)] = len(self._order)
            self._order.append(m)
        self._prefetch(m, +1)
        for p, i in self._params_of[id(m)]:
            self._fetch(p, i)
        if not self._backward and in_backward():  # reached before any module's backward
            self._backward = True
            self._queue_end()
        if self._backward:  # a recomputation (checkpointing), which may stop early
            self._recomputing[id(m)] = self._recomputing.get(id(m), 0) + 1
        self._mark("fwd", m)
        if torch.is_grad_enabled():
            return wrap(inputs, lambda ts: OnBackward.apply(lambda: self._post_backward(m), *ts))
        return None

    def _post_forward(self, m, inputs, output):
        self._span("fwd", id(m), "recompute" if self._backward else "fwd")
        # Note [recomputed parameters]: a recomputation saves the parameters as they are
        # (on a GPU, views of device blocks) for the module's backward, later in the pass;
        # released here, a block could be refilled with another group's bytes first. So
        # they are held until _post_backward (or the pass's end): the budget holds a whole
        # checkpointed region's parameters (a unit's, with `units`).
        if not (self._backward and self._recomputing.get(id(m))):
            for p, i in self._params_of[id(m)]:
                self._release(p, i)
        if torch.is_grad_enabled():
            return wrap(output, lambda ts: OnBackward.apply(lambda: self._pre_backward(m), *ts))
        return None

    # -- backward
    def _pre_backward(self, m):
        self._backward = True
        self._queue_end()
        self._prefetch(m, -1)
        for p, i in self._params_of[id(m)]:
            self._fetch(p, i)
        self._mark("bwd", m)

    def _post_backward(self, m):
        self._span("bwd", id(m), "bwd")
        # Note [stopped recomputation]: torch >= 2.1's non-reentrant checkpoint stops its
        # recomputation once it has the tensors it needs (an exception through the forward),
        # so a module's forward hook may never see the end of a recomputed forward. Its
        # recomputation's loads, ended or not (Note [recomputed parameters]), are let go
        # here with its backward's own: one recomputation's a backward, as a module called
        # twice in a region is recomputed twice, its first call's backward still to come.
        held = self._recomputing.get(id(m), 0)
        self._recomputing[id(m)] = max(held - 1, 0)
        for _ in range(min(held, 1) + 1):
            for p, i in self._params_of[id(m)]:
                self._release(p, i)

    # -- the step's trace (memascend.torch.StepTrace): a module's compute, mark to span
    @property
    def trace(self):
        return self._trace

    @trace.setter
    def trace(self, trace):
        self._trace = trace
        self._marks.clear()  # no span pairs one trace's mark with another's

    def _mark(self, kind, m):
        if self._trace is not None:
            self._marks[kind, id(m)] = self._trace.now()

    def _span(self, kind, key, label):
        if self._trace is None:
            return
        begin = self._marks.pop((kind, key), None)
        if begin is not None:
            self._trace.compute(f"{label} {self._names.get(key, '?')}", begin, self._trace.now())

    def _queue_end(self):  # _end_backward at the end of the backward pass under way
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self):  # what loads next is a forward pass's, root called or not
        self._callback_queued = self._backward = False
        self._recomputing.clear()
        for kind, key in list(self._marks):  # modules whose inputs needed no gradient
            if kind == "bwd":
                self._span("bwd", key, "bwd")
        for m in self._modules:
            for p, i in self._params_of[id(m)]:
                if self._count.get(i, 0) > 0:
                    self._release(p, i, force=True)

    def __deepcopy__(self, memo):
        raise errors.FailedPreconditionError(
            "copy.deepcopy of a module under offload_parameters: its parameters live in the "
            "optimizer's state. Copy model.state_dict() (it holds the values), or deep-copy "
            "after opt.close() (or offload.remove()), which gives the model back")

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        return _model_state.fill(self, module, state_dict, prefix)

    def _load_state_dict_hook(self, module, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        _model_state.load(self, module, state_dict, prefix, error_msgs)

    def _ensure(self, i: int) -> torch.Tensor:
        """Parameter i in memory (for a saved view unpacked outside the module's hooks)."""
        p = self._opt._params[i]
        if self._count.get(i, 0) == 0:
            self._fetch(p, i)
            self._queue_end()
        return p

    def remove(self) -> None:
        """Brings every parameter back into memory (its own, on its device) and removes
        the hooks. OffloadedAdamW.close() calls it: a closed optimizer leaves the model
        whole. A second call does nothing."""
        if not self._handles:
            return
        opt = self._opt
        if self in self._opt._offloads:
            self._opt._offloads.remove(self)
        self._opt._defer_updates(False)  # finishes an update still planned
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._modules:
            for p, i in self._params_of[id(m)]:
                if self._count.get(i, 0) > 0:
                    self._release(p, i, force=True)
                if self._cuda is not None:
                    p.data = torch.empty(self._opt._shapes[i], dtype=self._opt._dtype,
                                         device=self._cuda.device)
                    self._cuda.copy_parameter(i, p)
                elif p.numel() != opt._numels[i]:  # its own memory, not a store block's
                    h = torch.empty(opt._shapes[i], dtype=opt._dtype)
                    opt._core.load_parameters(i, h.data_ptr(), h.numel(), opt._dt)
                    p.data = h
                self._count[i] = 0
                OFFLOADED.pop(id(p), None)
        self._views.clear()


def offload_parameters(module: torch.nn.Module, optimizer: OffloadedAdamW, window: int = 2,
                       device_budget: int | None = None, read_ahead: int | None = None,
                       units=None) -> ParameterOffload:
    """Keeps `module`'s parameters in `optimizer`'s state on the volume (ZeRO-3 style).

    Each submodule's own parameters are loaded (from the pinned pool, or the volume)
    just before its forward and again before its backward, and dropped after each.
    Between uses a parameter holds an empty tensor. Returns a ParameterOffload
    (``remove()`` undoes it). Call it after making the optimizer over the same parameters.

    On the CPU a parameter in use is a view of a block of the optimizer's store (Note
    [parameter views]), and the next `window` submodules' parameters are prefetched in the
    direction of the pass. On a GPU the parameters are copied into a device allocation of
    `device_budget` bytes on a copy stream of their own, and those of the next
    submodules are read ahead along the order the first forward pass recorded, up to
    `read_ahead` bytes (defaults: docs/python.md); gradients then leave the GPU as
    backward makes them.

    `units`: a module class, or a tuple of them, whose instances are loaded whole: the
    parameters of a unit and of everything below it come in together before its forward
    (and backward) and go after it, through one set of hooks, rather than each submodule's
    through its own (a transformer's decoder layer class, the unit FSDP2's users shard
    by). Fewer, larger uses: the hooks' host time a pass is divided by the submodules a
    unit holds, which counts where a module's compute is short (docs/gpu.md); the budget
    must hold a unit.
    """
    return ParameterOffload(module, optimizer, window, device_budget, read_ahead, units)


def default_device_room(module, params_of, opt):
    """(the largest hooked module's parameter bytes, the largest layer's under activation
    checkpointing as transformers marks it, a submodule's `gradient_checkpointing` true, or
    0): a layer is an element of an nn.ModuleList (a decoder layer, what transformers
    checkpoints), its bytes those of the offloaded parameters below it."""
    size = torch.empty((), dtype=opt._dtype).element_size()
    mine = {id(p): opt._numels[i] * size for own in params_of.values() for p, i in own}
    largest = max(sum(mine[id(p)] for p, _ in own) for own in params_of.values())
    ckpt = any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())
    layers = [c for m in module.modules() if ckpt and isinstance(m, torch.nn.ModuleList) for c in m]
    return largest, max([sum(mine.get(id(p), 0) for p in c.parameters()) for c in layers],
                        default=0)


_EMPTY = {}  # (dtype, device) -> the empty tensor a released parameter holds


def _empty(dtype, device):
    """The one empty tensor of `dtype` on `device` that released parameters share (Note
    [device views]): nothing is allocated for it, and nothing writes into it."""
    t = _EMPTY.get((dtype, device))
    if t is None:
        with torch.inference_mode(False):  # shared: never an inference tensor
            t = _EMPTY[dtype, device] = torch.empty(0, dtype=dtype, device=device)
    return t
