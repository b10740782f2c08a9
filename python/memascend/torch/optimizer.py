"""OffloadedAdamW: torch.optim.AdamW with its state on a MemAscend volume."""
import os

import torch

from memascend import _core, errors
from memascend.torch import distributed as _dist
from memascend.torch import scaling as _scaling
from memascend.torch import state as _state
from memascend.torch._common import (DEFAULT_PART_ELEMENTS, MAX_THREADS, check_adamw,
                                     check_groups, check_parameters, choose_budget,
                                     dense_grad, dtype_name, host, made_here, offloaded,
                                     refuse_frozen, refuse_in_child, track, whole)
from memascend.torch.buckets import GradientBuckets


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state lives on a MemAscend volume (see the package's docstring).

    Args beyond AdamW's (keyword only):
      volume: a path (a volume file, made on first use, reopened after) or a
        memascend.Volume.
      host_budget: pinned host bytes for the state in flight (at least twice one part's
        gradient, parameters, master weights and moments: see min_host_budget()); capped
        at what the state can ever hold (``host_budget`` then says the budget in use).
        None (the default): chosen from the machine (docs/python.md, "Host budget";
        ``host_budget_reason`` says which limit decided; unlocked memory with one
        MemlockWarning under a small RLIMIT_MEMLOCK). A given budget above the memory
        limit (or RLIMIT_MEMLOCK, page-locked) raises ResourceExhaustedError.
      volume_size: bytes of a new volume file (default: the state's need plus margin).
      part_elements: elements updated at once (a multiple of 2^18 keeps results
        independent of it).
      max_grad_norm: clip the global gradient norm to this (0: no clipping).
      dynamic_loss_scale, initial_scale: the SDK's own loss scaler (fp16 without
        torch's GradScaler: multiply the loss by ``loss_scale`` or use scale_loss()).
        A torch GradScaler works too, with this off.
      resume: continue from the volume's last committed step (``resumed_step`` tells
        which); without it, a volume holding a state is refused.
      overwrite: start over on a volume holding this or another model's training state
        (that state is lost); a volume has one owner at a time (Note [state ownership]).
      threads: CPU threads of the update (default torch.get_num_threads()).
      read_ahead: bytes of state read ahead of the update (default: three parts).
      run_id: a number of the caller's, committed with the state (a resume of another's: refused).
      offload_gradients: with parameters on a GPU, send each gradient to the store as
        soon as backward has made it and free it on the GPU (``p.grad`` is then None
        after backward: clip with ``max_grad_norm``, not on ``p.grad``). Default: on under
        offload_parameters(), else off (the gradients go out at ``step()``). Under
        torch.distributed (on a GPU or the CPU, torch >= 2.1): each gradient goes into its
        bucket and the bucket is reduce-scattered during backward.
      commit_every: make every N-th step durable (default 1: each one). The steps between
        stay in memory: a crash resumes at the last durable one (``resumed_step``, at most
        N-1 steps back); settle() and close() make every step durable. A new volume is
        made a version larger (docs/python.md, "Commit interval").
      staging: with every step durable, "bounded" (the default: a step's writes committed
        in batches within a bound, the volume the state and the bound) or "step" (the
        whole step staged and committed once, under the next forward and backward passes:
        faster where the disk is the limit; a new volume is a version larger, as for
        commit_every).
      write_back_depth: state parts a commit writes at once (default: the SDK's, 8; at
        most 256); for measuring a disk (bench/commit.py).
      io_threads: the store's threads that read state ahead and write it back (default:
        the SDK's, 2; at most 64); for measuring a disk (bench/gpu/compare.py).
    """

    # torch's GradScaler hands the scale to step() rather than unscaling the gradients.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 volume, host_budget=None, volume_size=None, part_elements=DEFAULT_PART_ELEMENTS,
                 max_grad_norm=0.0, dynamic_loss_scale=False, initial_scale=65536.0,
                 resume=False, overwrite=False, threads=None, read_ahead=None, run_id=0,
                 amsgrad=False, maximize=False, process_group=None, offload_gradients=None,
                 commit_every=1, write_back_depth=None, io_threads=None, staging="bounded"):
        self._core = self._store = self._volume = self._cuda = self._shard_io = None
        self._grads = None  # under torch.distributed: the gradients' buckets
        self._own_volume, self._offloads = False, []  # offload_parameters() over it
        check_adamw(lr, betas, eps, weight_decay, amsgrad, maximize, resume, overwrite, staging)
        # Integers the SDK takes, checked here: a clear message rather than a crash (a part
        # of 0 elements divides by zero) or pybind's list of signatures.
        host_budget = whole("host_budget", host_budget, 1, 1 << 50, optional=True)
        part_elements = whole("part_elements", part_elements, 1, 1 << 34)
        volume_size = whole("volume_size", volume_size, 1, 1 << 56, optional=True)
        threads = whole("threads", threads, 1, MAX_THREADS, optional=True)
        read_ahead = whole("read_ahead", read_ahead, 0, 1 << 50, optional=True)
        run_id = whole("run_id", run_id, 0, (1 << 64) - 1)
        commit_every = whole("commit_every", commit_every, 1, 1_000_000)
        write_back_depth = whole("write_back_depth", write_back_depth, 1, 256, optional=True)
        io_threads = whole("io_threads", io_threads, 1, 64, optional=True)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False)
        super().__init__(params, defaults)
        self.state = _state.StateView(self)  # read from the volume per parameter
        self._params = [p for g in self.param_groups for p in g["params"]]
        refuse_frozen(self._params, at_construction=True)
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._betas_eps = (tuple(betas), eps)
        self._record = _state.record_bytes(self._betas_eps)  # in each commit
        check_groups(self.param_groups, self._betas_eps, "has its own")
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1:
            raise errors.InvalidArgumentError(
                f"parameters of dtypes {sorted(str(d) for d in dtypes)}; OffloadedAdamW keeps "
                "one dtype (cast the model, or make one optimizer per dtype)")
        self._dtype = dtypes.pop()
        self._dt = dtype_name(self._dtype, "a parameter")
        self._shapes = [tuple(p.shape) for p in self._params]
        self._numels = [p.numel() for p in self._params]
        for i, n in enumerate(self._numels):
            if n == 0:
                raise errors.InvalidArgumentError(f"parameter {i} has no elements")
        devices = {p.device for p in self._params}
        cuda = [d for d in devices if d.type == "cuda"]
        if cuda and len(devices) > 1:
            raise errors.InvalidArgumentError(
                f"parameters on {sorted(str(d) for d in devices)}; OffloadedAdamW takes the "
                "parameters of one device")
        self._device = cuda[0] if cuda else torch.device("cpu")
        # Note [sharded state]: under torch.distributed each rank owns a contiguous 1/N of
        # every parameter's elements (its master weights and moments, on its own volume);
        # the gradients are averaged across the ranks (reduce-scatter: each rank gets and
        # stores only its shard; on a GPU over NCCL, on the device), the overflow check and
        # norm are summed across them, each rank updates its shard, and the new parameters
        # are all-gathered (memascend/torch/distributed.py). One process owns everything;
        # a process_group given explicitly runs this path at one rank too.
        self._pg, self._world, self._rank = _dist.process_group(process_group)
        self._sharded = self._world > 1 or process_group is not None
        if self._sharded:
            _dist.check_backend(self)
            _dist.check_same_model(self, dict(resume=bool(resume), overwrite=bool(overwrite),
                                              offload_gradients=offload_gradients,
                                              commit_every=commit_every))
        self._shards = []  # per parameter: (its group in the SDK's layout or None, begin, end)
        layout = []
        for i, n in enumerate(self._numels):
            chunk = -(-n // self._world)
            begin, end = min(n, self._rank * chunk), min(n, (self._rank + 1) * chunk)
            self._shards.append((len(layout) if end > begin else None, begin, end))
            if end > begin:
                layout.append((f"p{i}", end - begin))
        last = self._world - 1  # the rank that owns least: refused alike on every rank
        if not any(last * -(-n // self._world) < n for n in self._numels):
            raise errors.InvalidArgumentError(
                f"rank {last} of {self._world} owns no parameter element: fewer ranks")
        self.comm_bytes = 0  # bytes this rank sent into collectives, all steps together
        self._part_elements = int(part_elements)
        # The last step committed (not `_step_count`, which torch's LR schedulers set on the
        # optimizer they drive and count themselves).
        self._step_number, self.skipped_steps, self.resumed_step = 0, 0, None
        self.last_step = None  # what the last step() did: skipped, grad_norm, loss_scale
        # Note [optimizer overlap] (memascend/offloaded_optimizer.h): under
        # offload_parameters covering every parameter, step() plans the update and the next
        # forward pass runs it group by group, each just before the group is loaded.
        self._deferred, self._pending_update, self._next_update = False, False, 0
        # On a GPU the stored ones go there (and, sharded, through the device paths).
        store_parameters = True if cuda or (self._sharded and _dist.EMULATE_DEVICE) else None
        opened = False
        try:
            if self._sharded and offload_gradients:
                GradientBuckets.require_hooks()
            need = _core.OffloadedAdam.stored_bytes(layout, self._dt, self._dt,
                                                    self._part_elements, store_parameters,
                                                    self._sharded)
            # A budget beyond every stored tensor (the state once; twice on a data-parallel
            # rank) would be page-locked for nothing: capped there (never below one part).
            least = _core.OffloadedAdam.minimum_host_budget(
                max(n for _, n in layout), self._part_elements, self._dt, self._dt)
            on_host = 0 if cuda else sum(n * p.element_size()
                                         for n, p in zip(self._numels, self._params))
            self.host_budget, self.host_budget_reason, self.host_budget_locked = choose_budget(
                least, max(need, least), on_host, bool(cuda), host_budget)
            if isinstance(volume, (str, os.PathLike)):
                path = os.fspath(volume).replace("{rank}", str(self._rank))
                if volume_size is None:  # memascend Note [volume size]
                    volume_size = _core.OffloadedAdam.volume_bytes(layout, self._dt, self._dt,
                        self._part_elements, store_parameters, self._sharded, commit_every,
                        staging == "step")
                self._volume = _core.Volume.open_or_create(path, int(volume_size))
                self._own_volume = True
            else:
                self._volume = volume
            # CUDA-registered on a GPU: copies to and from the device are true DMA.
            self._store = _core.TensorStore(self._volume, host_budget=self.host_budget,
                                            defer_prefetches=True,
                                            host_backing="cuda" if cuda else
                                            "auto" if self.host_budget_locked else "unlocked",
                                            write_back_depth=write_back_depth or 0,
                                            **({"prefetch_threads": io_threads}
                                               if io_threads else {}))
            self._core = _core.OffloadedAdam(
                self._store, layout, self._dt, self._dt, self._part_elements,
                [float(self.param_groups[self._group_of[i]]["lr"]) for i in self._owned()],
                [float(self.param_groups[self._group_of[i]]["weight_decay"])
                 for i in self._owned()],
                float(betas[0]), float(betas[1]), float(eps),
                float(max_grad_norm), bool(dynamic_loss_scale), float(initial_scale),
                int(run_id), int(read_ahead or 0), int(threads or torch.get_num_threads()),
                store_parameters, bool(overwrite), self._sharded, commit_every,
                _dist.gradient_check(self) if self._sharded else None, staging == "step")
            self._applied = {i: (float(self.param_groups[self._group_of[i]]["lr"]),
                                 float(self.param_groups[self._group_of[i]]["weight_decay"]))
                             for i in self._owned()}
            self._dynamic = bool(dynamic_loss_scale)
            if cuda:
                from memascend.torch.cuda import OptimizerCuda
                self._cuda = OptimizerCuda(self, self._device,
                                           False if self._sharded else offload_gradients)
            if self._sharded:  # memascend/torch/buckets.py: offload_gradients hooks backward
                self._shard_io = _dist.shard_io(self)
                self._grads = GradientBuckets(self)
                if offload_gradients:
                    self._grads.hook()
            record = self._core.resume()
            opened = True  # what may fail on one rank only is behind: agreed before any
            if self._sharded:  # collective, every rank learning whether the others opened
                _dist.agree_opened(self, True)
            if self._sharded and resume:
                record = _dist.agree_on_resume(self, record)
            held = record is not None and not (resume or overwrite)
            others = _dist.ranks_where(self, held) if self._sharded else []
            if held or others:  # every rank refuses, or none (the others would wait)
                raise errors.FailedPreconditionError(
                    (f"volume {self._volume.path} holds this model's training state at step "
                     f"{record['step']}" if held else
                     f"the volumes of ranks {others} hold this model's training state") +
                    "; pass resume=True to continue it, or overwrite=True to start over (its "
                    "state is then lost)")
            if record is not None and resume:
                _state.check_record(self, record)
                self._step_number = int(record["step"])
                self.resumed_step = self._step_number
                _state.load_into_parameters(self)
            else:
                if record is not None:  # overwrite: no step count or loss scale carried on
                    self._core.start_over()
                _state.initialize(self)
        except BaseException:
            if self._sharded and not opened:
                try:
                    _dist.agree_opened(self, False)  # the others stop with this rank
                except Exception:  # noqa: BLE001 - this rank's own error is the one to raise
                    pass
            self.close()
            raise
        self._frozen = True
        track(self)  # closed at exit if still open (by this process only)

    # ---- construction and teardown

    def _owned(self):
        """The parameters this rank holds a shard of, in the order of its layout."""
        return [i for i, (k, _, _) in enumerate(self._shards) if k is not None]

    def _write_parameter(self, i, p, fill):
        """Runs fill(host tensor) to produce parameter i's values, in place in p (a CPU
        parameter; on a GPU the device path copies from the store)."""
        if p.is_contiguous():
            fill(p.data)
        else:
            h = torch.empty(self._shapes[i], dtype=self._dtype)
            fill(h)
            p.data.copy_(h)

    def add_param_group(self, param_group):
        """Refused after construction (FailedPreconditionError): the state's layout on the
        volume is fixed when the optimizer is made. Make a new optimizer for new parameters."""
        if getattr(self, "_frozen", False):
            raise errors.FailedPreconditionError(
                "a parameter group added after construction: OffloadedAdamW lays its state out "
                "on the volume when it is made; make a new optimizer for the new parameters")
        super().add_param_group(param_group)

    def close(self):
        """Finishes an update still planned, waits for the last commit and closes the state,
        its store and (if it opened it) its volume; raises the last commit's error, if any."""
        refuse_in_child(self)  # before anything: a forked child's copy writes nothing
        first = None
        if getattr(self, "_core", None) is not None:
            try:
                # The model whole again: offloaded parameters back in their own memory.
                for offload in list(getattr(self, "_offloads", [])):
                    offload.remove()
                self._finish_update()
            except errors.Error as e:
                first = e
        for name in ("_grads", "_shard_io", "_cuda"):  # before the optimizer they use
            obj = getattr(self, name, None)
            if obj is not None:
                setattr(self, name, None)
                obj.close()
        for name in ("_core", "_store"):
            obj = getattr(self, name, None)
            if obj is not None:
                setattr(self, name, None)
                try:
                    obj.close()
                except errors.Error as e:
                    first = first or e
        if getattr(self, "_own_volume", False) and self._volume is not None:
            try:
                self._volume.close()
            except errors.Error as e:
                first = first or e
            self._volume = None
        if first is not None:
            raise first

    __repr__ = _state.describe  # torch's, with the volume and the host budget

    def __del__(self):
        try:
            if made_here(self):  # never from a forked child
                self.close()
        except Exception:  # noqa: BLE001 - a destructor has nobody to tell
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check(self):
        self._open()
        self._finish_update()
        now = [p for g in self.param_groups for p in g["params"]]
        if len(now) != len(self._params) or any(a is not b for a, b in zip(now, self._params)):
            raise errors.FailedPreconditionError(
                "the parameter groups changed after construction (a parameter added, removed "
                "or replaced): OffloadedAdamW lays its state out on the volume when it is made; "
                "make a new optimizer")
        check_groups(self.param_groups, self._betas_eps, "changed to")

    # ---- what torch.optim users call

    @staticmethod
    def min_host_budget(max_numel, part_elements=DEFAULT_PART_ELEMENTS, dtype=torch.float32):
        """The least host_budget for parameters of at most `max_numel` elements."""
        name = dtype_name(dtype, "dtype")
        return _core.OffloadedAdam.minimum_host_budget(int(max_numel), int(part_elements), name,
                                                       name)

    def _open(self):
        """The SDK's optimizer, or FailedPreconditionError once closed."""
        if self._core is None:
            raise errors.FailedPreconditionError("the optimizer is closed")
        return self._core

    @property
    def loss_scale(self):
        """The SDK's loss scale (1 unless dynamic_loss_scale)."""
        return self._open().loss_scale

    def scale_loss(self, loss):
        """The loss multiplied by the SDK's loss scale (dynamic_loss_scale)."""
        return loss * self._open().loss_scale

    @property
    def steps(self):
        """step() calls so far, counting those resumed from the volume."""
        return self._step_number

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One AdamW step over the state on the volume, committed crash-consistently."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got unexpected arguments {sorted(kwargs)}")
        self._check()
        check_parameters(self)  # (not at state_dict(): reading the state needs none of them)
        refuse_frozen(self._params, at_construction=False)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._sharded:
            if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
                raise errors.UnimplementedError(
                    "a GradScaler under torch.distributed: its overflow checks see each rank's "
                    "gradients before they are averaged; use dynamic_loss_scale=True, or "
                    "train bf16 without loss scaling")
            _dist.step_sharded(self)
            return loss
        scale, skip = _scaling.outside_scale(self, grad_scaler)
        if skip:  # the GradScaler saw inf/NaN: no step, as torch's optimizers do
            if self._cuda is not None:
                self._cuda.drop_gradients()
            self.skipped_steps += 1
            self.last_step = {"skipped": True, "grad_norm": 0.0, "loss_scale": scale}
            return loss
        core = self._core
        if self._cuda is not None:
            self._cuda.gradients_in(scale)
        else:
            core.begin_backward(scale)
            for i, p in enumerate(self._params):
                g = host(self._grad(i, p))
                core.set_gradient(i, g.data_ptr(), g.numel(), dtype_name(g.dtype, "a gradient"))
        self._apply_group_options()
        plan = core.end_backward(1.0)
        _scaling.report(self, grad_scaler, plan)
        if plan["skipped"]:
            self.skipped_steps += 1
        elif self._deferred:
            self._step_number += 1
            self._pending_update = True  # run by the next forward pass, then committed
            self._next_update = 0
            self.last_step = {"skipped": False, "grad_norm": plan["grad_norm"],
                              "loss_scale": plan["loss_scale"]}
            return loss
        elif self._cuda is not None:
            for i in range(len(self._params)):
                core.update_group(i)  # the new parameters go to the store
        else:
            for i, p in enumerate(self._params):
                if offloaded(p):
                    core.update_group(i)
                else:
                    self._write_parameter(i, p, lambda h, i=i: core.update_group(
                        i, h.data_ptr(), h.numel(), self._dt))
        self._step_number += 1
        core.commit(self._step_number, self._record)
        if self._cuda is not None and not plan["skipped"]:
            self._cuda.parameters_out()
        self.last_step = {"skipped": plan["skipped"], "grad_norm": plan["grad_norm"],
                          "loss_scale": plan["loss_scale"]}
        return loss

    # ---- Note [optimizer overlap]

    def _defer_updates(self, on):
        self._finish_update()
        self._deferred = bool(on)

    def _update_through(self, i):
        """The planned update, group by group in order, up to parameter i (before it is
        loaded); committed once every group has been updated."""
        if not self._pending_update:
            return
        core, n = self._core, len(self._params)
        while self._next_update <= min(i, n - 1):
            k = self._next_update
            core.update_group(k)
            if self._cuda is not None:
                self._cuda.params.invalidate(k)  # its device copy is of the old parameters
            self._next_update += 1
        if self._next_update == n:
            self._pending_update = False
            core.commit(self._step_number, self._record)

    def _finish_update(self):
        if self._pending_update:
            self._update_through(len(self._params) - 1)

    def _apply_group_options(self):
        """A scheduler's changes of lr and weight_decay, into the SDK's groups."""
        for i in self._owned():
            group = self.param_groups[self._group_of[i]]
            now = (float(group["lr"]), float(group["weight_decay"]))
            if now != self._applied[i]:
                self._core.set_group_options(self._shards[i][0], *now)
                self._applied[i] = now

    def _grad(self, i, p):
        return dense_grad(p, i, self._shapes[i], self._dtype)

    def settle(self):
        """Makes every step so far durable (under ``commit_every``, the steps since the
        last durable one too), raising the commit's error, if any; an update still planned
        (under offload_parameters) is run and committed first."""
        self._open()
        self._finish_update()
        self._core.persist()

    def reload_parameters(self):
        """Makes the parameters' current values the master weights (after they were
        changed outside step(), e.g. by model.load_state_dict); the moments stay."""
        _state.reload_parameters(self)

    def stats(self):
        """I/O and store counters: bytes read and written, evictions, skipped steps (and,
        on a GPU, the device paths' counters)."""
        s = self._open().stats()
        if self._cuda is not None:
            s.update(self._cuda.stats())
        elif self._shard_io is not None:  # the device paths emulated (tests)
            s.update(self._shard_io.stats())
        return s

    def state_dict(self):
        """The state whole, in torch.optim.AdamW's format. Under torch.distributed it is a
        collective (call it on every rank): each rank's shards are all-gathered and every
        rank returns the whole state."""
        return _state.state_dict(self)

    def load_state_dict(self, state_dict):
        """Loads a state_dict of this optimizer or of torch.optim.AdamW over the same
        parameters; committed to the volume at once. Under torch.distributed every rank
        loads the same whole state_dict and keeps its shard of it."""
        _state.load_state_dict(self, state_dict)
