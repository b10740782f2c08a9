"""What torch.optim users do to an optimizer besides step(): LR schedulers, a model cast or
moved, starting over on a volume, param_groups edited, a state_dict with a scheduler's keys.
Each against torch.optim.AdamW, or refused with nothing changed."""
import pytest
import torch

import memascend.torch as mt
from memascend import errors


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)


def run(m, opt, steps, sched=None, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def offloaded(tmp_path, m, **kw):
    return mt.OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                             volume=str(tmp_path / "opt.vol"), **kw)


def same(a, b, tol=1e-5):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=tol, atol=tol)


@pytest.mark.parametrize("schedule", ["lambda", "step", "onecycle"])
def test_lr_schedulers_drive_the_learning_rate_as_for_adamw(tmp_path, schedule):
    """torch's schedulers set and count `optimizer._step_count` (torch < 2.2 resets it to 0
    at construction); the optimizer's own step number was that attribute, so the first
    step's commit was refused after the parameters had changed."""
    def make(opt):
        if schedule == "lambda":  # transformers' linear warmup, as get_linear_schedule_with_warmup
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        if schedule == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=8,
                                                   cycle_momentum=False)
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = run(ref, ref_opt, 6, make(ref_opt))
    m = model()
    opt = offloaded(tmp_path, m)
    losses = run(m, opt, 6, make(opt))
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    same(ref, m)
    assert opt.steps == 6
    opt.close()


def test_a_cast_or_moved_model_is_refused_before_its_step(tmp_path):
    """model.to(dtype) keeps the Parameter objects: the step wrote the old dtype's bytes into
    the new data (garbage weights, or the optimizer's own memory overwritten)."""
    m = model()
    opt = offloaded(tmp_path, m)
    run(m, opt, 1)
    m.to(torch.bfloat16)
    before = [p.detach().clone() for p in m.parameters()]
    x, y = batch(1)
    (m(x.bfloat16()).float() - y).pow(2).mean().backward()
    with pytest.raises(errors.FailedPreconditionError, match="parameter 0 is now torch.bfloat16"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    m.float()  # changed back: the optimizer goes on
    opt.zero_grad(set_to_none=True)
    run(m, opt, 1, first=1)
    assert opt.steps == 2
    opt.close()


def test_overwrite_starts_the_adam_step_and_the_loss_scale_over(tmp_path):
    m = model(seed=1)
    opt = offloaded(tmp_path, m, dynamic_loss_scale=True, initial_scale=1024.0)
    for p in m.parameters():  # an overflowing step halves the scale
        p.grad = torch.full_like(p, float("inf"))
    opt.step()
    run(m, opt, 4)
    assert opt.loss_scale < 1024.0
    opt.close()
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = run(ref, ref_opt, 3)
    m = model()
    opt = offloaded(tmp_path, m, overwrite=True, dynamic_loss_scale=True, initial_scale=1024.0)
    assert opt.loss_scale == 1024.0 and opt.steps == 0
    losses = []
    for step in range(3):  # with the loss scaled, as dynamic_loss_scale asks
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)  # step 1's bias correction
    same(ref, m)
    opt.close()


def test_betas_or_eps_changed_are_refused_not_ignored(tmp_path):
    m = model()
    opt = offloaded(tmp_path, m)
    run(m, opt, 1)
    opt.param_groups[0]["betas"] = (0.85, 0.999)  # OneCycleLR's cycle_momentum does this
    before = [p.detach().clone() for p in m.parameters()]
    x, y = batch(1)
    torch.nn.functional.mse_loss(m(x), y).backward()
    with pytest.raises(errors.InvalidArgumentError, match="cycle_momentum=False"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.step()
    # A state_dict of other betas: refused before anything is written.
    sd = opt.state_dict()
    sd["param_groups"][0]["eps"] = 1e-6
    with pytest.raises(errors.InvalidArgumentError, match="eps 1e-06"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["eps"] == 1e-8
    opt.close()


def test_a_state_dict_brings_a_schedulers_keys_back(tmp_path):
    """torch's optimizers restore every key of a group; a scheduler resumed with
    last_epoch needs its initial_lr there."""
    m = model()
    opt = offloaded(tmp_path, m)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    run(m, opt, 3, sched)
    sd, lr = opt.state_dict(), opt.param_groups[0]["lr"]
    opt.close()
    m2 = model()
    opt2 = mt.OffloadedAdamW(m2.parameters(), lr=1e-2, weight_decay=0.01,
                             volume=str(tmp_path / "other.vol"))
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["initial_lr"] == 1e-2 and opt2.param_groups[0]["lr"] == lr
    # Resumed at the epoch it reached (its construction steps once more): KeyError before.
    torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5 ** s, last_epoch=2)
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 3) == lr
    opt2.close()


@pytest.mark.parametrize("dtype,part", [(torch.float32, 1 << 16), (torch.float32, 1 << 18),
                                        (torch.bfloat16, 1 << 16), (torch.bfloat16, 1 << 18)])
def test_the_minimum_host_budget_steps(tmp_path, dtype, part):
    """min_host_budget() is a budget that works: it was what one part's update holds, and
    the pool, fragmented, failed the first step with it (fp32 parts of 2^18, bf16 ones),
    after some parameters had been updated in place."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 600), torch.nn.Linear(600, 600),
                            torch.nn.Linear(600, 600), torch.nn.Linear(600, 3)).to(dtype)
    least = mt.OffloadedAdamW.min_host_budget(max(p.numel() for p in m.parameters()), part,
                                              dtype)
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-3, volume=str(tmp_path / "min.vol"),
                            host_budget=least, part_elements=part)
    assert opt.host_budget == least
    for step in range(3):
        m(torch.randn(5, 7, dtype=dtype)).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert opt.steps == 3
    with pytest.raises(errors.InvalidArgumentError):  # below it: refused before anything
        mt.OffloadedAdamW(m.parameters(), lr=1e-3, volume=str(tmp_path / "less.vol"),
                          host_budget=least - 4096, part_elements=part)
    opt.close()


def test_an_activation_offload_entered_inside_itself(tmp_path):
    """`with acts:` inside `with acts:` (a helper that enters the offload its caller did):
    its exit raised, and torch's saved-tensor hooks stayed installed for the process."""
    import memascend
    vol = memascend.Volume.open_or_create(str(tmp_path / "act.vol"), size=64 << 20)
    store = memascend.TensorStore(vol, host_budget=1 << 20)
    acts = mt.offload_activations(store, min_bytes=64)
    m = model()
    x, y = batch(0)
    ref = torch.nn.functional.mse_loss(m(x), y)
    ref.backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    with acts:
        with acts:
            loss = torch.nn.functional.mse_loss(m(x), y)
        saved = acts.saved_bytes
        assert saved > 0
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(want, m.parameters()))
    m(x).sum().backward()  # outside: nothing goes through the store
    assert acts.saved_bytes == saved
    del acts, loss
    store.close()
    vol.close()


def test_a_resume_with_other_betas_or_eps_is_refused(tmp_path):
    """The moments on the volume were made with the run's betas and eps; a resume with
    others took them silently (a load_state_dict of the same refuses them)."""
    m = model()
    opt = offloaded(tmp_path, m)
    run(m, opt, 2)
    opt.close()
    for betas, eps in (((0.5, 0.6), 1e-8), ((0.9, 0.999), 1e-3)):
        with pytest.raises(errors.FailedPreconditionError, match="betas"):
            offloaded(tmp_path, model(), betas=betas, eps=eps, resume=True)
    again = offloaded(tmp_path, model(), resume=True)  # the run's own: goes on
    assert again.resumed_step == 2
    again.close()
    fresh = offloaded(tmp_path, model(), betas=(0.5, 0.6), overwrite=True)  # or starts over
    assert fresh.resumed_step is None
    fresh.close()


def test_a_resume_compares_betas_as_the_kernels_take_them(tmp_path):
    """fp32's 0.9 (numpy's or torch's) is the run's 0.9: the kernels take both alike."""
    m = model()
    opt = offloaded(tmp_path, m, betas=(0.9, 0.95))
    run(m, opt, 1)
    opt.close()
    f32 = torch.tensor(0.9, dtype=torch.float32).item()  # 0.8999999761581421
    again = offloaded(tmp_path, model(), betas=[f32, 0.95], resume=True)
    assert again.resumed_step == 1
    again.close()
