"""memascend.torch: a PyTorch training loop's optimizer state, parameters and saved
activations kept by MemAscend (pinned host memory under a budget, over a volume on NVMe).

    import memascend.torch as mt
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            volume="/nvme/run.vol", host_budget=256 << 20)
    ...                               # the usual loop: loss.backward(); opt.step(); opt.zero_grad()

``OffloadedAdamW`` has ``torch.optim.AdamW``'s semantics. Its fp32 master weights and both
moments live on the volume, updated part by part (``part_elements`` at a time) through
the SDK's offloaded optimizer under ``host_budget`` bytes of pinned memory; every step is
committed crash-consistently in the background, and ``resume=True`` continues from the
last committed step after a crash.

``offload_parameters(module, optimizer)`` keeps the parameters themselves there too
(ZeRO-3 style): each submodule's parameters are loaded before its forward and its
backward and dropped after. ``offload_activations(store)`` keeps the tensors autograd
saves for the backward pass in a TensorStore instead of ordinary (or pinned) memory.

Differences from torch.optim.AdamW, each deliberate:
- The optimizer owns the master weights: a parameter changed outside ``step()`` (a
  ``model.load_state_dict`` after the optimizer was made) must be told with
  ``reload_parameters()``.
- A parameter without a gradient at ``step()`` is updated with a zero gradient (its
  moments decay and weight decay applies), as DeepSpeed does; torch skips it.
- One ``betas`` and ``eps`` for every group (lr and weight_decay may differ per group),
  every parameter of one dtype (float32, float16 or bfloat16), and no ``amsgrad``,
  ``maximize`` or sparse gradients: each is refused with an exception, not ignored.

Thread-safety: one thread drives an optimizer and the modules it offloads.
"""
import os
import threading
import torch

from memascend import _core, errors

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DEFAULT_PART_ELEMENTS = 1 << 20


def _dtype_name(dtype, what):
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise errors.InvalidArgumentError(
            f"{what} has dtype {dtype}; MemAscend keeps float32, float16 and bfloat16") from None


def _host(t):
    """`t` as a contiguous CPU tensor (a copy only where needed)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state lives on a MemAscend volume (see the module's docstring).

    Args beyond AdamW's (keyword only):
      volume: a path (a volume file, made on first use, reopened after) or a
        memascend.Volume.
      host_budget: pinned host bytes for the state in flight (at least one part's
        gradient, parameters, master weights and moments: see min_host_budget()).
      volume_size: bytes of a new volume file (default: the state's need plus margin).
      part_elements: elements updated at once (a multiple of 2^18 keeps results
        independent of it).
      max_grad_norm: clip the global gradient norm to this (0: no clipping).
      dynamic_loss_scale, initial_scale: the SDK's own loss scaler (fp16 without
        torch's GradScaler: multiply the loss by ``loss_scale`` or use scale_loss()).
        A torch GradScaler works too, with this off.
      resume: continue from the volume's last committed step (``resumed_step`` tells
        which); without it, a volume holding a state is refused.
      overwrite: start over on a volume holding this model's state (that state is lost).
      threads: CPU threads of the update (default torch.get_num_threads()).
      read_ahead: bytes of state read ahead of the update (default: three parts).
      run_id: a number of the caller's, committed with the state; a volume holding
        another run_id's state is refused on resume.
    """

    # torch's GradScaler hands the scale to step() rather than unscaling the gradients.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 volume, host_budget, volume_size=None, part_elements=DEFAULT_PART_ELEMENTS,
                 max_grad_norm=0.0, dynamic_loss_scale=False, initial_scale=65536.0,
                 resume=False, overwrite=False, threads=None, read_ahead=None, run_id=0,
                 amsgrad=False, maximize=False, process_group=None):
        self._core = None
        self._store = None
        self._volume = None
        self._own_volume = False
        if not lr >= 0.0:
            raise errors.InvalidArgumentError(f"invalid learning rate: {lr}")
        if not eps > 0.0:
            raise errors.InvalidArgumentError(f"invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise errors.InvalidArgumentError(f"invalid betas: {betas}")
        if not weight_decay >= 0.0:
            raise errors.InvalidArgumentError(f"invalid weight_decay value: {weight_decay}")
        if amsgrad or maximize:
            raise errors.UnimplementedError("OffloadedAdamW has no amsgrad or maximize")
        if resume and overwrite:
            raise errors.InvalidArgumentError("resume and overwrite exclude each other")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False)
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        for gi, g in enumerate(self.param_groups):
            if tuple(g["betas"]) != tuple(betas) or g["eps"] != eps:
                raise errors.InvalidArgumentError(
                    f"parameter group {gi} has its own betas or eps; OffloadedAdamW takes one "
                    "betas and eps for every group (lr and weight_decay may differ)")
            if g.get("amsgrad") or g.get("maximize"):
                raise errors.UnimplementedError("OffloadedAdamW has no amsgrad or maximize")
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1:
            raise errors.InvalidArgumentError(
                f"parameters of dtypes {sorted(str(d) for d in dtypes)}; OffloadedAdamW keeps "
                "one dtype (cast the model, or make one optimizer per dtype)")
        self._dtype = dtypes.pop()
        self._dt = _dtype_name(self._dtype, "a parameter")
        self._shapes = [tuple(p.shape) for p in self._params]
        self._numels = [p.numel() for p in self._params]
        for i, n in enumerate(self._numels):
            if n == 0:
                raise errors.InvalidArgumentError(f"parameter {i} has no elements")
        # Note [sharded state]: under torch.distributed each rank owns a contiguous 1/N of
        # every parameter's elements (its master weights and moments, on its own volume);
        # the gradients are averaged across the ranks (all_reduce), each rank updates its
        # shard, and the new parameters are all-gathered. One process owns everything.
        self._pg, self._world, self._rank = _process_group(process_group)
        if self._world > 1 and dynamic_loss_scale:
            raise errors.UnimplementedError(
                "dynamic_loss_scale under torch.distributed: the ranks' overflow checks would "
                "disagree; train bf16 without loss scaling, or in one process")
        self._shards = []  # per parameter: (its group in the SDK's layout or None, begin, end)
        layout = []
        for i, n in enumerate(self._numels):
            chunk = -(-n // self._world)
            begin, end = min(n, self._rank * chunk), min(n, (self._rank + 1) * chunk)
            self._shards.append((len(layout) if end > begin else None, begin, end))
            if end > begin:
                layout.append((f"p{i}", end - begin))
        if not layout:
            raise errors.InvalidArgumentError(
                f"rank {self._rank} of {self._world} owns no parameter element: fewer ranks")
        self._max_grad_norm = float(max_grad_norm)
        self.comm_bytes = 0  # bytes this rank sent into collectives, all steps together
        self._part_elements = int(part_elements)
        self._step_count = 0
        self.resumed_step = None
        self.last_step = None  # what the last step() did: skipped, grad_norm, loss_scale
        self.skipped_steps = 0
        try:
            if isinstance(volume, (str, os.PathLike)):
                path = os.fspath(volume).replace("{rank}", str(self._rank))
                if volume_size is None:
                    need = _core.OffloadedAdam.stored_bytes(layout, self._dt, self._dt,
                                                            self._part_elements)
                    volume_size = need + need // 8 + (64 << 20)
                self._volume = _core.Volume.open_or_create(path, int(volume_size))
                self._own_volume = True
            else:
                self._volume = volume
            self._store = _core.TensorStore(self._volume, host_budget=int(host_budget),
                                            defer_prefetches=True)
            self._core = _core.OffloadedAdam(
                self._store, layout, self._dt, self._dt, self._part_elements,
                [float(self.param_groups[self._group_of[i]]["lr"]) for i in self._owned()],
                [float(self.param_groups[self._group_of[i]]["weight_decay"])
                 for i in self._owned()],
                float(betas[0]), float(betas[1]), float(eps),
                float(max_grad_norm) if self._world == 1 else 0.0,  # sharded: clipped here
                bool(dynamic_loss_scale), float(initial_scale), int(run_id),
                int(read_ahead or 0), int(threads or torch.get_num_threads()))
            self._applied = {i: (float(self.param_groups[self._group_of[i]]["lr"]),
                                 float(self.param_groups[self._group_of[i]]["weight_decay"]))
                             for i in self._owned()}
            self._dynamic = bool(dynamic_loss_scale)
            record = self._core.resume()
            if self._world > 1 and resume:
                record = self._agree_on_resume(record)
            if record is not None and not (resume or overwrite):
                raise errors.FailedPreconditionError(
                    f"volume {self._volume.path} holds this model's training state at step "
                    f"{record['step']}; pass resume=True to continue it, or overwrite=True to "
                    "start over (its state is then lost)")
            if record is not None and resume:
                self._step_count = int(record["step"])
                self.resumed_step = self._step_count
                self._load_into_parameters()
            else:
                self._initialize()
        except BaseException:
            self.close()
            raise
        self._frozen = True

    # ---- construction and teardown

    def _owned(self):
        """The parameters this rank holds a shard of, in the order of its layout."""
        return [i for i, (k, _, _) in enumerate(self._shards) if k is not None]

    def _agree_on_resume(self, record):
        """The step every rank's volume holds (memascend Note [previous commit]): a rank
        killed between its commit and the others' leaves them a step apart; the ranks
        ahead go back one."""
        import torch.distributed as dist
        mine = torch.tensor([-1 if record is None else int(record["step"])], dtype=torch.int64)
        steps = [torch.zeros_like(mine) for _ in range(self._world)]
        dist.all_gather(steps, mine, group=self._pg)
        steps = [int(t) for t in steps]
        common = min(steps)
        failure = None
        if record is not None and int(record["step"]) > common:
            try:
                record = None if common < 0 else self._core.resume(at_most=common)
            except errors.Error as e:
                failure = e
        ok = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        dist.all_reduce(ok, group=self._pg)
        if int(ok) != 0:
            raise errors.FailedPreconditionError(
                f"the ranks' volumes hold different steps ({steps}, -1: none) and not every "
                f"rank can go back to step {common}" + (f": {failure.message}" if failure
                                                        else " (another rank could not)"))
        if common < 0 and record is not None:
            raise errors.FailedPreconditionError(
                f"the ranks' volumes hold different steps ({steps}, -1: none): a rank has no "
                "state; start over (overwrite=True)")
        return record

    def _initialize(self):
        with torch.no_grad():
            for i, p in enumerate(self._params):
                k, begin, end = self._shards[i]
                if k is None:
                    continue
                h = _host(p.detach()).reshape(-1)[begin:end].contiguous()
                self._core.initialize(k, h.data_ptr(), h.numel(), self._dt)
        self._core.commit(self._step_count)

    def _load_into_parameters(self):
        with torch.no_grad():
            if self._world > 1:
                for i, p in enumerate(self._params):
                    k, begin, end = self._shards[i]
                    mine = torch.empty(end - begin, dtype=self._dtype)
                    if k is not None:
                        self._core.load_parameters(k, mine.data_ptr(), mine.numel(), self._dt)
                    p.data.copy_(self._gather(i, mine).view(self._shapes[i]))
                return
            for i, p in enumerate(self._params):
                if _offloaded(p):
                    continue
                self._write_parameter(i, p, lambda h: self._core.load_parameters(
                    i, h.data_ptr(), h.numel(), self._dt))

    def _gather(self, i, mine, dtype=None):
        """Parameter i's shards from every rank, whole (flat), in fp32 on the wire; in
        the parameters' dtype unless `dtype` is given."""
        import torch.distributed as dist
        n = self._numels[i]
        chunk = -(-n // self._world)
        padded = torch.zeros(chunk, dtype=torch.float32)
        padded[:mine.numel()] = mine.float()
        parts = [torch.empty(chunk, dtype=torch.float32) for _ in range(self._world)]
        dist.all_gather(parts, padded, group=self._pg)
        self.comm_bytes += 4 * chunk
        return torch.cat(parts)[:n].to(self._dtype if dtype is None else dtype)

    def _write_parameter(self, i, p, fill):
        """Runs fill(host tensor) to produce parameter i's values, in place in p."""
        if p.device.type == "cpu" and p.is_contiguous():
            fill(p.data)
        else:
            h = torch.empty(self._shapes[i], dtype=self._dtype,
                            pin_memory=p.device.type == "cuda")
            fill(h)
            p.data.copy_(h, non_blocking=False)

    def add_param_group(self, param_group):
        if getattr(self, "_frozen", False):
            raise errors.FailedPreconditionError(
                "a parameter group added after construction: OffloadedAdamW lays its state out "
                "on the volume when it is made; make a new optimizer for the new parameters")
        super().add_param_group(param_group)

    def close(self):
        """Waits for the last commit and closes the state, its store and (if the
        optimizer opened it) its volume. Raises the last commit's error, if any."""
        first = None
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

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a destructor has nobody to tell
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check(self):
        if self._core is None:
            raise errors.FailedPreconditionError("the optimizer is closed")
        now = [p for g in self.param_groups for p in g["params"]]
        if len(now) != len(self._params) or any(a is not b for a, b in zip(now, self._params)):
            raise errors.FailedPreconditionError(
                "the parameter groups changed after construction (a parameter added, removed "
                "or replaced): OffloadedAdamW lays its state out on the volume when it is made; "
                "make a new optimizer")

    # ---- what torch.optim users call

    @staticmethod
    def min_host_budget(max_numel, part_elements=DEFAULT_PART_ELEMENTS, dtype=torch.float32):
        """The least host_budget for parameters of at most `max_numel` elements."""
        name = _dtype_name(dtype, "dtype")
        return _core.OffloadedAdam.minimum_host_budget(int(max_numel), int(part_elements), name,
                                                       name)

    @property
    def loss_scale(self):
        """The SDK's loss scale (1 unless dynamic_loss_scale)."""
        return self._core.loss_scale

    def scale_loss(self, loss):
        return loss * self._core.loss_scale

    @property
    def steps(self):
        """step() calls so far, counting those resumed from the volume."""
        return self._step_count

    def _outside_scale(self, grad_scaler):
        """(scale the gradients carry, skip) from a torch GradScaler, if one drives us."""
        if grad_scaler is not None:  # torch 1.x: step(grad_scaler=...)
            if self._dynamic:
                raise errors.FailedPreconditionError(
                    "a GradScaler and dynamic_loss_scale both scale the loss; use one")
            return float(grad_scaler._get_scale_async().item()), False
        grad_scale = getattr(self, "grad_scale", None)  # torch 2.x sets these two
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf.sum().item()) > 0:
            return 0.0, True
        if grad_scale is not None:
            if self._dynamic:
                raise errors.FailedPreconditionError(
                    "a GradScaler and dynamic_loss_scale both scale the loss; use one")
            return float(grad_scale.item()), False
        return 0.0, False

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got unexpected arguments {sorted(kwargs)}")
        self._check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._world > 1:
            if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
                raise errors.UnimplementedError(
                    "a GradScaler under torch.distributed: its overflow checks see each rank's "
                    "gradients before they are averaged; train bf16 without loss scaling")
            self._step_sharded()
            return loss
        scale, skip = self._outside_scale(grad_scaler)
        if skip:  # the GradScaler saw inf/NaN: no step, as torch's optimizers do
            self.skipped_steps += 1
            self.last_step = {"skipped": True, "grad_norm": 0.0, "loss_scale": scale}
            return loss
        core = self._core
        core.begin_backward(scale)
        for i, p in enumerate(self._params):
            g = _host(self._grad(i, p))
            core.set_gradient(i, g.data_ptr(), g.numel(), _dtype_name(g.dtype, "a gradient"))
        self._apply_group_options()
        plan = core.end_backward(1.0)
        if grad_scaler is not None:  # tell the GradScaler what the fused check found
            scale_t = grad_scaler._get_scale_async()
            found = torch.full((1,), 1.0 if plan["skipped"] else 0.0, dtype=torch.float32,
                               device=scale_t.device)
            grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"][
                scale_t.device] = found
        if plan["skipped"]:
            self.skipped_steps += 1
        else:
            for i, p in enumerate(self._params):
                if _offloaded(p):
                    core.update_group(i)
                else:
                    self._write_parameter(i, p, lambda h, i=i: core.update_group(
                        i, h.data_ptr(), h.numel(), self._dt))
        self._step_count += 1
        core.commit(self._step_count)
        self.last_step = {"skipped": plan["skipped"], "grad_norm": plan["grad_norm"],
                          "loss_scale": plan["loss_scale"]}
        return loss

    def _apply_group_options(self):
        """A scheduler's changes of lr and weight_decay, into the SDK's groups."""
        for i in self._owned():
            group = self.param_groups[self._group_of[i]]
            now = (float(group["lr"]), float(group["weight_decay"]))
            if now != self._applied[i]:
                self._core.set_group_options(self._shards[i][0], *now)
                self._applied[i] = now

    def _grad(self, i, p):
        g = p.grad
        if g is None:
            return torch.zeros(self._shapes[i], dtype=self._dtype)
        if g.is_sparse:
            raise errors.InvalidArgumentError(
                f"parameter {i} (shape {list(self._shapes[i])}) has a sparse gradient; "
                "OffloadedAdamW takes dense gradients, as torch.optim.AdamW")
        if g.numel() != self._numels[i]:
            raise errors.InvalidArgumentError(
                f"parameter {i}'s gradient has {g.numel()} elements, not {self._numels[i]}")
        return g

    def _step_sharded(self):
        """Note [sharded state]: average, check, clip, update the shard, gather."""
        import torch.distributed as dist
        core = self._core
        # This rank's last commit durable before the collectives: no rank completes step
        # s + 1 before every rank's step s is durable, so after a crash the ranks' volumes
        # are at most a step apart and the ranks ahead can go back (Note [previous commit]).
        core.settle()
        grads, finite, sum_sq = [], True, 0.0
        for i, p in enumerate(self._params):
            g = self._grad(i, p)
            if g is p.grad and g.dtype == torch.float32 and g.device.type == "cpu" and \
                    g.is_contiguous():
                g = g.view(-1)  # averaged in place, as DDP leaves param.grad: no copy
            else:
                g = _host(g).reshape(-1).to(torch.float32).clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self._pg)
            self.comm_bytes += 4 * g.numel()
            g.div_(self._world)
            finite = finite and bool(torch.isfinite(g).all())
            if finite and self._max_grad_norm > 0:
                sum_sq += float(g.double().pow(2).sum())
            grads.append(g)
        # Every rank holds the same averaged gradients, so every rank decides alike.
        if not finite:
            self.skipped_steps += 1
            self.last_step = {"skipped": True, "grad_norm": 0.0, "loss_scale": 1.0}
            self._step_count += 1
            core.commit(self._step_count)
            return
        norm = sum_sq ** 0.5
        if self._max_grad_norm > 0:
            coef = min(1.0, self._max_grad_norm / (norm + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        core.begin_backward(0.0)
        for i, g in enumerate(grads):
            k, begin, end = self._shards[i]
            if k is not None:
                part = g[begin:end]
                core.set_gradient(k, part.data_ptr(), part.numel(), "float32")
        self._apply_group_options()
        plan = core.end_backward(1.0)
        for i, p in enumerate(self._params):
            k, begin, end = self._shards[i]
            mine = torch.empty(end - begin, dtype=self._dtype)
            if k is not None:
                core.update_group(k, mine.data_ptr(), mine.numel(), self._dt)
            whole = self._gather(i, mine)
            p.data.copy_(whole.view(self._shapes[i]))
        self._step_count += 1
        core.commit(self._step_count)
        self.last_step = {"skipped": plan["skipped"], "grad_norm": norm if self._max_grad_norm > 0
                          else None, "loss_scale": 1.0}

    def settle(self):
        """Waits until the last step's commit is durable (raising its error, if any)."""
        self._core.settle()

    def reload_parameters(self):
        """Makes the parameters' current values the master weights (after they were
        changed outside step(), e.g. by model.load_state_dict); the moments stay."""
        self._check()
        if self._world > 1:
            self._refuse_offloaded("reload_parameters")
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if _offloaded(p):
                    continue
                k, h = self._mine(i, _host(p.detach()))
                if k is None:
                    continue
                self._core.write_state("master", k, h.data_ptr(), h.numel(), self._dt)
                self._core.write_state("param", k, h.data_ptr(), h.numel(), self._dt)
        self._core.commit(self._step_count)

    def _mine(self, i, whole):
        """This rank's group for parameter i and its slice of `whole` (any shape; all of
        it in one process): (None, None) where the rank owns none of it."""
        k, begin, end = self._shards[i]
        if k is None:
            return None, None
        return k, whole.reshape(-1)[begin:end].contiguous()

    def _refuse_offloaded(self, what):
        if any(_offloaded(p) for p in self._params):
            raise errors.UnimplementedError(
                f"{what}() under torch.distributed with offload_parameters: a rank holds only "
                "its shard of the parameters")

    def stats(self):
        """I/O and store counters: bytes read and written, evictions, skipped steps."""
        return self._core.stats()

    # ---- state_dict in torch.optim.AdamW's format (plus 'master' for 16-bit parameters)

    def state_dict(self):
        """The state whole, in torch.optim.AdamW's format. Under torch.distributed it is a
        collective (call it on every rank): each rank's shards are all-gathered and every
        rank returns the whole state."""
        self._check()
        state = {}
        step = torch.tensor(float(self._core.adam_step))
        for i in range(len(self._params)):
            entry = {"step": step.clone()}
            kinds = ["exp_avg", "exp_avg_sq"] + (["master"] if self._dt != "float32" else [])
            for kind in kinds:
                k, begin, end = self._shards[i]
                t = torch.empty(end - begin, dtype=torch.float32)
                if k is not None:
                    self._core.read_state(kind, k, t.data_ptr(), t.numel(), "float32")
                if self._world > 1:
                    t = self._gather(i, t, dtype=torch.float32)
                entry[kind] = t.view(self._shapes[i])
            state[i] = entry
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads a state_dict of this optimizer or of torch.optim.AdamW over the same
        parameters; committed to the volume at once. Under torch.distributed every rank
        loads the same whole state_dict and keeps its shard of it."""
        self._check()
        if self._world > 1:
            self._refuse_offloaded("load_state_dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise errors.InvalidArgumentError(
                "the state_dict's parameter groups differ from this optimizer's in number or size")
        order = [idx for g in groups for idx in g["params"]]
        steps = set()
        with torch.no_grad():
            for i, idx in enumerate(order):
                entry = state_dict["state"].get(idx)
                if entry is None:
                    raise errors.InvalidArgumentError(f"the state_dict has no state for parameter {i}")
                steps.add(float(entry["step"]))
                for kind in ("exp_avg", "exp_avg_sq"):
                    t = _host(entry[kind].detach().to(torch.float32))
                    if t.numel() != self._numels[i]:
                        raise errors.InvalidArgumentError(
                            f"parameter {i}'s {kind} has {t.numel()} elements, not {self._numels[i]}")
                    k, h = self._mine(i, t)
                    if k is not None:
                        self._core.write_state(kind, k, h.data_ptr(), h.numel(), "float32")
                master = entry.get("master")
                if master is None:
                    master = self._params[i].detach()
                    if _offloaded(self._params[i]):
                        continue  # its master weights are on the volume already
                k, h = self._mine(i, _host(master.to(torch.float32)))
                if k is None:
                    continue
                self._core.write_state("master", k, h.data_ptr(), h.numel(), "float32")
                self._core.write_state("param", k, h.data_ptr(), h.numel(), "float32")
        if len(steps) > 1:
            raise errors.InvalidArgumentError(
                f"the parameters were stepped {sorted(steps)} times; OffloadedAdamW keeps one "
                "step count")
        self._core.set_adam_step(int(steps.pop()) if steps else 0)
        for mine, theirs in zip(self.param_groups, groups):
            for key in ("lr", "weight_decay"):
                if key in theirs:
                    mine[key] = theirs[key]
        self._core.commit(self._step_count)


def _process_group(group):
    """(group, world size, rank) of torch.distributed when it is initialised, else one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise errors.FailedPreconditionError(
                "a process_group without torch.distributed initialised")
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


# ---- parameter offload -------------------------------------------------------------------

# id(parameter) -> (ParameterOffload, index), while offloaded. (Keyed by id: a tensor's ==
# is elementwise, which a WeakKeyDictionary would call.)
_OFFLOADED = {}


def _offloaded(p):
    return id(p) in _OFFLOADED


class ParameterOffload:
    """What offload_parameters() returns: the hooks on a module. ``remove()`` brings the
    parameters back into memory and takes the hooks off."""

    def __init__(self, module, optimizer, window):
        if not isinstance(optimizer, OffloadedAdamW):
            raise errors.InvalidArgumentError("offload_parameters needs an OffloadedAdamW: the "
                                              "parameters live in its state")
        optimizer._check()
        if optimizer._world > 1:
            raise errors.UnimplementedError(
                "offload_parameters under torch.distributed: a rank holds only its shard of "
                "each parameter")
        self._opt = optimizer
        self._window = int(window)
        index = {id(p): i for i, p in enumerate(optimizer._params)}
        self._modules = []   # modules with parameters of their own, offloaded
        self._params_of = {}  # id(module) -> [(param, index)]
        for m in module.modules():
            own = [(p, index[id(p)]) for p in m.parameters(recurse=False) if id(p) in index]
            if own:
                self._modules.append(m)
                self._params_of[id(m)] = own
        if not self._modules:
            raise errors.InvalidArgumentError("the module has no parameter the optimizer updates")
        self._count = {}  # param index -> fetches outstanding
        self._order = []  # modules in the order of the first forward pass (for prefetch)
        self._position = {}
        self._callback_queued = False
        self._device_of = {}  # param index -> the device it lives on when in memory
        self._handles = []
        self._hooks = None  # the saved-tensor hooks while the root module runs
        self.fetches = 0
        for m in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward))
        self._handles.append(module.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(module.register_forward_hook(self._root_post_forward))
        for m in self._modules:
            for p, i in self._params_of[id(m)]:
                _OFFLOADED[id(p)] = (self, i)
                self._release(p, i)

    # -- fetch and release
    def _fetch(self, p, i):
        c = self._count.get(i, 0)
        if c == 0 and p.numel() != self._opt._numels[i]:
            opt = self._opt
            dev = self._device_of.get(i, torch.device("cpu"))
            h = torch.empty(opt._shapes[i], dtype=opt._dtype, pin_memory=dev.type == "cuda")
            opt._core.load_parameters(i, h.data_ptr(), h.numel(), opt._dt)
            p.data = h if dev.type == "cpu" else h.to(dev, non_blocking=True)
            self.fetches += 1
        self._count[i] = c + 1

    def _release(self, p, i, force=False):
        c = self._count.get(i, 0)
        c = 0 if force else max(c - 1, 0)
        self._count[i] = c
        if c == 0:
            self._device_of.setdefault(i, p.device)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _prefetch(self, m, direction):
        k = self._position.get(id(m))
        if k is None:
            return
        for d in range(1, self._window + 1):
            j = k + d * direction
            if 0 <= j < len(self._order):
                for _, i in self._params_of[id(self._order[j])]:
                    if self._count.get(i, 0) == 0:
                        self._opt._core.prefetch_parameters(i)

    # -- forward
    def _root_pre_forward(self, module, inputs):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self._hooks.__enter__()

    def _root_post_forward(self, module, inputs, output):
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
        if torch.is_grad_enabled():
            return _wrap(inputs, lambda ts: _OnBackward.apply(lambda: self._post_backward(m), *ts))
        return None

    def _post_forward(self, m, inputs, output):
        for p, i in self._params_of[id(m)]:
            self._release(p, i)
        if torch.is_grad_enabled():
            return _wrap(output, lambda ts: _OnBackward.apply(lambda: self._pre_backward(m), *ts))
        return None

    # -- backward
    def _pre_backward(self, m):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._prefetch(m, -1)
        for p, i in self._params_of[id(m)]:
            self._fetch(p, i)

    def _post_backward(self, m):
        for p, i in self._params_of[id(m)]:
            self._release(p, i)

    def _end_backward(self):
        self._callback_queued = False
        for m in self._modules:
            for p, i in self._params_of[id(m)]:
                if self._count.get(i, 0) > 0:
                    self._release(p, i, force=True)

    def _ensure(self, i):
        """Parameter i in memory (for a saved view unpacked outside the module's hooks)."""
        p = self._opt._params[i]
        if self._count.get(i, 0) == 0:
            self._fetch(p, i)
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        return p

    def remove(self):
        """Brings every parameter back into memory and removes the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._modules:
            for p, i in self._params_of[id(m)]:
                if self._count.get(i, 0) == 0:
                    self._fetch(p, i)
                self._count[i] = 0
                _OFFLOADED.pop(id(p), None)


def offload_parameters(module, optimizer, window=2):
    """Keeps `module`'s parameters in `optimizer`'s state on the volume (ZeRO-3 style).

    Each submodule's own parameters are loaded (from the pinned pool, or the volume)
    just before its forward and again before its backward, and dropped after each;
    the next `window` submodules' are prefetched in the direction of the pass. Between
    uses a parameter holds an empty tensor. Returns a ParameterOffload (``remove()``
    undoes it). Call it after making the optimizer over the same parameters.
    """
    return ParameterOffload(module, optimizer, window)


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors, calling `callback` when the backward pass reaches them:
    on a module's outputs, before the module's backward (its parameters are loaded); on
    its inputs, after it (they are dropped)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def _wrap(obj, apply):
    """obj with its floating tensors that need a gradient passed through apply(tensors)."""
    found = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)

    collect(obj)
    if not found:
        return None
    out = apply(found)
    if not isinstance(out, tuple):
        out = (out,)
    replacement = {id(a): b for a, b in zip(found, out)}

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return replacement.get(id(x), x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(rebuild(y) for y in x))
        if isinstance(x, (tuple, list)):
            return type(x)(rebuild(y) for y in x)
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = rebuild(x[k])
            return x
        return x

    return rebuild(obj)


# ---- saved activations ---------------------------------------------------------------------

_local = threading.local()


class _ParamView:
    """A saved tensor that is a parameter or a view of one: kept as how to remake it."""
    __slots__ = ("owner", "index", "size", "stride", "offset", "whole")

    def __init__(self, owner, index, t, whole):
        self.owner, self.index, self.whole = owner, index, whole
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _pack(t):
    base = t if t._base is None else t._base
    entry = _OFFLOADED.get(id(base)) if isinstance(base, torch.nn.Parameter) else None
    if entry is not None:
        return _ParamView(entry[0], entry[1], t, t is base)
    if isinstance(t, torch.nn.Parameter):
        return t
    active = getattr(_local, "activations", None)
    if active:
        return active[-1]._pack(t)
    return t


def _unpack(x):
    if isinstance(x, _ParamView):
        p = x.owner._ensure(x.index)
        return p if x.whole else p.data.as_strided(x.size, x.stride, x.offset)
    if isinstance(x, _Saved):
        return x.unpack()
    return x


class _Saved:
    """One saved activation in the store; its slot is free again once the graph lets go."""
    __slots__ = ("owner", "id", "shape", "dtype", "device", "nbytes", "__weakref__")

    def __init__(self, owner, tid, t):
        self.owner, self.id = owner, tid
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()

    def unpack(self):
        store = self.owner._store
        if self.device.type == "cpu":
            out = torch.empty(self.shape, dtype=self.dtype)
            store.read_into(self.id, out.data_ptr(), self.nbytes)
            return out
        with store.acquire(self.id) as lease:
            host = torch.frombuffer(lease, dtype=torch.uint8).view(self.dtype).view(self.shape)
            return host.to(self.device)

    def __del__(self):
        owner = self.owner
        if owner is not None:
            owner._free(self)


class ActivationOffload:
    """What offload_activations() returns: a context manager (saved_tensors_hooks)."""

    def __init__(self, store, min_bytes):
        self._store = store
        self._min_bytes = int(min_bytes)
        self._free_slots = {}  # nbytes -> [tensor id]
        self._slots = 0
        self._hooks = None
        self.saved_bytes = 0  # bytes saved through the store (so far)
        self.peak_bytes = 0   # the most held at once
        self._held = 0

    def _pack(self, t):
        if t.numel() * t.element_size() < self._min_bytes or t.is_sparse or \
                t.dtype not in _DTYPE_NAMES:
            return t
        nbytes = t.numel() * t.element_size()
        free = self._free_slots.get(nbytes)
        if free:
            tid = free.pop()
        else:
            tid = self._store.register(f"memascend.activation.{self._slots}", nbytes,
                                       _DTYPE_NAMES[t.dtype], durable=False)
            self._slots += 1
        if t.device.type == "cpu":
            src = t.detach().contiguous()
            self._store.write_from(tid, src.data_ptr(), nbytes)
        else:
            with self._store.acquire(tid, write=True) as lease:
                torch.frombuffer(lease, dtype=torch.uint8).copy_(
                    t.detach().contiguous().view(-1).view(torch.uint8))
        self.saved_bytes += nbytes
        self._held += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)
        return _Saved(self, tid, t)

    def _free(self, saved):
        self._held -= saved.nbytes
        try:
            self._store.discard(saved.id)
        except errors.Error:
            pass  # a store closed first: nothing to free
        self._free_slots.setdefault(saved.nbytes, []).append(saved.id)

    def __enter__(self):
        stack = getattr(_local, "activations", None)
        if stack is None:
            stack = _local.activations = []
        stack.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        _local.activations.pop()
        return False


def offload_activations(store, min_bytes=1 << 16):
    """A context manager: tensors autograd saves for the backward pass while it is open
    (and at least `min_bytes` large) go to `store` (a memascend.TensorStore) as scratch
    tensors: pinned memory under its budget, spilled to its volume beyond it, read back
    when the backward pass needs them. Parameters are never copied. The forward pass
    runs inside the context; the backward may run after it closes.
    """
    return ActivationOffload(store, min_bytes)
