"""The gradients of a data-parallel OffloadedAdamW in buckets (memascend/torch/distributed.py).

A bucket is a run of whole parameters, laid out as a (world, columns) matrix whose row r
holds rank r's shards of them side by side (parameter i's chunk of ceil(n / world)
elements at its column). One reduce-scatter per bucket (an all-reduce where the backend has
none: gloo) hands each rank its row, which it sends, a shard per parameter, to its store.

`GradientBuckets` takes the gradients as they come: from the post-accumulate-grad hooks
during the backward pass (``offload_gradients=True``: each gradient is copied into its
bucket and ``p.grad`` freed), or at ``step()`` for those not taken yet. Buckets are reduced
in one fixed order on every rank, the last first (the backward pass's order): a bucket is
launched once its parameters are all in and every bucket after it has been launched, so
the ranks' collectives match whatever order their gradients arrive in. A collective runs
asynchronously; its result is sent to the store when the next bucket is launched, or at
``step()``, so the backward pass keeps computing meanwhile. A parameter backward does not
reach (unused in a step) holds its bucket, and the buckets before it, until ``step()``:
on every rank alike where the ranks reach the same parameters; where they do not, a
collective of the caller's between ``backward()`` and ``step()`` would meet another rank's
bucket (as under DDP without ``find_unused_parameters``), which docs/python.md says.
(Taking the missing ones at the end of backward, as DDP does, needs an engine callback
that reentrant activation checkpointing ends early: a nested backward's end is not the
pass's.)
"""
import weakref

import torch

from memascend import errors

# fp32 gradient bytes (every rank's share together) reduced by one collective; a larger
# parameter is a bucket of its own. A bucket and its gather are the step's transient memory
# (on the CPU, host memory: kept as small as a collective's latency allows).
BUCKET_BYTES = 16 << 20


def plan(opt):
    """[(columns, [(parameter, column, chunk)])]: the parameters in order, in buckets."""
    limit = max(1, BUCKET_BYTES // (4 * opt._world))
    buckets, members, columns = [], [], 0
    for i, n in enumerate(opt._numels):
        chunk = -(-n // opt._world)
        if members and columns + chunk > limit:
            buckets.append((columns, members))
            members, columns = [], 0
        members.append((i, columns, chunk))
        columns += chunk
    if members:
        buckets.append((columns, members))
    return buckets


def place(matrix, column, chunk, flat):
    """A parameter's flat values into its columns of a bucket, chunk by chunk (row r: rank
    r's shard); converted to the bucket's dtype and device by the copy."""
    rows, rest = divmod(flat.numel(), chunk)
    if rows:
        matrix[:rows, column:column + chunk].copy_(flat[:rows * chunk].view(rows, chunk))
    if rest:
        matrix[rows, column:column + rest].copy_(flat[rows * chunk:])


def reduce_scatter(opt, matrix):
    """(work, row): this rank's row of the bucket summed over the ranks, once `work` is
    waited for."""
    import torch.distributed as dist
    opt.comm_bytes += matrix.numel() * matrix.element_size()
    if opt._nccl:
        row = torch.empty(matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
        work = dist.reduce_scatter_tensor(row, matrix.view(-1), op=dist.ReduceOp.SUM,
                                          group=opt._pg, async_op=True)
        return work, row
    work = dist.all_reduce(matrix, op=dist.ReduceOp.SUM, group=opt._pg, async_op=True)
    return work, matrix[opt._rank]  # gloo has no reduce-scatter


def all_gather(opt, matrix):
    """Every rank's row of the bucket from its owner (this rank's is filled)."""
    import torch.distributed as dist
    row = matrix[opt._rank]
    opt.comm_bytes += row.numel() * row.element_size()
    if opt._nccl:
        dist.all_gather_into_tensor(matrix.view(-1), row, group=opt._pg)
    else:
        dist.all_gather(list(matrix.unbind(0)), row.clone(), group=opt._pg)


class GradientBuckets:
    """A step's gradients into the ranks' stores, bucket by bucket (see the module)."""

    def __init__(self, opt):
        self.opt = opt
        self.buckets = plan(opt)
        self.where = {}  # parameter -> (bucket, column, chunk)
        for b, (_, members) in enumerate(self.buckets):
            for i, column, chunk in members:
                self.where[i] = (b, column, chunk)
        self.hooks = []
        self.failed = None  # an agreed failure's message: no further step on any rank
        self._reset()

    def _reset(self):
        self.matrices = {}   # bucket -> its matrix, while gradients come in
        self.placed = {}     # bucket -> CUDA events of the copies into its matrix
        self.taken = set()   # parameters whose gradient is in a bucket this step
        self.missing = [len(members) for _, members in self.buckets]
        self.next = len(self.buckets) - 1  # the next bucket to launch
        self.inflight = []   # (bucket, work, row): launched, not yet sent
        self.begun = False
        self.error = None    # this rank's first local failure of the step (kept, agreed)

    def _local(self, f, *args):
        """f(*args), its failure kept rather than raised: the rank goes on taking part in
        the step's collectives, and finish() agrees on it (no rank waits for one that
        raised)."""
        if self.error is None:
            try:
                f(*args)
            except Exception as e:  # noqa: BLE001 - kept, agreed and raised at finish()
                self.error = e

    @staticmethod
    def require_hooks():
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise errors.UnimplementedError(
                f"offload_gradients needs torch >= 2.1 (post-accumulate-grad hooks); this is "
                f"{torch.__version__}")

    def hook(self):
        """Each gradient into its bucket as soon as backward has accumulated it, and
        ``p.grad`` freed (torch >= 2.1). close() removes the hooks; they hold this object
        weakly (an optimizer dropped without close() takes gradients until the garbage
        collector frees it)."""
        self.require_hooks()
        ref = weakref.ref(self)

        def on_gradient(p, i):
            me = ref()
            if me is not None and me.opt._core is not None:
                me.take_from(i, p)
        for i, p in enumerate(self.opt._params):
            self.hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, i=i: on_gradient(p, i)))

    def take_from(self, i, p):
        """A hook's work: parameter i's gradient into its bucket, ``p.grad`` freed."""
        g = p.grad
        if g is None:
            return
        try:
            self.take(i, self.opt._grad(i, p))
        except errors.FailedPreconditionError:
            raise  # a second gradient: the step's collectives were not entered for it
        except BaseException as e:
            self._stopped(e)  # as finish() does
            raise
        p.grad = None

    def take(self, i, g):
        """Parameter i's gradient (None: zeros) into its bucket; buckets now complete are
        launched."""
        opt = self.opt
        if self.failed is not None:
            return  # every rank alike: step() refuses (an earlier step failed on a rank)
        if i in self.taken:
            raise errors.FailedPreconditionError(
                f"parameter {i} got a second gradient before step(): its first one went to "
                "the ranks' reduction already (offload_gradients). For gradient accumulation "
                "make the optimizer with offload_gradients=False (gradients then go at step())")
        if not self.begun:
            # This rank's last commit durable before the step's collectives: no rank
            # completes step s + 1 before every rank's step s is durable, so after a crash
            # the ranks' volumes are at most a step apart (Note [previous commit]).
            self._local(opt._core.settle)  # the previous commit's error shows here
            self._local(opt._core.begin_backward, 0.0)
            self.begun = True
        b, column, chunk = self.where[i]
        if g is not None:
            matrix = self.matrices.get(b)
            if matrix is None:
                matrix = self.matrices[b] = torch.zeros(
                    opt._world, self.buckets[b][0], dtype=torch.float32,
                    device=opt._comm_device)
            place(matrix, column, chunk, g.reshape(-1))
            if matrix.is_cuda:  # placed on this thread's stream; launched maybe on another's
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(matrix.device))
                self.placed.setdefault(b, []).append(event)
        self.taken.add(i)
        self.missing[b] -= 1
        while self.next >= 0 and self.missing[self.next] == 0:
            self._launch(self.next)
            self.next -= 1

    def _launch(self, b):
        opt = self.opt
        matrix = self.matrices.pop(b, None)
        if matrix is None:  # no gradient in it on this rank: zeros, as DDP reduces them
            matrix = torch.zeros(opt._world, self.buckets[b][0], dtype=torch.float32,
                                 device=opt._comm_device)
        for event in self.placed.pop(b, []):
            torch.cuda.current_stream(matrix.device).wait_event(event)
        work, row = reduce_scatter(opt, matrix)
        del matrix  # the collective holds it (torch records its use on NCCL's stream)
        while self.inflight:  # the earlier buckets' results out, this one's in flight
            self._send(*self.inflight.pop(0))
        self.inflight.append((b, work, row))

    def _send(self, b, work, row):
        work.wait()  # on a GPU: torch's stream waits for the collective, the host does not
        if row.is_cuda:  # allocated on the launching thread's stream, used on this one's
            row.record_stream(torch.cuda.current_stream(row.device))
        row.div_(self.opt._world)
        for i, column, _ in self.buckets[b][1]:
            k, begin, end = self.opt._shards[i]
            if k is not None:
                self._local(self.opt._shard_io.gradient, k, row[column:column + end - begin])

    def finish(self):
        """At step(): the gradients not taken yet (the last parameter first, so that each
        bucket is launched as soon as it is complete), every result sent, every copy
        done; a rank's failure on the way (its store's, its last commit's) is agreed:
        every rank raises, the others naming it."""
        from memascend.torch import distributed as _dist
        opt = self.opt
        if self.failed is not None:
            raise errors.FailedPreconditionError(self.failed)
        try:
            for i in reversed(range(len(opt._params))):
                if i not in self.taken:
                    p = opt._params[i]
                    self.take(i, None if p.grad is None else opt._grad(i, p))
            while self.inflight:
                self._send(*self.inflight.pop(0))
        except BaseException as e:
            try:  # the copies queued are waited for; the first error is the one raised
                opt._shard_io.finish()
            except errors.Error:
                pass
            self._reset()
            self._stopped(e)
            raise
        try:  # always: the copies queued are waited for and the blocks let go
            opt._shard_io.finish()
        except Exception as e:  # noqa: BLE001 - agreed below, as the others
            self.error = self.error or e
        error = self.error
        self._reset()
        _dist.agree_on_step(opt, error, "failed to take this step's gradients")

    def _stopped(self, e):
        """An error no rank agreed on (an error of torch's, e.g. out of memory, or an
        interrupt) inside the step's collectives: the other ranks may wait in them until
        their timeout, and this rank's next collective would not be theirs, so no later
        step() here enters one."""
        self.fail(f"this rank stopped in a step's gradient reduction ({type(e).__name__}: {e})")

    def fail(self, why):
        """An agreed failure: every later step() refuses on every rank, before any
        collective, with `why` (the state goes on from its volume: resume=True)."""
        self.failed = f"{why}; no further step here: reopen with resume=True"

    def close(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
