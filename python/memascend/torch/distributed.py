"""OffloadedAdamW under torch.distributed: Note [sharded state] (optimizer.py).

Each rank owns a contiguous 1/N of every parameter's elements. At step() the gradients are
reduced in buckets of whole parameters by one reduce-scatter each (an all-reduce where the
backend has none: gloo), so that each rank receives its shard of the bucket's parameters
in one piece and sends only that to its store; the SDK's overflow check and norm of each
rank's shard are summed across the ranks (memascend Note [global gradient check]), so every
rank skips, clips and scales alike; each rank updates its shard, and the new parameters are
all-gathered, again a bucket at a time.

Where the shards travel (`shard_io`): on the CPU through host memory (`HostShards`); with
the parameters on a GPU over NCCL through the device paths (`DeviceShards`: a gradient's
shard goes from device memory into the store's registered blocks on the gradient copy
stream, the new parameters come back on the parameter copy stream, both fenced by events
torch's stream waits on), so that nothing but a rank's own shard crosses the host. Tests
run the device paths over host memory (the SDK's emulation) with `EMULATE_DEVICE`.
"""
import weakref

import torch

from memascend import _core, errors
from memascend.torch import buckets as _buckets
from memascend.torch._common import dtype_name, offloaded

# Tests only: the device paths over host memory, for parameters on the CPU (set before
# the optimizer is made).
EMULATE_DEVICE = False


def process_group(group):
    """(group, world size, rank) of torch.distributed when it is initialised, else one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise errors.FailedPreconditionError(
                "a process_group without torch.distributed initialised")
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def check_backend(opt):
    """Sets opt._nccl and opt._comm_device: the collectives run over device tensors on NCCL
    (parameters on a GPU), over host tensors elsewhere (gloo, parameters on the CPU)."""
    import torch.distributed as dist
    backend = str(dist.get_backend(opt._pg))
    on_gpu = opt._device.type == "cuda"
    if on_gpu and "nccl" not in backend:
        raise errors.InvalidArgumentError(
            f"parameters on a GPU under torch.distributed take the nccl backend (this group's "
            f"is {backend}): OffloadedAdamW reduces the gradients on the GPU and copies out "
            "only the rank's shard")
    if not on_gpu and "nccl" in backend and "gloo" not in backend:
        raise errors.InvalidArgumentError(
            f"parameters on the CPU under the {backend} backend: NCCL takes GPU tensors; make "
            "the group with gloo, or keep the parameters on the GPU")
    opt._nccl = on_gpu
    opt._comm_device = opt._device if on_gpu else torch.device("cpu")


def _every(opt, values):
    """Every rank's `values` (a few integers), by rank (a collective)."""
    import torch.distributed as dist
    mine = torch.tensor(values, dtype=torch.int64, device=opt._comm_device)
    every = [torch.zeros_like(mine) for _ in range(opt._world)]
    dist.all_gather(every, mine, group=opt._pg)
    return [t.tolist() for t in every]


def check_same_model(opt, options):
    """Every rank's optimizer over the same parameters (their number, shapes and dtype) and
    with the same `options` (those that decide its collectives), or InvalidArgumentError
    on every rank: ranks that differ would enter collectives of different sizes or order
    (a hang, or shards of one rank's tensor taken for another's)."""
    import zlib
    text = f"{opt._dtype}|{options}|" + ";".join("x".join(map(str, s)) for s in opt._shapes)
    every = _every(opt, [len(opt._shapes), sum(opt._numels), zlib.crc32(text.encode())])
    if any(e != every[0] for e in every):
        raise errors.InvalidArgumentError(
            "the ranks' optimizers hold different parameters or options ([tensors, "
            f"elements, checksum of shapes, dtype and options] by rank: {every}); every rank "
            "must build the same model, pass the same parameters in the same order, and "
            f"the same options (this rank's: {options})")


def gradient_check(opt):
    """The SDK's reduce_gradient_check: any rank's overflow, the sum of the ranks' sums of
    squares (an all-reduce). Holds the optimizer weakly (the SDK holds this)."""
    import torch.distributed as dist
    ref = weakref.ref(opt)

    def reduce(overflow, sum_squares):
        o = ref()
        if o is None:
            raise errors.FailedPreconditionError("the optimizer is gone")
        t = torch.tensor([1.0 if overflow else 0.0, sum_squares], dtype=torch.float64,
                         device=o._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=o._pg)
        o.comm_bytes += t.numel() * t.element_size()
        overflow, sum_squares = t.tolist()
        return overflow > 0, sum_squares
    return reduce


def _gloo_wire(dtype):
    """The dtype parameters of `dtype` cross gloo in: it has no bfloat16, so bf16 goes as
    fp32 (the values are exact)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


class _Shards:
    def update(self, k):
        """Group k's update, into the store (Note [optimizer overlap]: loads read it)."""
        self.opt._core.update_group(k)


class HostShards(_Shards):
    """A rank's shards through host memory (parameters on the CPU)."""

    def __init__(self, opt):
        self.opt = opt
        self.device = torch.device("cpu")
        self.wire = _gloo_wire(opt._dtype)

    def gradient(self, k, shard):
        self.opt._core.set_gradient(k, shard.data_ptr(), shard.numel(),
                                    dtype_name(shard.dtype, "a gradient"))

    def finish(self):
        pass

    def stats(self):
        return {}

    def parameters(self, k, out):
        """Group k's newest parameters into `out`."""
        opt = self.opt
        mine = out if out.dtype == opt._dtype else torch.empty(out.numel(), dtype=opt._dtype)
        opt._core.load_parameters(k, mine.data_ptr(), mine.numel(), opt._dt)
        if mine is not out:
            out.copy_(mine)

    def close(self):
        pass


class DeviceShards(_Shards):
    """A rank's shards through the device paths (memascend/device_training.h): gradients
    out by DeviceGradients, parameters back by DeviceParameters.copy_to."""

    def __init__(self, opt, grads, params, device, grad_stream=None, own=False):
        self.opt, self.grads, self.params, self.device = opt, grads, params, device
        self.grad_stream, self.own = grad_stream, own
        self.wire = opt._dtype if opt._nccl else _gloo_wire(opt._dtype)
        self._held = []  # emulated: the host memory of the gradients sent, until finish()

    def _stream(self):
        if self.device.type != "cuda":
            return 0
        from memascend.torch.cuda import stream_handle
        return stream_handle(self.device)

    def gradient(self, k, shard):
        g = shard.to(self.opt._dtype).contiguous()  # the layout's gradient dtype
        self.grads.offload(k, g.data_ptr(), g.numel(), dtype_name(g.dtype, "a gradient"),
                           self._stream())
        if self.grad_stream is not None:
            g.record_stream(self.grad_stream)  # read by the copy stream: not reused before
        else:
            self._held.append(g)

    def finish(self):
        self.grads.finish()
        self._held.clear()

    def stats(self):
        return {"device_parameters": self.params.stats(), "device_gradients": self.grads.stats()}

    def parameters(self, k, out):
        opt = self.opt
        mine = out if out.dtype == opt._dtype else torch.empty(out.numel(), dtype=opt._dtype,
                                                               device=out.device)
        self.params.copy_to(k, mine.data_ptr(), self._stream())
        if mine is not out:
            out.copy_(mine)

    def close(self):
        if self.own:
            for obj in (self.params, self.grads):
                obj.close()


def shard_io(opt):
    if opt._cuda is not None:
        c = opt._cuda
        return DeviceShards(opt, c.grads, c.params, c.device, grad_stream=c.grad_stream)
    if EMULATE_DEVICE:
        return DeviceShards(opt, _core.DeviceGradients(opt._core, emulate=True),
                            _core.DeviceParameters(opt._core, device_budget=0, emulate=True),
                            torch.device("cpu"), own=True)
    return HostShards(opt)


def ranks_where(opt, flag):
    """The ranks for which `flag` holds (a collective: every rank passes its own)."""
    return [r for r, (v,) in enumerate(_every(opt, [1 if flag else 0])) if v]


def agree(opt, ok, what, after=""):
    """Whether every rank did what it set out to (a collective): a rank that did not stops
    with its own error; the others raise FailedPreconditionError naming it (`what` it
    failed to do), rather than wait for it in the next collective."""
    failed = ranks_where(opt, not ok)
    if ok and failed:
        raise errors.FailedPreconditionError(
            f"rank(s) {failed} {what} (their errors say why); every rank stops{after}")


def agree_on_step(opt, failure, what, after=""):
    """A step's agreement (a collective): where any rank's `failure` (this rank's error, or
    None) stopped it, every rank raises (this rank its own error, the others one naming it)
    and every later step() refuses at once on every rank."""
    try:
        agree(opt, failure is None, what, after)
    except errors.Error as e:
        opt._grads.fail(str(e))
        raise
    if failure is not None:
        opt._grads.fail(f"this rank failed a step ({failure})")
        raise failure


def agree_opened(opt, opened):
    agree(opt, opened, "could not open their state")


def broadcast_parameters(opt):
    """Rank 0's parameters into every rank's (a fresh start: each rank's master weights
    come from its shard of them, as DDP starts every replica from rank 0's)."""
    import torch.distributed as dist
    src = 0
    if opt._pg is not None:
        find = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        src = find(opt._pg, 0)
    for p in opt._params:
        t = p.data
        wire = t
        if not t.is_contiguous() or (not opt._nccl and t.dtype == torch.bfloat16):
            wire = t.to(torch.float32 if t.dtype == torch.bfloat16 else t.dtype).contiguous()
        dist.broadcast(wire, src=src, group=opt._pg)
        opt.comm_bytes += wire.numel() * wire.element_size() if opt._rank == 0 else 0
        if wire is not t:
            t.copy_(wire)


def agree_on_resume(opt, record):
    """The step every rank's volume holds (memascend Note [previous commit]): a rank
    killed between its commit and the others' leaves them a step apart; the ranks ahead
    go back one."""
    steps = [v for v, in _every(opt, [-1 if record is None else int(record["step"])])]
    common = min(steps)
    if common < 0 and max(steps) >= 0:  # decided alike on every rank; nothing written
        raise errors.FailedPreconditionError(
            f"the ranks' volumes hold different steps ({steps}, -1: none): a rank has no "
            "state; start over (overwrite=True)")
    failure = None
    if record is not None and int(record["step"]) > common:
        try:
            record = opt._core.resume(at_most=common)
        except Exception as e:  # noqa: BLE001 - agreed below, then raised
            failure = e
    if ranks_where(opt, failure is not None):
        raise errors.FailedPreconditionError(
            f"the ranks' volumes hold different steps ({steps}, -1: none) and not every "
            f"rank can go back to step {common}" + (f": {failure}" if failure
                                                    else " (another rank could not)"))
    return record


def mine(opt, i, whole):
    """This rank's group for parameter i and its slice of `whole` (any shape; all of it in
    one process): (None, None) where the rank owns none of it."""
    k, begin, end = opt._shards[i]
    if k is None:
        return None, None
    return k, whole.reshape(-1)[begin:end].contiguous()


def refuse_offloaded(opt, what):
    if any(offloaded(p) for p in opt._params):
        raise errors.UnimplementedError(
            f"{what}() under torch.distributed with offload_parameters: a rank holds only its "
            "shard of the parameters")


def gather(opt, i, mine, dtype=None):
    """Parameter i's shards from every rank, whole (flat, on the CPU), in fp32 on the wire;
    in the parameters' dtype unless `dtype` is given."""
    n = opt._numels[i]
    chunk = -(-n // opt._world)
    matrix = torch.zeros(opt._world, chunk, dtype=torch.float32, device=opt._comm_device)
    matrix[opt._rank, :mine.numel()].copy_(mine.reshape(-1))
    _buckets.all_gather(opt, matrix)
    return matrix.view(-1)[:n].to(device="cpu", dtype=opt._dtype if dtype is None else dtype)


def _parameters_in(opt, update):
    """Every parameter, whole, from the ranks' shards: each rank's into its row of a
    bucket, the bucket all-gathered, then into the parameters. With `update` every rank
    first updates its shards and the ranks agree on that, so a failed update (Note [failed
    update]) leaves every rank's parameters as they were. A rank whose read fails goes on
    taking part in every bucket's gather and returns its error; each row carries whether it
    is whole (the matrix's last column), and no rank takes a bucket with a row that is not,
    nor any after it: the parameters hold no rank's unread bytes (those of the buckets
    before such a failure are the new ones, the rest as they were)."""
    io, failure = opt._shard_io, None
    if update:
        for k, _, _ in opt._shards:
            if k is not None and failure is None:
                try:
                    io.update(k)  # into the store; loaded below
                except Exception as e:  # noqa: BLE001 - agreed below
                    failure = e
        agree_on_step(opt, failure, f"failed their update of step {opt._step_number}",
                      "; none committed the step: resume=True goes on from the last step all "
                      "hold")
    # Whether every rank's rows so far were whole, on the gathers' device: the check
    # waits for no gather (the host goes on queuing the next bucket's copies).
    whole = torch.ones((), dtype=torch.bool, device=opt._comm_device)
    for columns, members in opt._grads.buckets:
        matrix = torch.empty(opt._world, columns + 1, dtype=io.wire, device=opt._comm_device)
        row = matrix[opt._rank]
        if failure is None:
            try:
                for i, column, _ in members:
                    k, begin, end = opt._shards[i]
                    if k is not None:
                        io.parameters(k, row[column:column + end - begin])
            except Exception as e:  # noqa: BLE001 - returned, agreed by the caller
                failure = e
        row[columns] = 1 if failure is None else 0
        _buckets.all_gather(opt, matrix)
        whole &= (matrix[:, columns] == 1).all()
        for i, column, chunk in members:
            taken = matrix[:, column:column + chunk].reshape(-1)[:opt._numels[i]]
            p, src = opt._params[i].data, taken.view(opt._shapes[i])
            if src.dtype != p.dtype or src.device != p.device:
                src = src.to(p.device, p.dtype)
            torch.where(whole.to(p.device), src, p, out=p)
        del matrix, row
    return failure


def load_into_parameters(opt):
    """Every parameter, whole, from the ranks' shards (after a resume); a rank's failed
    read is agreed, so that every rank raises rather than one waiting in a collective."""
    failure = _parameters_in(opt, update=False)
    agree_opened(opt, failure is None)
    if failure is not None:
        raise failure


def step_sharded(opt):
    """Note [sharded state]: reduce-scatter (what backward's hooks have not), check, clip,
    update the shard, gather."""
    core = opt._core
    opt._grads.finish()
    opt._apply_group_options()
    # The SDK's overflow check and norm, summed over the ranks (gradient_check): every
    # rank skips and clips alike.
    plan = core.end_backward(1.0)
    opt._step_number += 1
    if plan["skipped"]:
        opt.skipped_steps += 1
    else:
        # A rank's failed update (Note [failed update]: not retried) stops every rank
        # before any commits the step or changes a parameter: resume=True goes on from the
        # last step every rank holds (agree_on_resume).
        failure = _parameters_in(opt, update=True)
        agree_on_step(opt, failure, "failed to load their updated parameters")
    core.commit(opt._step_number, opt._record)
    opt.last_step = {"skipped": plan["skipped"], "grad_norm": plan["grad_norm"],
                     "loss_scale": plan["loss_scale"]}
