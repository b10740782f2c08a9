"""OffloadedAdamW under torch.distributed: Note [sharded state] (optimizer.py). Each rank
owns a contiguous 1/N of every parameter's elements; gradients are averaged with
all_reduce, each rank updates its shard, and the new parameters are all-gathered."""
import torch

from memascend import errors


def process_group(group):
    """(group, world size, rank) of torch.distributed when it is initialised, else one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise errors.FailedPreconditionError(
                "a process_group without torch.distributed initialised")
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def agree_on_resume(opt, record):
    """The step every rank's volume holds (memascend Note [previous commit]): a rank
    killed between its commit and the others' leaves them a step apart; the ranks ahead
    go back one."""
    import torch.distributed as dist
    mine = torch.tensor([-1 if record is None else int(record["step"])], dtype=torch.int64)
    steps = [torch.zeros_like(mine) for _ in range(opt._world)]
    dist.all_gather(steps, mine, group=opt._pg)
    steps = [int(t) for t in steps]
    common = min(steps)
    failure = None
    if record is not None and int(record["step"]) > common:
        try:
            record = None if common < 0 else opt._core.resume(at_most=common)
        except errors.Error as e:
            failure = e
    ok = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
    dist.all_reduce(ok, group=opt._pg)
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


def gather(opt, i, mine, dtype=None):
    """Parameter i's shards from every rank, whole (flat), in fp32 on the wire; in the
    parameters' dtype unless `dtype` is given."""
    import torch.distributed as dist
    n = opt._numels[i]
    chunk = -(-n // opt._world)
    padded = torch.zeros(chunk, dtype=torch.float32)
    padded[:mine.numel()] = mine.float()
    parts = [torch.empty(chunk, dtype=torch.float32) for _ in range(opt._world)]
    dist.all_gather(parts, padded, group=opt._pg)
    opt.comm_bytes += 4 * chunk
    return torch.cat(parts)[:n].to(opt._dtype if dtype is None else dtype)


def load_into_parameters(opt):
    """Every parameter, whole, from the ranks' shards (after a resume)."""
    for i, p in enumerate(opt._params):
        k, begin, end = opt._shards[i]
        mine = torch.empty(end - begin, dtype=opt._dtype)
        if k is not None:
            opt._core.load_parameters(k, mine.data_ptr(), mine.numel(), opt._dt)
        p.data.copy_(gather(opt, i, mine).view(opt._shapes[i]))


def step_sharded(opt):
    """Note [sharded state]: average, check, clip, update the shard, gather."""
    import torch.distributed as dist
    core = opt._core
    # This rank's last commit durable before the collectives: no rank completes step
    # s + 1 before every rank's step s is durable, so after a crash the ranks' volumes
    # are at most a step apart and the ranks ahead can go back (Note [previous commit]).
    core.settle()
    grads, finite, sum_sq = [], True, 0.0
    for i, p in enumerate(opt._params):
        g = opt._grad(i, p)
        if g is p.grad and g.dtype == torch.float32 and g.device.type == "cpu" and \
                g.is_contiguous():
            g = g.view(-1)  # averaged in place, as DDP leaves param.grad: no copy
        else:
            g = g.to("cpu").contiguous().reshape(-1).to(torch.float32).clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=opt._pg)
        opt.comm_bytes += 4 * g.numel()
        g.div_(opt._world)
        finite = finite and bool(torch.isfinite(g).all())
        if finite and opt._max_grad_norm > 0:
            sum_sq += float(g.double().pow(2).sum())
        grads.append(g)
    # Every rank holds the same averaged gradients, so every rank decides alike.
    if not finite:
        opt.skipped_steps += 1
        opt.last_step = {"skipped": True, "grad_norm": 0.0, "loss_scale": 1.0}
        opt._step_count += 1
        core.commit(opt._step_count)
        return
    norm = sum_sq ** 0.5
    if opt._max_grad_norm > 0:
        coef = min(1.0, opt._max_grad_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    core.begin_backward(0.0)
    for i, g in enumerate(grads):
        k, begin, end = opt._shards[i]
        if k is not None:
            part = g[begin:end]
            core.set_gradient(k, part.data_ptr(), part.numel(), "float32")
    opt._apply_group_options()
    plan = core.end_backward(1.0)
    for i, p in enumerate(opt._params):
        k, begin, end = opt._shards[i]
        mine = torch.empty(end - begin, dtype=opt._dtype)
        if k is not None:
            core.update_group(k, mine.data_ptr(), mine.numel(), opt._dt)
        whole = gather(opt, i, mine)
        p.data.copy_(whole.view(opt._shapes[i]))
    opt._step_count += 1
    core.commit(opt._step_count)
    opt.last_step = {"skipped": plan["skipped"], "grad_norm": norm if opt._max_grad_norm > 0
                     else None, "loss_scale": 1.0}
