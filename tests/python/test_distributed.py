"""OffloadedAdamW under torch.distributed (gloo, 2 processes on the CPU): each rank
offloads only its shard of the state to its own volume, and training gives the losses and
parameters of one process over the same global batches."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="this PyTorch has no gloo backend")


def launch(tmp_path, world, steps, volume, out, extra=()):
    init = tmp_path / f"init.{world}.{len(list(tmp_path.iterdir()))}"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "dist_worker.py"), str(r),
                               str(world), str(init), volume, str(steps), str(out), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    return results


def test_two_ranks_train_as_one_process_each_holding_half_the_state(tmp_path):
    one = launch(tmp_path, 1, 8, str(tmp_path / "one.vol"), tmp_path / "one.pt")
    assert one[0][2] == 0, one[0][1]
    two = launch(tmp_path, 2, 8, str(tmp_path / "two.{rank}.vol"), tmp_path / "two.pt")
    for out, err, rc in two:
        assert rc == 0, err
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert sorted(a["losses"]) == sorted(b["losses"]) == list(range(1, 9))
    for s in a["losses"]:
        assert b["losses"][s] == pytest.approx(a["losses"][s], rel=1e-5), s
    # Not bit for bit: the ranks' gradients are summed by gloo and halved, one process
    # sums the batch in its own order. Adam divides by the gradient's scale, so an element
    # whose gradient is rounding noise moves by up to lr a step either way: such elements
    # are bounded by lr x steps, and they are a handful.
    diff = torch.cat([(p - q).abs().reshape(-1) for p, q in zip(a["params"], b["params"])])
    assert diff.max().item() <= 1e-3 * 8
    assert (diff > 1e-6).float().mean().item() < 1e-3
    # Each rank owns about half of every parameter's elements, on a volume of its own.
    owned = [int(out.split()[1]) for out, _, _ in two]
    total = int(one[0][0].split()[1])
    assert sum(owned) == total and max(owned) - min(owned) <= 64
    assert os.path.exists(tmp_path / "two.0.vol") and os.path.exists(tmp_path / "two.1.vol")
    assert b["comm_bytes"] > 0


def test_a_resumed_pair_continues_and_ranks_that_disagree_are_refused(tmp_path):
    vol = str(tmp_path / "r.{rank}.vol")
    first = launch(tmp_path, 2, 4, vol, tmp_path / "first.pt")
    assert all(rc == 0 for _, _, rc in first), first
    shutil.copy(tmp_path / "r.1.vol", tmp_path / "r.1.at4")
    again = launch(tmp_path, 2, 8, vol, tmp_path / "again.pt", ["--resume"])
    assert all(rc == 0 for _, _, rc in again), again
    whole = launch(tmp_path, 2, 8, str(tmp_path / "w.{rank}.vol"), tmp_path / "whole.pt")
    assert all(rc == 0 for _, _, rc in whole), whole
    a, b = torch.load(tmp_path / "again.pt"), torch.load(tmp_path / "whole.pt")
    assert sorted(a["losses"]) == [5, 6, 7, 8]
    for s in a["losses"]:
        assert a["losses"][s] == b["losses"][s], s
    # A rank whose reads fail on resume: it raises its error and the other rank one naming
    # it, neither waits for the other in a collective.
    failed = launch(tmp_path, 2, 8, vol, tmp_path / "failed.pt", ["--resume", "--fail-read", "1"])
    assert all(rc != 0 for _, _, rc in failed), failed
    assert "injected: rank 1 cannot read" in failed[1][1]
    assert "rank(s) [1] could not open their state" in failed[0][1]
    # Rank 1's volume a step behind rank 0's (as a rank killed between its commit and the
    # others' leaves them): rank 0 goes back to step 7, which its volume keeps whole, and
    # the pair goes on with the losses of the uninterrupted one.
    first = launch(tmp_path, 2, 7, str(tmp_path / "k.{rank}.vol"), tmp_path / "k7.pt")
    assert all(rc == 0 for _, _, rc in first), first
    shutil.copy(tmp_path / "k.1.vol", tmp_path / "k.1.at7")
    ahead = launch(tmp_path, 2, 8, str(tmp_path / "k.{rank}.vol"), tmp_path / "k8.pt", ["--resume"])
    assert all(rc == 0 for _, _, rc in ahead), ahead
    os.replace(tmp_path / "k.1.at7", tmp_path / "k.1.vol")
    back = launch(tmp_path, 2, 8, str(tmp_path / "k.{rank}.vol"), tmp_path / "back.pt",
                  ["--resume"])
    assert all(rc == 0 for _, _, rc in back), back
    c = torch.load(tmp_path / "back.pt")
    assert sorted(c["losses"]) == [8]
    assert c["losses"][8] == b["losses"][8]
    # Two steps apart (step 4 against step 8) cannot happen by a crash: refused on every
    # rank with the steps named, and neither volume is written.
    os.replace(tmp_path / "r.1.at4", tmp_path / "r.1.vol")
    before = [(tmp_path / f"r.{r}.vol").read_bytes() for r in range(2)]
    bad = launch(tmp_path, 2, 9, vol, tmp_path / "bad.pt", ["--resume"])
    assert all(rc != 0 for _, _, rc in bad)
    assert all("hold different steps ([8, 4]" in err for _, err, _ in bad), bad
    assert [(tmp_path / f"r.{r}.vol").read_bytes() for r in range(2)] == before


@pytest.mark.parametrize("phase", ["update", "gradient", "load", "gradient-device"])
def test_one_ranks_failed_step_stops_every_rank_and_resume_goes_on(tmp_path, phase):
    """Rank 1's step 3 fails (injected: its update before its second group, its store
    refusing a gradient shard, or its read of an updated shard; on the host's shard path
    or the emulated device's): both ranks raise, rank 0 naming rank 1, neither waits in a
    collective, and a later step() refuses at once on rank 0 alone. No rank's parameters
    hold unread bytes: they are step 2's, or after a failed load step 3's up to the
    bucket that failed and step 2's after it. The pair resumed goes on from step 2, the
    last both hold, as the uninterrupted pair."""
    vol = str(tmp_path / "f.{rank}.vol")
    out = tmp_path / "failed.pt"
    kind, _, device = phase.partition("-")
    extra = ["--bucket-bytes", "4096"] + (["--emulate-device"] if device else [])
    failed = launch(tmp_path, 2, 6, vol, out, [f"--fail-{kind}", "1", "3"] + extra)
    assert all(rc != 0 for _, _, rc in failed), failed
    what = {"update": "update of step 3", "gradient": "take this step's gradients",
            "load": "load their updated parameters"}[kind]
    assert f"injected: rank 1's {'parameters' if kind == 'load' else kind}" in failed[1][1]
    assert "rank(s) [1] failed" in failed[0][1] and what in failed[0][1], failed[0][1]
    at = [torch.load(f"{out}.failed.{r}") for r in range(2)]
    assert at[0]["at"] == 3 and "resume=True" in at[0]["again"]
    runs = {n: launch(tmp_path, 2, n, str(tmp_path / f"s{n}.{{rank}}.vol"),
                      tmp_path / f"s{n}.pt", extra) for n in (2, 3)}
    assert all(rc == 0 for r in runs.values() for _, _, rc in r), runs
    step2, step3 = (torch.load(tmp_path / f"s{n}.pt")["params"] for n in (2, 3))
    for rank in range(2):
        new = [torch.equal(p, q) for p, q in zip(at[rank]["params"], step3)]
        old = [torch.equal(p, q) for p, q in zip(at[rank]["params"], step2)]
        assert all(a or b for a, b in zip(new, old)), rank  # no unread bytes anywhere
        if kind == "load":  # the buckets before the failed read were taken
            assert any(new) and not all(new), rank
        else:
            assert all(old), rank
    resumed = launch(tmp_path, 2, 6, vol, tmp_path / "resumed.pt", ["--resume"] + extra)
    assert all(rc == 0 for _, _, rc in resumed), resumed
    whole = launch(tmp_path, 2, 6, str(tmp_path / "w.{rank}.vol"), tmp_path / "whole.pt", extra)
    assert all(rc == 0 for _, _, rc in whole), whole
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "whole.pt")
    assert sorted(a["losses"]) == [3, 4, 5, 6]
    for s in a["losses"]:
        assert a["losses"][s] == b["losses"][s], s
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)


def test_a_ranks_failed_state_read_stops_every_ranks_state_dict(tmp_path):
    """state_dict() is a collective: rank 1's state reads fail, it keeps gathering, and
    every rank raises (rank 0 naming rank 1) rather than one waiting for the other."""
    failed = launch(tmp_path, 2, 2, str(tmp_path / "s.{rank}.vol"), tmp_path / "s.pt",
                    ["--save-state", str(tmp_path / "s.state"), "--fail-state-read", "1"])
    assert all(rc != 0 for _, _, rc in failed), failed
    assert "injected: rank 1's read_state" in failed[1][1]
    assert "rank(s) [1] failed to read their state" in failed[0][1], failed[0][1]
    assert not os.path.exists(tmp_path / "s.state")


def test_state_dict_gathers_the_shards_and_load_state_dict_takes_them_back(tmp_path):
    """state_dict() under torch.distributed is the whole state, as one process's over the
    same batches (to the tolerance of the first test); a pair that loads it, or one
    process's, onto fresh volumes goes on as the uninterrupted runs do."""
    one = launch(tmp_path, 1, 4, str(tmp_path / "one.vol"), tmp_path / "one.pt",
                 ["--save-state", str(tmp_path / "one.state")])
    assert one[0][2] == 0, one[0][1]
    two = launch(tmp_path, 2, 4, str(tmp_path / "two.{rank}.vol"), tmp_path / "two.pt",
                 ["--save-state", str(tmp_path / "two.state")])
    assert all(rc == 0 for _, _, rc in two), two
    a, b = torch.load(tmp_path / "one.state"), torch.load(tmp_path / "two.state")
    assert sorted(a["opt"]["state"]) == sorted(b["opt"]["state"])
    for i, entry in a["opt"]["state"].items():
        other = b["opt"]["state"][i]
        assert float(entry["step"]) == float(other["step"]) == 4.0
        for kind in ("exp_avg", "exp_avg_sq"):
            assert entry[kind].shape == other[kind].shape, (i, kind)
            scale = entry[kind].abs().max().item() + 1e-12
            assert (entry[kind] - other[kind]).abs().max().item() <= 1e-2 * scale, (i, kind)
    # The pair's own state, loaded by a fresh pair: the uninterrupted pair's losses, exactly.
    whole = launch(tmp_path, 2, 8, str(tmp_path / "w.{rank}.vol"), tmp_path / "whole.pt")
    loaded = launch(tmp_path, 2, 8, str(tmp_path / "l.{rank}.vol"), tmp_path / "loaded.pt",
                    ["--load-state", str(tmp_path / "two.state")])
    assert all(rc == 0 for _, _, rc in whole + loaded), loaded
    w, l = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "loaded.pt")
    assert sorted(l["losses"]) == [5, 6, 7, 8]
    for s in l["losses"]:
        assert l["losses"][s] == w["losses"][s], s
    # A rank whose writes of the given state fail: every rank raises before any commits
    # it (rank 0 naming rank 1), none waiting for the other.
    bad = launch(tmp_path, 2, 8, str(tmp_path / "b.{rank}.vol"), tmp_path / "bad.pt",
                 ["--load-state", str(tmp_path / "two.state"), "--fail-state-write", "1"])
    assert all(rc != 0 for _, _, rc in bad), bad
    assert "injected: rank 1's write_state" in bad[1][1]
    assert "rank(s) [1] failed to write the state_dict given" in bad[0][1], bad[0][1]
    # One process's state, split across a pair: each rank keeps its shard.
    split = launch(tmp_path, 2, 8, str(tmp_path / "s.{rank}.vol"), tmp_path / "split.pt",
                   ["--load-state", str(tmp_path / "one.state")])
    assert all(rc == 0 for _, _, rc in split), split
    c = torch.load(tmp_path / "split.pt")
    for s in c["losses"]:
        assert c["losses"][s] == pytest.approx(w["losses"][s], rel=1e-4), s


def test_the_device_paths_carry_the_shards_as_host_memory_does(tmp_path):
    """The path a GPU rank takes (each shard of a gradient out by DeviceGradients, the new
    parameters back by DeviceParameters.copy_to, then all-gathered), run over host memory
    by the SDK's emulation: the pair trains exactly as the pair through host memory, in
    buckets of any size (one parameter per collective, or all of them), and an explicit
    process_group runs the same path at one rank, exactly as one process does."""
    def run(name, world, *extra):
        res = launch(tmp_path, world, 6, str(tmp_path / f"{name}.{{rank}}.vol"),
                     tmp_path / f"{name}.pt", list(extra))
        assert all(rc == 0 for _, _, rc in res), res
        buckets = {int(out.split("buckets ")[1].split()[0]) for out, _, _ in res}
        return torch.load(tmp_path / f"{name}.pt"), buckets

    host, hb = run("host", 2)
    device, db = run("device", 2, "--emulate-device")
    small, sb = run("small", 2, "--emulate-device", "--bucket-bytes", "4096")
    assert hb == db == {1} and len(sb) == 1 and sb.pop() > 10  # 16 MiB holds every parameter
    for other in (device, small):
        assert other["losses"] == host["losses"]
        for p, q in zip(host["params"], other["params"]):
            assert torch.equal(p, q)
    # The device paths carried every shard: gradients out and parameters back, each step.
    grads, params = device["stats"]["device_gradients"], device["stats"]["device_parameters"]
    assert grads["groups"] > 0 and grads["bytes_from_device"] > 0
    assert params["bytes_to_device"] == grads["bytes_from_device"]  # fp32: the same shard
    assert "device_gradients" not in host["stats"]
    assert small["comm_bytes"] > device["comm_bytes"] * 0.99  # the same bytes, more calls
    # A rank whose model came from another seed starts from rank 0's values, as under DDP.
    odd, _ = run("odd", 2, "--odd-seed", "1")
    assert odd["losses"] == host["losses"]
    # Gradients into their buckets as backward's hooks put them (offload_gradients), the
    # last parameter first or in another order on each rank: the collectives still match
    # (each bucket is launched in one order on every rank), with the same results.
    for order in ("reversed", "shuffled"):
        taken, _ = run(f"take-{order}", 2, "--emulate-device", "--bucket-bytes", "4096",
                       "--take", order)
        assert taken["losses"] == host["losses"], order
        for p, q in zip(host["params"], taken["params"]):
            assert torch.equal(p, q)
    # A parameter the last rank's backward never reached (taken as zeros at step(), with
    # the buckets before it; the other rank launched them during backward): the ranks'
    # collectives still pair, and their models stay alike.
    res = launch(tmp_path, 2, 4, str(tmp_path / "unused.{rank}.vol"), tmp_path / "unused.pt",
                 ["--emulate-device", "--bucket-bytes", "4096", "--take", "shuffled",
                  "--unused", "0"])
    assert all(rc == 0 for _, _, rc in res), res
    ends = [out.split("end ")[1].split() for out, _, _ in res]
    assert ends[0] == ends[1]
    # One rank through the sharded path (gloo at world 1, the group passed): one process's
    # run, bit for bit (the same gradients, the same norm, the same updates).
    one, _ = run("one", 1)
    alone, ab = run("alone", 1, "--group", "--emulate-device")
    assert ab == {1}
    assert alone["losses"] == one["losses"] and alone["grad_norm"] == one["grad_norm"]
    for p, q in zip(one["params"], alone["params"]):
        assert torch.equal(p, q)


def test_the_ranks_gradient_check_is_summed_through_the_callable(tmp_path):
    """reduce_gradient_check (memascend Note [global gradient check]) from Python: what it
    returns decides the step (an overflow skips it, the norm clips), and its exception is
    end_backward's error, with its code."""
    from memascend import _core, errors
    import memascend

    def adam(vol, check):
        store = _core.TensorStore(vol, host_budget=8 << 20)
        a = _core.OffloadedAdam(store, [("w", 1024)], "float32", "float32", 1 << 18, [1e-2],
                                [0.0], 0.9, 0.999, 1e-8, 1.0, False, 1.0, 0, 0, 1,
                                reduce_gradient_check=check)
        w = torch.ones(1024)
        a.initialize(0, w.data_ptr(), w.numel(), "float32")
        a.commit(0)
        return store, a

    seen = []
    vol = memascend.Volume.open_or_create(str(tmp_path / "c.vol"), 64 << 20)
    try:
        for answer, skipped, norm in (((False, 4.0 * 1024), False, 64.0),
                                      ((True, 0.0), True, None)):
            store, a = adam(vol, lambda o, s, answer=answer: seen.append((o, s)) or answer)
            g = torch.full((1024,), 0.5)
            a.begin_backward(0.0)
            a.set_gradient(0, g.data_ptr(), g.numel(), "float32")
            plan = a.end_backward(1.0)
            assert seen[-1] == (False, pytest.approx(0.25 * 1024))  # this rank's own
            assert plan["skipped"] is skipped
            if norm is not None:
                assert plan["grad_norm"] == pytest.approx(norm)  # the ranks' sum, not ours
            a.close()
            store.close()

        # Its exception is end_backward's error: a memascend error keeps its code, any other
        # (here one whose code is no StatusCode) is internal, Ctrl-C in a stuck collective
        # is cancelled; a result that is not (overflow, sum_squares) is internal.
        class Reset(OSError):
            code = "ECONNRESET"

        def raising(e):
            def check(o, s):
                raise e
            return check

        g = torch.zeros(1024)
        for check, expected, match in (
                (raising(errors.UnavailableError("rank 3 is gone")), errors.UnavailableError,
                 "rank 3 is gone"),
                (raising(Reset("reset")), errors.InternalError, "reset"),
                (raising(KeyboardInterrupt()), errors.CancelledError, ""),
                (lambda o, s: (o,), errors.InternalError, "not \\(overflow, sum_squares\\)")):
            store, a = adam(vol, check)
            a.begin_backward(0.0)
            a.set_gradient(0, g.data_ptr(), g.numel(), "float32")
            with pytest.raises(expected, match=match):
                a.end_backward(1.0)
            a.close()
            store.close()
    finally:
        vol.close()


def test_one_ranks_overflow_skips_every_ranks_step(tmp_path):
    """The SDK's overflow check is summed across the ranks: an inf in one rank's gradient
    skips the step on every rank (the loss scalers decide alike), and the ranks' models
    stay the same, as one process's would."""
    for extra in ([], ["--dynamic-loss-scale"]):
        res = launch(tmp_path, 2, 6, str(tmp_path / f"o{len(extra)}.{{rank}}.vol"),
                     tmp_path / f"o{len(extra)}.pt", ["--inf-at", "2", *extra])
        assert all(rc == 0 for _, _, rc in res), res
        ends = [out.split("end ")[1].split() for out, _, _ in res]
        assert ends[0] == ends[1], ends  # skipped steps, loss scale, the model's checksum
        assert int(ends[0][0]) == 1
        if extra:
            # DeepSpeed's hysteresis of 2: a first overflow skips and keeps the scale.
            assert float(ends[0][1]) == 65536.0
        losses = torch.load(tmp_path / f"o{len(extra)}.pt")["losses"]
        assert sorted(losses) == list(range(1, 7)) and all(v == v for v in losses.values())


def test_ranks_that_disagree_at_construction_all_refuse(tmp_path):
    """A rank that built another model (here a layer more) would enter collectives of
    other sizes: every rank refuses at construction, naming what each holds, and no
    volume is made."""
    res = launch(tmp_path, 2, 2, str(tmp_path / "m.{rank}.vol"), tmp_path / "m.pt",
                 ["--odd-rank", "1"])
    for _, err, rc in res:
        assert rc != 0
        assert "InvalidArgumentError" in err and "hold different parameters" in err, err
    assert not any(p.name.endswith(".vol") for p in tmp_path.iterdir())
    # One rank's volume holds a state, the other's none (a volume lost, or a rank that got
    # another path): every rank refuses, none waits for the others in a collective, and
    # the state is kept.
    first = launch(tmp_path, 2, 2, str(tmp_path / "h.{rank}.vol"), tmp_path / "h.pt")
    assert all(rc == 0 for _, _, rc in first), first
    os.remove(tmp_path / "h.0.vol")
    kept = (tmp_path / "h.1.vol").read_bytes()
    again = launch(tmp_path, 2, 4, str(tmp_path / "h.{rank}.vol"), tmp_path / "h2.pt")
    assert all(rc != 0 for _, _, rc in again), again
    assert "the volumes of ranks [1] hold this model's training state" in again[0][1]
    assert "holds this model's training state at step 2" in again[1][1]
    assert "resume=True" in again[0][1] and "overwrite=True" in again[1][1]
    assert (tmp_path / "h.1.vol").read_bytes() == kept
    # Asked to resume: refused on every rank too (a rank has no state), nothing written.
    again = launch(tmp_path, 2, 4, str(tmp_path / "h.{rank}.vol"), tmp_path / "h2.pt",
                   ["--resume"])
    assert all(rc != 0 and "a rank has no state" in err for _, err, rc in again), again
    assert (tmp_path / "h.1.vol").read_bytes() == kept
    # A rank that cannot open its volume (here: a directory in its place) stops with its
    # error, and the other rank with one naming it, rather than wait for it.
    os.mkdir(tmp_path / "d.1.vol")
    bad = launch(tmp_path, 2, 2, str(tmp_path / "d.{rank}.vol"), tmp_path / "d.pt")
    assert all(rc != 0 for _, _, rc in bad), bad
    assert "rank(s) [1] could not open their state" in bad[0][1], bad[0][1]


_STOPPED = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import gpt, memascend.torch as mt
from memascend import errors
from memascend.torch import buckets
rank = int(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
model = gpt.make(seed=0)
opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=sys.argv[2] + f".{rank}",
                        host_budget=1 << 20, part_elements=1 << 18)
def out_of_memory(*args):
    raise RuntimeError("CUDA out of memory (simulated)")
for step in range(3):
    if step == 1:
        buckets.place = out_of_memory  # the second step's first gradient into its bucket
    x, y = gpt.batch(step)
    model(x, y).backward()
    try:
        opt.step()
        print("stepped", step)
    except errors.FailedPreconditionError as e:
        print("refused", step, "no further step here" in str(e) and "out of memory" in str(e))
    except RuntimeError as e:
        print("raised", step, e)
    opt.zero_grad(set_to_none=True)
"""


def test_a_rank_stopped_by_an_error_of_torchs_in_its_reduction_takes_no_later_step(tmp_path):
    # An error no rank agreed on (torch's out of memory, an interrupt): the rank's next
    # collective would not be the others', so every later step() refuses before any. Both
    # ranks meet it here (one alone would leave the other in a collective until gloo's
    # timeout, as DDP's ranks wait for one that ran out of memory).
    procs = [subprocess.Popen([sys.executable, "-c", _STOPPED, str(tmp_path / "init"),
                               str(tmp_path / "s.vol"), HERE, str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert out.splitlines() == ["stepped 0", "raised 1 CUDA out of memory (simulated)",
                                    "refused 2 True"], out + err[-2000:]
