"""memascend.torch against torch.optim.AdamW, on the small GPT of gpt.py."""
import gc
import os
import subprocess
import sys

import pytest
import torch

import gpt
import memascend
import memascend.torch as mt
from memascend import errors

HERE = os.path.dirname(__file__)
STEPS = 20


def train(model, opt, steps=STEPS, first=0, activations=None):
    losses = []
    for step in range(first, steps):
        x, y = gpt.batch(step)
        if activations is not None:
            with activations:
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def reference(steps=STEPS, cls=gpt.GPT, **adamw):
    torch.manual_seed(0)  # as gpt.make(seed=0)
    model = cls()
    groups = param_groups(model)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, **adamw)
    return model, train(model, opt, steps)


def param_groups(model):
    """Two groups, as fine-tuning scripts make them: no weight decay for norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}]


def offloaded(tmp_path, model, name="opt.vol", **kw):
    kw.setdefault("host_budget", 1 << 20)  # a third of the state: it is evicted and read back
    kw.setdefault("part_elements", 1 << 18)
    return mt.OffloadedAdamW(param_groups(model), lr=1e-3, weight_decay=0.01,
                             volume=str(tmp_path / name), **kw)


def assert_same(model_a, model_b, tol=1e-5):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.allclose(a.detach(), b.detach(), rtol=tol, atol=tol), name


def test_offloaded_adamw_trains_as_torch_adamw(tmp_path):
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    losses = train(model, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert_same(ref_model, model)
    assert losses[-1] < losses[0]
    stats = opt.stats()
    assert stats["store"]["evictions"] > 0  # the budget is below the state
    t = stats["seconds"]  # where the steps went (memascend Note [step times])
    assert t["update"] > t["update_kernels"] > 0 and t["end_backward"] > 0 and t["commit"] > 0
    opt.close()


def test_a_traced_step_says_where_its_time_went(tmp_path):
    """StepTrace over offload_parameters: the step's update runs group by group in the next
    forward pass, each group before its load, and every module's forward and backward is
    a compute span; outside the traced step nothing is recorded."""
    import time
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    offload = mt.offload_parameters(model, opt)
    train(model, opt, steps=1)
    trace = offload.trace = mt.StepTrace()
    trace.start()
    x, y = gpt.batch(1)
    model(x, y).backward()
    began = time.perf_counter()
    opt.step()
    trace.host("step", "opt.step()", began, time.perf_counter())
    opt.zero_grad(set_to_none=True)
    spans = trace.finish()
    offload.trace = None
    ended = time.perf_counter() - trace._t0
    assert {lane for lane, _, _, _ in spans} == {"update", "load", "compute", "step"}
    assert all(0 <= b <= e <= ended for _, _, b, e in spans)
    updated, loaded = {}, {}
    for lane, name, b, _ in spans:
        if lane == "update" and name != "the rest":
            first, last = map(int, name.split()[1].split("-"))
            for g in range(first, last + 1):
                assert g not in updated
                updated[g] = b
        elif lane == "load":
            loaded.setdefault(int(name.split()[1]), b)
    assert sorted(updated) == list(range(len(updated))) and updated
    assert all(updated[g] <= loaded[g] for g in updated if g in loaded)
    modules = {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    fwd = {n.split(" ", 1)[1] for lane, n, _, _ in spans if n.startswith("fwd ")}
    bwd = {n.split(" ", 1)[1] for lane, n, _, _ in spans if n.startswith("bwd ")}
    assert fwd == modules and bwd == fwd  # the embeddings too (their inputs need no grad)
    train(model, opt, steps=3, first=2)
    assert len(trace.spans) == len(spans)  # nothing more recorded
    offload.remove()
    opt.close()


def test_with_parameters_and_activations_offloaded_too(tmp_path):
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    offload = mt.offload_parameters(model, opt, window=2)
    # Between uses a parameter holds nothing.
    assert model.blocks[0].fc.weight.numel() == 0
    vol = memascend.Volume.open_or_create(str(tmp_path / "act.vol"), size=256 << 20)
    store = memascend.TensorStore(vol, host_budget=1 << 20)
    acts = mt.offload_activations(store, min_bytes=4096)
    losses = train(model, opt, activations=acts)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert acts.saved_bytes > 0 and acts.peak_bytes > 1 << 20  # beyond the budget: spilled
    assert store.stats()["evictions"] > 0
    assert offload.fetches > 0
    offload.remove()
    assert_same(ref_model, model)
    opt.close()
    del acts
    store.close()
    vol.close()


def test_gradients_accumulate_over_micro_batches_under_offload_parameters(tmp_path):
    """Gradient accumulation with the parameters offloaded: p.grad adds up over the
    micro-batches while p.data is released between uses, and step() takes the sum, as
    torch.optim.AdamW does (bench/gpu's --accum runs this way, offload_gradients=False)."""
    ref_model = gpt.make(seed=0)
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-3, weight_decay=0.01)
    ref_losses = gpt.train_accumulating(ref_model, ref_opt)
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, offload_gradients=False)
    offload = mt.offload_parameters(model, opt)
    losses = gpt.train_accumulating(model, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert losses[-1] < losses[0]
    # An evaluation under inference mode, then training again (Note [device views]: the
    # empty tensor released parameters share is never an inference tensor).
    x, y = gpt.batch(0)
    mt.parameters._EMPTY.clear()  # so the evaluation's releases make it anew
    with torch.inference_mode():
        evaluated = [float(m(x, y)) for m in (ref_model, model)]
    assert evaluated[1] == pytest.approx(evaluated[0], rel=1e-5, abs=1e-5)
    assert not any(p.is_inference() for p in model.parameters())
    more = gpt.train_accumulating(model, opt, steps=2)
    assert more == pytest.approx(gpt.train_accumulating(ref_model, ref_opt, steps=2),
                                 rel=1e-5, abs=1e-5)
    offload.remove()
    assert_same(ref_model, model)
    opt.close()


def test_state_dict_moves_between_torch_adamw_and_offloaded(tmp_path):
    # 10 steps with torch, its state into OffloadedAdamW, 10 more: as 20 with torch.
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    torch_opt = torch.optim.AdamW(param_groups(model), lr=1e-3, weight_decay=0.01)
    first = train(model, torch_opt, steps=10)
    opt = offloaded(tmp_path, model)
    opt.load_state_dict(torch_opt.state_dict())
    rest = train(model, opt, steps=STEPS, first=10)
    assert first + rest == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    # and back: the offloaded state into torch.optim.AdamW
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].shape == next(model.parameters()).shape
    assert float(sd["state"][0]["step"]) == STEPS
    back = torch.optim.AdamW(param_groups(model), lr=1e-3, weight_decay=0.01)
    back.load_state_dict(sd)
    ordered = [p for g in param_groups(model) for p in g["params"]]
    for i, p in enumerate(ordered):
        assert torch.equal(back.state[p]["exp_avg"], sd["state"][i]["exp_avg"])
        assert torch.equal(back.state[p]["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])
    opt.close()


def test_a_grad_scaler_drives_the_scale_and_sees_overflows(tmp_path):
    # torch 1.x's GradScaler protocol: step(grad_scaler=...) with the scale the loss was
    # multiplied by; the optimizer tells it whether the fused check found inf/NaN.
    class Scaler:
        def __init__(self, scale):
            self.scale = torch.tensor(scale)
            self._per_optimizer_states = {}

        def _get_scale_async(self):
            return self.scale

    ref_model, ref_losses = reference(steps=3)
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    scaler = Scaler(1024.0)
    for step in range(3):
        scaler._per_optimizer_states[id(opt)] = {"found_inf_per_device": {}}
        x, y = gpt.batch(step)
        (model(x, y) * 1024.0).backward()
        opt.step(grad_scaler=scaler)
        found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        assert [float(v) for v in found.values()] == [0.0]
        opt.zero_grad(set_to_none=True)
    assert_same(ref_model, model, tol=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = gpt.batch(3)
    model(x, y).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler._per_optimizer_states[id(opt)] = {"found_inf_per_device": {}}
    opt.step(grad_scaler=scaler)
    assert opt.last_step["skipped"] and opt.skipped_steps == 1
    assert [float(v) for v in
            scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()] == [1.0]
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b.detach())
    opt.close()


def test_a_torch1_grad_scaler_after_unscale_is_not_unscaled_again(tmp_path):
    # scaler.unscale_(opt) before step(), to clip, as torch's AMP recipe does: the gradients
    # are unscaled already (stage UNSCALED), and its inf check stands. They were divided by
    # the scale a second time.
    import enum

    class Stage(enum.Enum):
        READY = 0
        UNSCALED = 1

    class Scaler:
        scale = torch.tensor(1024.0)
        _per_optimizer_states = {}

        def _get_scale_async(self):
            return self.scale

        def unscale_(self, opt):  # torch 1.x's, on the CPU
            found = torch.zeros(1)
            for p in opt._params:
                p.grad.mul_(1.0 / float(self.scale))
                found += (~torch.isfinite(p.grad)).any().float()
            self._per_optimizer_states[id(opt)] = {"stage": Stage.UNSCALED,
                                                   "found_inf_per_device": {"cpu": found}}

    ref_model, _ = reference(steps=3)
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    scaler = Scaler()
    for step in range(3):
        x, y = gpt.batch(step)
        (model(x, y) * 1024.0).backward()
        scaler.unscale_(opt)
        opt.step(grad_scaler=scaler)
        opt.zero_grad(set_to_none=True)
    assert_same(ref_model, model, tol=1e-4)
    x, y = gpt.batch(3)
    model(x, y).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(grad_scaler=scaler)
    assert opt.last_step["skipped"]
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    opt.close()


def test_torch2_grad_scaler_attributes_and_the_sdk_scaler(tmp_path):
    # torch 2.x's GradScaler sets optimizer.grad_scale and optimizer.found_inf instead.
    ref_model, _ = reference(steps=2)
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    for step in range(2):
        x, y = gpt.batch(step)
        (model(x, y) * 256.0).backward()
        opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor([0.0])
        opt.step()
        del opt.grad_scale, opt.found_inf
        opt.zero_grad(set_to_none=True)
    assert_same(ref_model, model, tol=1e-5)
    x, y = gpt.batch(2)
    model(x, y).backward()
    opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor([1.0])
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # the scaler saw inf: no step
    del opt.grad_scale, opt.found_inf
    assert opt.last_step["skipped"]
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    opt.close()
    # The SDK's own dynamic scaler: the loss times a power of two, unscaled exactly.
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, name="dyn.vol", dynamic_loss_scale=True,
                    initial_scale=1024.0)
    assert opt.loss_scale == 1024.0
    for step in range(2):
        x, y = gpt.batch(step)
        opt.scale_loss(model(x, y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_same(ref_model, model, tol=1e-5)
    opt.close()


def test_bad_input_gets_a_clear_exception(tmp_path):
    model = gpt.make(seed=0)
    # a budget below one part
    with pytest.raises(errors.InvalidArgumentError, match="below the least"):
        offloaded(tmp_path, model, name="a.vol", host_budget=64 << 10)
    assert not (tmp_path / "a.vol").exists()  # refused before the volume was made
    # the volume is left usable: the same path works with a sound budget
    opt = offloaded(tmp_path, model, name="a.vol")
    # a parameter added after construction
    with pytest.raises(errors.FailedPreconditionError, match="after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(errors.FailedPreconditionError, match="changed after construction"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    # a sparse gradient
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    p0 = next(model.parameters())
    p0.grad = torch.zeros_like(p0).to_sparse()
    with pytest.raises(errors.InvalidArgumentError, match="sparse"):
        opt.step()
    opt.close()
    # a volume holding this model's state is not started over without a word
    with pytest.raises(errors.FailedPreconditionError, match="resume=True"):
        offloaded(tmp_path, model, name="a.vol")
    # a volume of another model
    other = gpt.make(seed=0, d=32)
    with pytest.raises(errors.Error) as e:
        offloaded(tmp_path, other, name="a.vol", resume=True)
    assert e.value.code in (errors.StatusCode.FAILED_PRECONDITION,
                            errors.StatusCode.INVALID_ARGUMENT)
    # ... which is still there, whole, for the model it belongs to
    opt = offloaded(tmp_path, model, name="a.vol", resume=True)
    assert opt.resumed_step == 0
    opt.close()
    # mixed dtypes and unsupported options
    mixed = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4).half())]
    with pytest.raises(errors.InvalidArgumentError, match="dtypes"):
        mt.OffloadedAdamW(mixed, volume=str(tmp_path / "b.vol"), host_budget=8 << 20)
    with pytest.raises(errors.UnimplementedError):
        mt.OffloadedAdamW(model.parameters(), amsgrad=True, volume=str(tmp_path / "b.vol"),
                          host_budget=8 << 20)


def test_bf16_parameters_keep_fp32_master_weights(tmp_path):
    # bf16 weights and gradients; the update runs on fp32 master weights, as mixed
    # precision training does: the master weights follow fp32 AdamW fed the same
    # gradients, and the parameters are the master weights rounded to bf16.
    model = gpt.make(seed=0).to(torch.bfloat16)
    ref = gpt.make(seed=0).to(torch.bfloat16).float()  # starts from the same values
    opt = offloaded(tmp_path, model)
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-3, weight_decay=0.01)
    for step in range(3):
        x, y = gpt.batch(step)
        model(x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float()  # the same gradients, in fp32
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    state = opt.state_dict()["state"]
    ordered = [p for g in param_groups(model) for p in g["params"]]
    ref_ordered = [p for g in param_groups(ref) for p in g["params"]]
    for i, (p, q) in enumerate(zip(ordered, ref_ordered)):
        master = state[i]["master"]
        assert master.dtype == torch.float32
        assert torch.allclose(master, q.detach(), rtol=1e-5, atol=1e-6), i
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), i
        # 1 - beta2 is formed in fp32 by the fused kernel (as DeepSpeed's CPU Adam) and
        # in double by torch: 1.3e-5 apart relatively, and so are the second moments.
        assert torch.allclose(state[i]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"],
                              rtol=3e-5, atol=1e-12), i
    opt.close()


def test_fp16_parameters_and_a_closure(tmp_path):
    # fp16 parameters with gradients given by hand (PyTorch 1.13's CPU kernels lack fp16
    # layer norms), step(closure) returning the closure's loss.
    torch.manual_seed(3)
    init = torch.randn(1000, 300) * 0.1
    p16 = torch.nn.Parameter(init.half())
    ref = torch.nn.Parameter(init.half().float())
    opt = mt.OffloadedAdamW([p16], lr=1e-2, weight_decay=0.1, volume=str(tmp_path / "h.vol"),
                            host_budget=8 << 20, part_elements=1 << 18)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for step in range(3):
        g = torch.randn(1000, 300, generator=torch.Generator().manual_seed(step)).half()

        def closure():
            p16.grad = g.clone()
            return torch.tensor(float(step))

        assert float(opt.step(closure)) == step
        ref.grad = g.float()
        ref_opt.step()
    master = opt.state_dict()["state"][0]["master"]
    assert torch.allclose(master, ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(p16.detach(), master.half())
    opt.close()


def run_worker(*args):
    env = dict(os.environ)
    # glibc's dynamic mmap threshold keeps freed tensors of a few MiB in the heap, which
    # makes peak RSS wander by tens of MiB from run to run; a fixed threshold (the same
    # for every worker) returns them to the system as PyTorch frees them.
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    r = subprocess.run([sys.executable, os.path.join(HERE, "worker.py"), *args],
                       capture_output=True, text=True, env=env, timeout=600)
    return r


def parse(out):
    losses, rss = {}, None
    for line in out.splitlines():
        f = line.split()
        if f[:1] == ["step"]:
            losses[int(f[1])] = float(f[3])
        elif f[:1] == ["peak_rss_bytes"]:
            rss = int(f[1])
    return losses, rss


def test_a_killed_run_resumes_from_the_volume_with_the_same_losses(tmp_path):
    vol = str(tmp_path / "kill.vol")
    whole = run_worker("offloaded", "12", "--volume", str(tmp_path / "whole.vol"))
    assert whole.returncode == 0, whole.stderr
    want, _ = parse(whole.stdout)
    killed = run_worker("offloaded", "12", "--volume", vol, "--kill-after", "7")
    assert killed.returncode == -9, killed.stderr
    before, _ = parse(killed.stdout)
    assert max(before) == 7
    resumed = run_worker("offloaded", "12", "--volume", vol, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    after, _ = parse(resumed.stdout)
    # the commit of step 7 may or may not have landed before the kill
    assert min(after) in (7, 8)
    for step, loss in {**before, **after}.items():
        assert loss == want[step], step


@pytest.mark.parametrize("depth", [1, 32])
def test_the_write_back_depth_changes_how_a_commit_writes_not_what(tmp_path, depth):
    """write_back_depth (state parts a commit writes at once; bench/commit.py measures it):
    the run is torch.optim.AdamW's at any depth, and a depth out of range is refused."""
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, write_back_depth=depth)
    assert train(model, opt) == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert_same(ref_model, model)
    opt.close()
    for bad in (0, 257, 2.5):
        with pytest.raises(memascend.errors.InvalidArgumentError, match="write_back_depth"):
            offloaded(tmp_path, gpt.make(seed=0), name="bad.vol", write_back_depth=bad)


@pytest.mark.parametrize("threads", [1, 8])
def test_the_io_threads_change_how_the_state_moves_not_what(tmp_path, threads):
    """io_threads (the store's threads reading the state ahead and writing it back, with a
    third of the state in the budget): the run is torch.optim.AdamW's at any count, and a
    count out of range is refused, by the optimizer and by the store."""
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, io_threads=threads)
    assert train(model, opt) == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert_same(ref_model, model)
    assert opt.stats()["io_read_bytes"] > 0  # the state moved through them
    opt.close()
    for bad in (0, 65, 1.5):
        with pytest.raises(memascend.errors.InvalidArgumentError, match="io_threads"):
            offloaded(tmp_path, gpt.make(seed=0), name="bad.vol", io_threads=bad)
    with memascend.Volume.open_or_create(str(tmp_path / "store.vol"), size=16 << 20) as vol:
        with pytest.raises(memascend.errors.InvalidArgumentError, match="prefetch_threads 65"):
            memascend.TensorStore(vol, host_budget=1 << 20, prefetch_threads=65)


def test_commit_every_keeps_every_nth_step_durable(tmp_path):
    # Note [commit interval]: steps 1-3 committed in memory only, step 4 durable, 5-7 in
    # memory again when the kill comes: the resumed run continues from step 4 with the
    # uninterrupted run's losses, and its close makes its last steps durable.
    vol = str(tmp_path / "every.vol")
    whole = run_worker("offloaded", "12", "--volume", str(tmp_path / "whole.vol"))
    assert whole.returncode == 0, whole.stderr
    want, _ = parse(whole.stdout)
    killed = run_worker("offloaded", "12", "--volume", vol, "--kill-after", "7",
                        "--commit-every", "4")
    assert killed.returncode == -9, killed.stderr
    durable = [int(line.split()[1]) for line in killed.stdout.splitlines()
               if line.startswith("durable ")]
    assert durable == [0, 0, 0, 0, 4, 4, 4], durable  # step 4 known durable once settled
    resumed = run_worker("offloaded", "10", "--volume", vol, "--resume", "--commit-every", "4")
    assert resumed.returncode == 0, resumed.stderr
    after, _ = parse(resumed.stdout)
    assert min(after) == 5
    before, _ = parse(killed.stdout)
    for step, loss in {**before, **after}.items():
        assert loss == want[step], step
    again = run_worker("offloaded", "12", "--volume", vol, "--resume", "--commit-every", "4")
    assert again.returncode == 0, again.stderr
    last, _ = parse(again.stdout)
    assert min(last) == 11  # the close made steps 9 and 10 durable
    for step, loss in last.items():
        assert loss == want[step], step


def test_a_step_staged_whole_is_durable_every_step(tmp_path):
    # staging="step" reaches the SDK (max_staged_bytes 0: every step durable, each staged
    # whole and committed once). This state is within the bound, where the two stage alike:
    # the test is of the option's path (the SDK's crash sweep, state_in_place_crash_test's
    # WholeStepStaged, kills a state staged so at writes across its steps). A run killed
    # after step 7 resumes at most one step back (the last commit may be in flight) with
    # the uninterrupted bounded run's losses, bit for bit; a state larger than the bound
    # (256 MiB) gets a new volume a version larger; a value other than the two is refused
    # before anything is made.
    whole = run_worker("offloaded", "10", "--volume", str(tmp_path / "bounded.vol"))
    assert whole.returncode == 0, whole.stderr
    want, _ = parse(whole.stdout)
    vol = str(tmp_path / "step.vol")
    killed = run_worker("offloaded", "10", "--volume", vol, "--kill-after", "7",
                        "--staging", "step")
    assert killed.returncode == -9, killed.stderr
    resumed = run_worker("offloaded", "10", "--volume", vol, "--resume", "--staging", "step")
    assert resumed.returncode == 0, resumed.stderr
    before, _ = parse(killed.stdout)
    after, _ = parse(resumed.stdout)
    assert min(after) in (7, 8), sorted(after)
    for step, loss in {**before, **after}.items():
        assert loss == want[step], step
    with mt.OffloadedAdamW(gpt.make(seed=0).parameters(), volume=str(tmp_path / "s.vol"),
                           staging="step") as opt:
        assert opt.stats()["max_staged_bytes"] == 0  # the SDK stages a step whole
    with mt.OffloadedAdamW(gpt.make(seed=0).parameters(), volume=str(tmp_path / "b.vol")) as opt:
        assert opt.stats()["max_staged_bytes"] == 256 << 20  # batches within the bound
    n = 1 << 28  # 4 GiB of state a version (16 bytes an element)
    sizes = [memascend._core.OffloadedAdam.volume_bytes([("w", n)], "bfloat16", "bfloat16",
                                                        1 << 20, stage_whole_step=step)
             for step in (False, True)]
    assert sizes[1] - sizes[0] >= 16 * n - (512 << 20), sizes
    with pytest.raises(memascend.errors.InvalidArgumentError, match="staging must be"):
        mt.OffloadedAdamW(gpt.make(seed=0).parameters(), volume=str(tmp_path / "x.vol"),
                          staging="whole")
    assert not os.path.exists(tmp_path / "x.vol")


def test_the_offloaded_run_peaks_far_below_adamw_in_rss(tmp_path):
    adamw = run_worker("adamw", "2", "--model", "rss")
    assert adamw.returncode == 0, adamw.stderr
    off = run_worker("offloaded", "2", "--model", "rss", "--volume", str(tmp_path / "r.vol"))
    assert off.returncode == 0, off.stderr
    both = run_worker("offloaded", "2", "--model", "rss", "--volume", str(tmp_path / "p.vol"),
                      "--offload-parameters")
    assert both.returncode == 0, both.stderr
    a_losses, a_rss = parse(adamw.stdout)
    o_losses, o_rss = parse(off.stdout)
    b_losses, b_rss = parse(both.stdout)
    params = sum(p.numel() for p in gpt.make(seed=0, **worker_model("rss")).parameters())
    moments = 8 * params  # AdamW's exp_avg and exp_avg_sq, fp32
    print(f"\nparams {params}: peak RSS adamw {a_rss >> 20} MiB, offloaded {o_rss >> 20} MiB, "
          f"offloaded + parameters {b_rss >> 20} MiB; moments {moments >> 20} MiB")
    assert a_rss - o_rss > 0.6 * moments
    # the parameters too (fp32): all but those in use at once
    assert o_rss - b_rss > 0.25 * 4 * params
    for s in a_losses:
        assert o_losses[s] == pytest.approx(a_losses[s], rel=1e-5)
        assert b_losses[s] == pytest.approx(a_losses[s], rel=1e-5)


def worker_model(name):
    sys.path.insert(0, HERE)
    import worker
    return worker.MODELS[name]


def _index_of(opt, p):
    return next(k for k, q in enumerate(opt._params) if q is p)


def test_units_load_a_block_whole_and_train_as_torch_adamw(tmp_path):
    """offload_parameters(units=Block): each block's parameters, its submodules' included,
    come in and go through one set of hooks; the model trains as with torch.optim.AdamW,
    and its state_dict holds every value."""
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    per_module = mt.offload_parameters(model, opt)
    hooked = len(per_module._modules)
    per_module.remove()
    offload = mt.offload_parameters(model, opt, units=gpt.Block)
    blocks = [m for m in model.modules() if isinstance(m, gpt.Block)]
    assert all(id(b) in offload._params_of for b in blocks)
    assert len(offload._modules) < hooked  # a block's submodules have no hooks of their own
    params_in_blocks = sum(len(list(b.parameters())) for b in blocks)
    assert sum(len(offload._params_of[id(b)]) for b in blocks) == params_in_blocks
    losses = train(model, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    state = model.state_dict()
    for name, p in ref_model.state_dict().items():
        assert torch.allclose(state[name], p, rtol=1e-5, atol=1e-5), name
    assert all(p.numel() == 0 for p in model.parameters())  # released between uses
    with pytest.raises(memascend.errors.InvalidArgumentError, match="units"):
        mt.offload_parameters(gpt.make(seed=0), opt, units="Block")
    offload.remove()
    assert_same(ref_model, model)
    opt.close()


class _SharedNormGPT(gpt.GPT):
    """gpt.GPT whose final norm is also each block's second norm: one module used inside
    every block and by the model itself (module.modules() yields it once, in block 0)."""

    def __init__(self):
        super().__init__()
        for blk in self.blocks:
            blk.ln2 = self.ln


def test_a_module_shared_by_units_and_their_model_is_loaded_for_each_use(tmp_path):
    """A module inside a unit that the model also calls outside any unit gets hooks of its
    own (it used to get none, and its use outside the blocks found its parameters
    released); the model trains as under torch.optim.AdamW."""
    ref_model, ref_losses = reference(4, _SharedNormGPT)
    torch.manual_seed(0)
    model = _SharedNormGPT()
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    offload = mt.offload_parameters(model, opt, units=gpt.Block)
    assert id(model.ln) in offload._params_of
    assert not any(id(m) in offload._params_of for b in model.blocks for m in
                   (b.ln1, b.qkv, b.fc))  # the rest of a block has no hooks of its own
    losses = train(model, opt, steps=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert all(p.numel() == 0 for p in model.parameters())
    offload.remove()
    assert_same(ref_model, model)
    opt.close()


def test_a_root_unit_loads_with_the_forward_pass_begun(tmp_path):
    """The root's own loads (a root that is a unit, or has parameters of its own) come
    after its pre-hook has begun the forward pass: they used to see the direction of the
    last backward, which on a GPU is the direction the SDK reads ahead in."""
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    offload = mt.offload_parameters(model, opt, units=gpt.GPT)
    assert offload._modules == [model]
    seen, fetch = [], offload._fetch

    def spy(p, i):  # grad mode is on in a forward pass, off in the backward's hooks
        seen.append((torch.is_grad_enabled(), offload._backward))
        fetch(p, i)
    offload._fetch = spy
    losses = train(model, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    forward = [b for grad, b in seen if grad]
    assert len(forward) == len(losses) * len(list(model.parameters())) and not any(forward)
    assert all(b for grad, b in seen if not grad)
    offload.remove()
    opt.close()


def test_a_root_load_that_fails_leaves_no_saved_tensor_hooks(tmp_path, monkeypatch):
    """The saved-tensor hooks (activations) are entered after the root's own loads: one
    that raises (here the model's dtype changed under the hooks) leaves autograd outside
    the model as it was, and the model trains once put back."""
    from memascend.torch import activations
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    offload = mt.offload_parameters(model, opt, units=gpt.GPT)
    packed = []
    pack = activations.pack
    monkeypatch.setattr(activations, "pack", lambda t: packed.append(1) or pack(t))
    model.double()
    x, y = gpt.batch(0)
    with pytest.raises(memascend.errors.FailedPreconditionError, match="float64"):
        model(x, y)
    a = torch.ones(3, requires_grad=True)
    (a * a).sum().backward()  # autograd outside the model: nothing of ours packs it
    assert offload._hooks is None and not packed
    model.float()
    losses = train(model, opt, steps=2)
    assert len(losses) == 2 and losses[-1] == losses[-1]
    offload.remove()
    opt.close()


@pytest.mark.parametrize("units", [None, gpt.Block], ids=["modules", "blocks"])
def test_a_stopped_recomputation_lets_go_of_its_loads(tmp_path, units):
    """Note [stopped recomputation]: under checkpointing, every block's parameters are let
    go once the blocks' backward is done, not held to the end of the pass (with a block
    loaded whole, a stopped recomputation used to keep every layer), and the model trains
    as the same checkpointed model under torch.optim.AdamW."""
    ref_model, ref_losses = reference(4, gpt.CheckpointedGPT)
    torch.manual_seed(0)
    model = gpt.CheckpointedGPT()
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    offload = mt.offload_parameters(model, opt, units=units)
    index = {id(p): i for i, p in enumerate(opt._params)}
    in_blocks = {index[id(p)] for b in model.blocks for p in b.parameters()}
    held = []
    model.on_input_grad = lambda: held.append(sorted(i for i in in_blocks
                                                     if offload._count.get(i, 0) > 0))
    losses = train(model, opt, steps=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert held == [[]] * 4, held
    offload.remove()
    opt.close()


def holds_after_backward(tmp_path, make, watched, steps=3):
    """Trains a checkpointed model `make()` under offload_parameters as torch's AdamW
    trains it (checked), recording, after each backward of a module `watched(block)`
    names, how many loads of the parameter it names are held: {id(module): parameter}."""
    ref_model, ref_losses = reference(steps, make)
    torch.manual_seed(0)
    model = make()
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    offload = mt.offload_parameters(model, opt)
    index = {id(p): i for i, p in enumerate(opt._params)}
    watch = {id(m): index[id(p)] for b in model.blocks for m, p in [watched(b)]}
    held = []
    post_backward = offload._post_backward

    def recording(m):
        post_backward(m)
        if id(m) in watch:
            held.append(offload._count.get(watch[id(m)], 0))
    offload._post_backward = recording
    losses = train(model, opt, steps=steps)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert all(c == 0 for c in offload._count.values()), offload._count
    offload.remove()
    opt.close()
    return held, len(model.blocks)


def test_a_recomputation_holds_its_loads_until_each_modules_backward(tmp_path):
    """Note [recomputed parameters]: the recomputation of a checkpointed block saves its
    modules' parameters for their backward, later in the pass; on a GPU those are views of
    device blocks, so each is held from the recomputation until its module's backward is
    done (released after the recomputation, a block could be evicted and refilled with
    another group's bytes first). Checked when the block's last module's backward is done:
    its first module, recomputed before it and not yet through its backward, is held."""
    held, blocks = holds_after_backward(tmp_path, gpt.CheckpointedGPT,
                                        lambda b: (b.out, b.qkv.weight))
    assert held == [1] * (3 * blocks), held


def test_a_module_called_twice_in_a_checkpointed_block_keeps_both_recomputations(tmp_path):
    """Note [stopped recomputation]: a module called twice in a checkpointed block is
    recomputed twice, and its backward runs twice, the later call's first. Each backward
    lets go of one recomputation's loads: after the later call's, the earlier call's
    backward, which reads the parameters its recomputation saved (on a GPU, views of a
    device block), is still to come, and they stay held; after it, none are."""
    held, blocks = holds_after_backward(
        tmp_path, lambda: gpt.CheckpointedGPT(block=gpt.SharedProjectionBlock),
        lambda b: (b.proj, b.proj.weight))
    assert held == [1, 0] * (3 * blocks), held


def test_the_default_device_room_holds_a_layer_and_a_module():
    """On a GPU the default device budget holds, under checkpointing as transformers marks
    it, the largest layer (an element of an nn.ModuleList, whose parameters a checkpointed
    recomputation holds through its backward) beside a module, where that is more than
    the largest module twice; without checkpointing, the largest module twice."""
    from memascend.torch.parameters import default_device_room

    class Opt:  # what default_device_room reads of an OffloadedAdamW
        _dtype = torch.float32

    model = gpt.GPT(vocab=16)  # a small vocabulary: the block's linears are the largest
    Opt._numels = [p.numel() for p in model.parameters()]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    params_of = {id(m): [(p, index[id(p)]) for p in m.parameters(recurse=False)]
                 for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    fc = model.blocks[0].fc.weight.numel() * 4 + 64 * 4 * 4
    assert default_device_room(model, params_of, Opt) == (fc, 0)  # not checkpointed
    model.blocks[1].gradient_checkpointing = True  # as transformers marks what it checkpoints
    largest, layer = default_device_room(model, params_of, Opt)
    assert largest == fc
    assert layer == sum(p.numel() for p in model.blocks[0].parameters()) * 4
    assert layer + largest > 2 * largest  # the layer sets the default
    flat = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    params_of = {id(m): [(p, i)] for i, (m, p) in enumerate(
        (m, m.weight) for m in flat if isinstance(m, torch.nn.Linear))}
    Opt._numels = [64, 32]
    assert default_device_room(flat, params_of, Opt) == (64 * 4, 0)  # no layers


def test_a_backward_pass_that_raised_lets_go_of_its_loads_at_the_next_forward(tmp_path):
    """A backward pass that raises never reaches its end (torch runs no final callback):
    the loads its recomputations held, and the pass's state, are let go when the next
    forward pass begins, which then loads and releases as any; training goes on."""
    torch.manual_seed(0)
    model = gpt.CheckpointedGPT()
    opt = offloaded(tmp_path, model, host_budget=4 << 20)
    offload = mt.offload_parameters(model, opt)
    index = {id(p): i for i, p in enumerate(opt._params)}
    qkv = index[id(model.blocks[0].qkv.weight)]
    post_backward = offload._post_backward

    def failing(m):
        post_backward(m)
        if m is model.blocks[0].out:
            raise RuntimeError("a failure in the backward pass")
    offload._post_backward = failing
    x, y = gpt.batch(0)
    with pytest.raises(RuntimeError, match="a failure in the backward pass"):
        model(x, y).backward()
    assert offload._count.get(qkv, 0) > 0  # recomputed, its backward never came
    offload._post_backward = post_backward
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model(x, y)
    assert all(c == 0 for c in offload._count.values()), offload._count
    assert not offload._callback_queued and not offload._recomputing
    losses = train(model, opt, steps=2)
    assert all(loss == loss for loss in losses)
    assert all(c == 0 for c in offload._count.values()), offload._count
    offload.remove()
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_in_use_are_views_of_the_store(tmp_path, dtype):
    # Note [parameter views]: no tensor of torch's heap per fetch, the same values.
    def run(offload):
        model = gpt.make(seed=0).to(dtype)
        opt = offloaded(tmp_path, model, name=f"{offload}.vol", host_budget=16 << 20)
        views, grads = [], []
        if offload:
            off = mt.offload_parameters(model, opt)
            fc = model.blocks[0].fc
            i = _index_of(opt, fc.weight)
            fc.register_forward_pre_hook(lambda m, inp: views.append(
                (fc.weight.dtype, fc.weight.shape, fc.weight.data_ptr() == off._leases[i].address)))
        for step in range(4):
            x, y = gpt.batch(step)
            loss = model(x, y)
            loss.backward()
            grads.append({n: None if p.grad is None else p.grad.shape
                          for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            views.append(loss.item())
        if offload:
            assert off.heap_fetches == 0 and off.fetches > 0
            assert off._leases == {} and off._leased_bytes() == 0  # nothing held between uses
        opt.close()
        return views, grads

    plain, plain_grads = run(False)
    views, grads = run(True)
    want = (dtype, torch.Size([256, 64]), True)
    assert [v for v in views if isinstance(v, tuple)] == [want] * 4
    assert [v for v in views if not isinstance(v, tuple)] == plain  # bit for bit
    assert grads == plain_grads  # every gradient in p.grad, of the parameter's shape


def test_a_tied_parameter_used_after_its_update_is_not_read_back(tmp_path):
    # Note [optimizer overlap]: the next forward pass updates wte's group first; the head
    # (tied to it) comes last, after the update. Prefetching it then would read the old
    # master weights back from the volume (the update handed their block to the new
    # ones) and keep them resident beside the new: with the whole state in the budget
    # nothing is ever read (issue 43: 96 MiB more on the 100m benchmark).
    model = gpt.make(seed=0)
    assert model.head.weight is model.wte.weight
    opt = offloaded(tmp_path, model, host_budget=1 << 30)  # capped at the whole state
    off = mt.offload_parameters(model, opt)
    losses = train(model, opt, steps=4)
    store = opt.stats()["store"]
    assert store["evictions"] == 0 and store["bytes_read"] == 0, store
    assert off.heap_fetches == 0
    opt.close()
    ref = gpt.make(seed=0)
    ref_opt = offloaded(tmp_path, ref, name="ref.vol", host_budget=1 << 30)
    assert train(ref, ref_opt, steps=4) == losses
    ref_opt.close()


def test_a_step_under_offload_parameters_leaves_no_tensor_to_the_cycle_collector(tmp_path):
    # The hooks' wrapper of a module's inputs and outputs made reference cycles (recursive
    # closures) that kept them, every module's activations, alive past the backward pass
    # until Python's cyclic collector ran: 22 MiB at the end of a step of the 27.4 M
    # benchmark, and its peak RSS over issue 43's target. Refcounting alone frees them now.
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, host_budget=1 << 30)
    mt.offload_parameters(model, opt)
    train(model, opt, steps=1)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        train(model, opt, steps=3, first=1)
        gc.collect()
        kept = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert kept == []
    opt.close()


def test_a_view_kept_past_its_use_keeps_its_block(tmp_path):
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model, host_budget=16 << 20)
    off = mt.offload_parameters(model, opt)
    fc = model.blocks[0].fc
    i = _index_of(opt, fc.weight)
    kept, copies, saved = [], [], []

    def hook(m, inputs):  # after offload_parameters' own: the parameter in use
        kept.append(fc.weight.data)
        copies.append(fc.weight.detach().clone())
        saved.append(model.state_dict()["blocks.0.fc.weight"])

    handle = fc.register_forward_pre_hook(hook)
    losses = train(model, opt, steps=2)
    assert fc.weight.numel() == 0
    # The views kept hold their leases, counted against the budget once: they share the
    # block, into which each fetch derives (as an in-place update would write); they read
    # the parameters of the last fetch. A state_dict taken in use holds copies.
    assert {j for _, j in off._stale} == {i} and off._leased_bytes() == off._nbytes[i]
    assert kept[0].data_ptr() == kept[1].data_ptr()
    assert torch.equal(kept[0], copies[-1]) and not torch.equal(copies[0], copies[-1])
    assert saved[-1].data_ptr() != kept[-1].data_ptr()
    assert torch.equal(saved[-1], copies[-1])
    handle.remove()
    kept.clear()  # views must go before opt.close(): the store closes with no lease held
    assert off._leased_bytes() == 0
    assert train(model, opt, steps=4, first=2)
    opt.close()
    ref = gpt.make(seed=0)
    ref_opt = offloaded(tmp_path, ref, name="ref.vol", host_budget=16 << 20)
    assert train(ref, ref_opt, steps=2) == losses
    ref_opt.close()


def test_a_budget_without_room_gives_parameters_their_own_tensors(tmp_path):
    # The optimizer's need (min_host_budget) stays free: room for the small parameters
    # (biases, norms), not for the 64 KiB matrices.
    model = gpt.make(seed=0)
    least = mt.OffloadedAdamW.min_host_budget(max(p.numel() for p in model.parameters()), 1 << 18)
    budget = least + (32 << 10)
    opt = offloaded(tmp_path, model, host_budget=budget)
    off = mt.offload_parameters(model, opt)
    losses = train(model, opt, steps=3)
    assert 0 < off.heap_fetches < off.fetches
    opt.close()
    ref = gpt.make(seed=0)
    ref_opt = offloaded(tmp_path, ref, name="ref.vol", host_budget=budget)
    assert train(ref, ref_opt, steps=3) == losses
    ref_opt.close()


def test_activations_keep_parameters_and_store_memory_saved_through_several_views_once(
        tmp_path):
    # q, k and v read one LayerNorm output, each through a flattened view of its own
    # (F.linear on a 3-D input), and each saves its weight transposed: the output is stored
    # once, the weights not at all.
    d = 256

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(d)
            self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))

        def forward(self, x):
            h = self.ln(x)
            return (self.q(h) * self.k(h) + self.v(h)).square().sum()

    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 16, d, requires_grad=True)
    model(x).backward()
    want = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    vol = memascend.Volume.open_or_create(str(tmp_path / "act.vol"), size=64 << 20)
    store = memascend.TensorStore(vol, host_budget=4 << 20)
    acts = mt.offload_activations(store, min_bytes=4096)
    with acts:
        loss = model(x)
    loss.backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # x, the LayerNorm's output, q's and k's outputs, and the square's input, each of
    activation = 2 * 16 * d * 4  # these bytes
    assert acts.deduplicated >= 2  # the output's second and third saves
    assert acts.saved_bytes <= 5 * activation  # a weight (d * d * 4) would be over it
    del acts, loss
    store.close()
    vol.close()


def test_torchs_transformer_layers_are_loaded_whole(tmp_path):
    # nn.MultiheadAttention reads out_proj.weight without calling out_proj, and
    # nn.TransformerEncoderLayer's inference fast path reads every parameter itself: their
    # hooks load them whole, with no `units` given.
    def make():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2),
                                   torch.nn.Linear(32, 8))

    x = torch.randn(4, 6, 32)
    y = torch.randint(0, 8, (4, 6))

    def train(model, opt):
        losses = []
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            out = model(x)
        model.train()
        return losses, out

    ref = make()
    want, want_out = train(ref, torch.optim.AdamW(param_groups(ref), lr=1e-3,
                                                  weight_decay=0.01))
    model = make()
    opt = offloaded(tmp_path, model)
    offload = mt.offload_parameters(model, opt)
    got, got_out = train(model, opt)
    assert got == pytest.approx(want, rel=1e-5)
    assert torch.allclose(got_out, want_out, rtol=1e-4, atol=1e-5)
    offload.remove()
    opt.close()


@pytest.mark.parametrize("activations", [False, True])
def test_a_forward_without_a_backward_frees_its_graph(tmp_path, activations):
    """An output its own node saves (tanh's) was held by the saved-tensor hooks as it was:
    a cycle through autograd's C++ that Python's collector never frees, so each forward
    pass with gradients on and no backward (a loss logged, an eval without no_grad) kept
    its whole graph for the life of the process."""
    import weakref
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-2, volume=str(tmp_path / "opt.vol"))
    mt.offload_parameters(m, opt)
    acts = None
    if activations:  # tanh's 1 KiB output below min_bytes: kept, as the offload keeps it
        vol = memascend.Volume.open_or_create(str(tmp_path / "act.vol"), size=16 << 20)
        acts = mt.offload_activations(memascend.TensorStore(vol, host_budget=1 << 20),
                                      min_bytes=1 << 20)
    seen = []
    m[1].register_forward_hook(lambda mod, i, o: seen.append(weakref.ref(o)))
    for _ in range(4):
        if acts is not None:
            with acts:
                out = m(torch.randn(4, 8))
        else:
            out = m(torch.randn(4, 8))
    del out
    gc.collect()
    assert not [r for r in seen if r() is not None]
    loss = m(torch.randn(4, 8)).square().sum()  # and a backward still trains
    loss.backward()
    opt.step()
    assert opt.steps == 1
    opt.close()


def test_a_run_that_ends_without_close_resumes_after_its_last_step(tmp_path):
    """Under offload_parameters the last step's update runs in the next forward pass (Note
    [optimizer overlap]); a process that ended without close() (transformers' Trainer never
    calls it) left it unrun, and resumed a step short, with that step's gradients lost."""
    whole = run_worker("offloaded", "8", "--volume", str(tmp_path / "whole.vol"),
                       "--offload-parameters")
    assert whole.returncode == 0, whole.stderr
    want, _ = parse(whole.stdout)
    vol = str(tmp_path / "open.vol")
    first = run_worker("offloaded", "5", "--volume", vol, "--offload-parameters", "--no-close")
    assert first.returncode == 0, first.stderr
    resumed = run_worker("offloaded", "8", "--volume", vol, "--offload-parameters", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    before, _ = parse(first.stdout)
    after, _ = parse(resumed.stdout)
    assert min(after) == 6
    for step, loss in {**before, **after}.items():
        assert loss == want[step], step


def test_a_model_and_optimizer_dropped_without_close_are_collected(tmp_path):
    """A global registry held every offloaded model's optimizer: dropped without close(),
    it stayed (memory, and the volume's lock: the same volume could not be opened again
    in this process)."""
    import weakref
    vol = str(tmp_path / "opt.vol")
    model = gpt.make(seed=0)
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=vol)
    mt.offload_parameters(model, opt)
    train(model, opt, steps=3)
    gone = weakref.ref(opt)
    del model, opt
    gc.collect()
    assert gone() is None
    again = gpt.make(seed=1)
    opt = mt.OffloadedAdamW(again.parameters(), lr=1e-3, volume=vol, resume=True)
    assert opt.resumed_step == 3  # its last update run and committed on the way out
    opt.close()


def test_a_forked_child_does_not_close_its_parents_optimizer(tmp_path):
    """The exit handler and __del__ close an optimizer left open, in the process that made
    it only: a forked child's copy closing would commit into the parent's volume."""
    from memascend.torch import _common
    model = gpt.make(seed=0)
    opt = offloaded(tmp_path, model)
    mt.offload_parameters(model, opt)  # the two hold each other: a cycle the collector frees
    train(model, opt, steps=1)
    pid = os.fork()
    if pid == 0:  # the child: what its exit would run, and its collector
        try:
            _common._close_at_exit()
            opt.__del__()
            if opt._core is None:
                os._exit(1)
            with pytest.raises(memascend.errors.FailedPreconditionError, match="forked"):
                opt.close()  # refused before it runs the planned update
            if opt._core is None or not opt._pending_update:
                os._exit(4)
            type(opt).close = lambda self: os._exit(3)  # a close, however it came
            core = opt._core
            with pytest.raises(memascend.errors.FailedPreconditionError, match="forked"):
                core.close()  # the native state refuses too (Note [forked child])
            del model, opt, core
            gc.collect()  # the cycle's weak references go before its __del__ runs, and
            os._exit(0)  # the native objects are left as they are (they segfaulted)
        except BaseException:  # noqa: BLE001 - a child reports by its status only
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status  # a signal's too
    assert train(model, opt, steps=2, first=1)
    opt.close()


def test_weight_norm_and_spectral_norm_train_offloaded_as_under_adamw(tmp_path):
    """Their forward pre-hooks compute `weight` from the parameters offloaded (weight_g and
    weight_v, weight_orig); registered before offload_parameters' loads, they ran first and
    read empty tensors (transformers' Wav2Vec2 uses weight_norm)."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(8, 16)),
                                   torch.nn.Tanh(),
                                   torch.nn.utils.spectral_norm(torch.nn.Linear(16, 3)))
    def steps(m, opt):
        losses = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses
    ref = make()
    want = steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    m = make()
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-2, volume=str(tmp_path / "opt.vol"))
    mt.offload_parameters(m, opt)
    assert steps(m, opt) == pytest.approx(want, rel=1e-5)
    opt.close()
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
