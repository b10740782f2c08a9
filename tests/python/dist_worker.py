"""One rank of a data-parallel run of the test GPT with OffloadedAdamW (torch.distributed,
gloo), or the whole batch in one process when WORLD is 1.

    dist_worker.py RANK WORLD INIT_FILE VOLUME STEPS OUT [--resume] [--kill-after N]
                   [--save-state FILE] [--load-state FILE] [--emulate-device]
                   [--bucket-bytes N] [--group] [--dynamic-loss-scale] [--inf-at STEP]
                   [--odd-rank R] [--odd-seed R] [--take ORDER] [--unused I]
                   [--fail-read R] [--fail-update R STEP] [--fail-gradient R STEP]
                   [--fail-load R STEP] [--fail-state-read R] [--fail-state-write R]

Each step's global batch is gpt.batch(step, batch_size=4); rank r trains rows
[r * 4 / WORLD, (r + 1) * 4 / WORLD). Rank 0 writes OUT (torch.save): the global losses
and the final parameters; every rank prints "owned N" (the elements of its shard).
--save-state: after the last step every rank calls opt.state_dict() and rank 0 saves it
with the model's state and the step. --load-state: a fresh run starts from such a file
(the model's and the optimizer's state, at its step) on volumes of its own.
--emulate-device: the shards travel by the SDK's device paths, emulated over host memory
(memascend.torch.distributed.EMULATE_DEVICE), as on a GPU. --bucket-bytes: the gradient
bytes one collective reduces. --group: torch.distributed even at WORLD 1, and its group
passed to the optimizer as process_group (the sharded path at one rank).
--dynamic-loss-scale: the SDK's loss scaler (the loss multiplied by opt.loss_scale).
--inf-at STEP: the last rank's gradient holds an inf at that step (a rank's overflow).
--odd-rank R: rank R builds a model of another size (a user's mistake).
--odd-seed R: rank R builds the model from another seed (rank 0's values are taken).
--take reversed|shuffled: each gradient goes into its bucket after backward, as the
post-accumulate-grad hooks of offload_gradients=True do during it (torch 1.13 has none),
the last parameter first or in an order of each rank's own (seeded by rank and step).
--unused I: the last rank's backward does not reach parameter I (a branch it did not
take): its buckets from there on go at step(). --fail-read R: rank R's reads of its
parameters' shards fail (an I/O error, injected), as on resume. --fail-update R STEP:
rank R's update of its second group's shard fails at step STEP (1-based; injected before
the group is updated, as a failed read of its state would); --fail-gradient R STEP: rank
R's store refuses its second group's gradient shard at step STEP; --fail-load R STEP:
rank R's read of its second group's updated parameters fails at step STEP (each on the
host's or the emulated device's shard path). After a failed step() every rank saves to
OUT.failed.RANK the parameters as they are and the error; rank 0 alone calls step() again
(it must refuse at once, before any collective: else it would wait for rank 1) and saves
that error too; then each raises the first. --fail-state-read R, --fail-state-write R:
rank R's reads of its state for --save-state's state_dict() fail, or its writes for
--load-state's load_state_dict().
Every rank prints "end SKIPPED SCALE CHECKSUM" after its last step.
"""
import argparse
import os
import random
import signal

import torch
import torch.distributed as dist

import gpt
import memascend
import memascend.torch as mt
import memascend.torch.buckets as mtb
import memascend.torch.distributed as mtd

GLOBAL_BATCH = 4


class Failing:
    """The SDK's optimizer with one method failing (as an I/O error would)."""

    def __init__(self, core, method, rank):
        self.core, self.method, self.rank = core, method, rank

    def __getattr__(self, name):
        if name == self.method:
            def fail(kind, k, *args):
                raise memascend.errors.DataLossError(
                    f"injected: rank {self.rank}'s {name} of its {kind} of group {k} fails")
            return fail
        return getattr(self.core, name)


def inject(cls, a):
    """--fail-update, --fail-gradient, --fail-load on this rank: the shard path `cls`'s
    method raises for group 1 at the step named."""
    def failing(name, flag, error):
        real = getattr(cls, name)

        def method(self, k, *args):
            if k == 1 and self.opt._step_number + (name == "gradient") == flag[1]:
                raise error(f"injected: rank {a.rank}'s {name} of group {k} fails")
            return real(self, k, *args)
        setattr(cls, name, method)
    errors = memascend.errors
    for name, flag, error in (("update", a.fail_update, errors.DataLossError),
                              ("gradient", a.fail_gradient, errors.ResourceExhaustedError),
                              ("parameters", a.fail_load, errors.DataLossError)):
        if flag[0] == a.rank:
            failing(name, flag, error)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("init_file")
    ap.add_argument("volume")
    ap.add_argument("steps", type=int)
    ap.add_argument("out")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--save-state", default="")
    ap.add_argument("--load-state", default="")
    ap.add_argument("--emulate-device", action="store_true")
    ap.add_argument("--bucket-bytes", type=int, default=0)
    ap.add_argument("--group", action="store_true")
    ap.add_argument("--dynamic-loss-scale", action="store_true")
    ap.add_argument("--inf-at", type=int, default=-1)
    ap.add_argument("--odd-rank", type=int, default=-1)
    ap.add_argument("--odd-seed", type=int, default=-1)
    ap.add_argument("--take", choices=["", "reversed", "shuffled"], default="")
    ap.add_argument("--unused", type=int, default=-1)
    ap.add_argument("--fail-read", type=int, default=-1)
    ap.add_argument("--fail-update", type=int, nargs=2, default=[-1, -1])
    ap.add_argument("--fail-gradient", type=int, nargs=2, default=[-1, -1])
    ap.add_argument("--fail-load", type=int, nargs=2, default=[-1, -1])
    ap.add_argument("--fail-state-read", type=int, default=-1)
    ap.add_argument("--fail-state-write", type=int, default=-1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mtd.EMULATE_DEVICE = a.emulate_device
    if a.bucket_bytes:
        mtb.BUCKET_BYTES = a.bucket_bytes
    if a.fail_read == a.rank:
        def failing(self, k, out):
            raise memascend.errors.DataLossError(f"injected: rank {a.rank} cannot read {k}")
        mtd.HostShards.parameters = failing
    for cls in (mtd.HostShards, mtd.DeviceShards):  # injected on both shard paths
        inject(cls, a)
    distributed = a.world > 1 or a.group
    if distributed:
        dist.init_process_group("gloo", init_method="file://" + a.init_file, rank=a.rank,
                                world_size=a.world)
    model = gpt.make(seed=1 if a.rank == a.odd_seed else 0,
                     layers=3 if a.rank == a.odd_rank else 2)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = mt.OffloadedAdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, weight_decay=0.01, volume=a.volume, host_budget=1 << 20,
                            part_elements=1 << 18, max_grad_norm=1.0, resume=a.resume,
                            process_group=dist.group.WORLD if a.group else None,
                            dynamic_loss_scale=a.dynamic_loss_scale)
    print("owned", sum(e - b for k, b, e in opt._shards if k is not None), flush=True)
    print("buckets", len(opt._grads.buckets) if opt._sharded else 0, flush=True)
    first = opt.resumed_step or 0
    if a.load_state:
        saved = torch.load(a.load_state)
        model.load_state_dict(saved["model"])
        if a.fail_state_write == a.rank:
            opt._core = Failing(opt._core, "write_state", a.rank)
        opt.load_state_dict(saved["opt"])
        first = saved["step"]
    rows = GLOBAL_BATCH // a.world
    losses = {}
    for step in range(first, a.steps):
        x, y = gpt.batch(step, batch_size=GLOBAL_BATCH)
        x, y = x[a.rank * rows:(a.rank + 1) * rows], y[a.rank * rows:(a.rank + 1) * rows]
        loss = model(x, y)
        (loss * opt.loss_scale if a.dynamic_loss_scale else loss).backward()
        if step == a.inf_at and a.rank == a.world - 1:
            next(model.parameters()).grad.view(-1)[7] = float("inf")
        if a.take:
            order = list(reversed(range(len(opt._params))))
            if a.take == "shuffled":
                random.Random(a.rank * 1000 + step).shuffle(order)
            if a.rank == a.world - 1 and a.unused >= 0:  # backward never reached it here
                order.remove(a.unused)
                opt._params[a.unused].grad = None
            for i in order:
                opt._grads.take_from(i, opt._params[i])  # what the hook does
            assert all(p.grad is None for p in model.parameters())
        try:
            opt.step()
        except Exception as first:
            again = None
            if a.rank == 0:
                try:
                    opt.step()  # a failed optimizer refuses at once, before any collective
                except Exception as e:  # noqa: BLE001 - recorded
                    again = f"{type(e).__name__}: {e}"
            torch.save({"at": step + 1, "error": str(first), "again": again,
                        "params": [p.detach().clone() for p in model.parameters()]},
                       f"{a.out}.failed.{a.rank}")
            raise
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if a.world > 1:
            dist.all_reduce(total)
        losses[step + 1] = total.item() / a.world
        if a.kill_after and step + 1 == a.kill_after and a.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    opt.settle()
    print("end", opt.skipped_steps, opt.loss_scale,
          float(sum(p.double().sum() for p in model.parameters())), flush=True)
    if a.save_state:
        if a.fail_state_read == a.rank:
            opt._core = Failing(opt._core, "read_state", a.rank)
        state = opt.state_dict()  # a collective: every rank
        if a.rank == 0:
            torch.save({"opt": state, "model": model.state_dict(), "step": a.steps},
                       a.save_state)
    if a.rank == 0:
        torch.save({"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                    "comm_bytes": opt.comm_bytes, "stats": opt.stats(),
                    "grad_norm": opt.last_step["grad_norm"]}, a.out)
    opt.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
