"""memascend.torch refuses what would crash, lose data or train wrongly, with a message
that says what to do, and a refused call changes nothing."""
import pytest
import torch

import gpt
import memascend.torch as mt
from memascend import errors


def make(tmp_path, model, name="o.vol", **kw):
    kw.setdefault("host_budget", 1 << 20)
    kw.setdefault("part_elements", 1 << 18)
    return mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=str(tmp_path / name), **kw)


@pytest.mark.parametrize("arg,value,match", [
    ("part_elements", 0, "part_elements must be in 1"),
    ("part_elements", -5, "part_elements must be in 1"),
    ("part_elements", 2.5, "part_elements must be a whole number"),
    ("threads", 100000, "threads must be in 1..1024"),
    ("threads", 0, "threads must be in 1..1024"),
    ("host_budget", -1, "host_budget must be in 1"),
    ("host_budget", "lots", "host_budget must be a whole number"),
    ("host_budget", 1 << 80, "host_budget must be in 1"),
    ("read_ahead", -1, "read_ahead must be in 0"),
    ("run_id", -3, "run_id must be in 0"),
    ("volume_size", 0, "volume_size must be in 1"),
])
def test_integers_out_of_range_are_refused_before_anything_is_made(tmp_path, arg, value, match):
    model = gpt.make(seed=0)
    with pytest.raises(errors.InvalidArgumentError, match=match):
        make(tmp_path, model, **{arg: value})
    assert not (tmp_path / "o.vol").exists()  # nothing was made
    # and the process is fine: the next optimizer works
    opt = make(tmp_path, model)
    opt.close()


def test_a_closed_optimizer_says_so(tmp_path):
    opt = make(tmp_path, gpt.make(seed=0))
    opt.close()
    for call in (opt.step, opt.settle, opt.stats, opt.state_dict, opt.reload_parameters,
                 lambda: opt.loss_scale, lambda: opt.scale_loss(torch.ones(()))):
        with pytest.raises(errors.FailedPreconditionError, match="closed"):
            call()
    opt.close()  # twice is fine


def test_frozen_parameters_are_refused_rather_than_decayed(tmp_path):
    model = gpt.make(seed=0)
    model.wpe.weight.requires_grad_(False)
    with pytest.raises(errors.InvalidArgumentError, match="do not require grad"):
        make(tmp_path, model, weight_decay=0.1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = mt.OffloadedAdamW(trainable, lr=1e-3, weight_decay=0.1, volume=str(tmp_path / "t.vol"),
                            host_budget=1 << 20, part_elements=1 << 18)
    before = model.wpe.weight.detach().clone()
    x, y = gpt.batch(0)
    model(x, y).backward()
    opt.step()
    assert torch.equal(model.wpe.weight, before)
    # frozen after the optimizer was made: refused at step(), not silently decayed
    model.blocks[0].fc.weight.requires_grad_(False)
    with pytest.raises(errors.FailedPreconditionError, match="stopped requiring grad"):
        opt.step()
    opt.close()


def test_a_refused_state_dict_changes_nothing(tmp_path):
    model = gpt.make(seed=0)
    opt = make(tmp_path, model)
    x, y = gpt.batch(0)
    model(x, y).backward()
    opt.step()
    good = opt.state_dict()
    bad = opt.state_dict()
    for entry in bad["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1.0  # would change every parameter's state...
    last = max(bad["state"])
    bad["state"][last]["exp_avg_sq"] = torch.zeros(3)  # ...but the last one is malformed
    with pytest.raises(errors.InvalidArgumentError, match="elements"):
        opt.load_state_dict(bad)
    now = opt.state_dict()
    for i in good["state"]:
        assert torch.equal(now["state"][i]["exp_avg"], good["state"][i]["exp_avg"]), i
    opt.close()


def test_a_saved_activation_modified_in_place_is_caught_as_pytorch_does(tmp_path):
    import memascend
    vol = memascend.Volume.open_or_create(str(tmp_path / "act.vol"), size=64 << 20)
    store = memascend.TensorStore(vol, host_budget=1 << 20)
    w = torch.randn(64, 64, requires_grad=True)
    with mt.offload_activations(store, min_bytes=0):
        h = torch.randn(64, 64)
        y = (h @ w).sum()  # saves h for w's gradient
    h.add_(1.0)  # modified after it was saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # unmodified, the same backward works
    with mt.offload_activations(store, min_bytes=0):
        h2 = torch.randn(64, 64)
        y2 = (h2 @ w).sum()
    y2.backward()
    assert torch.allclose(w.grad, h2.sum(0).unsqueeze(1).expand(64, 64))
    # What the hooks keep as it is (a parameter's view, a tensor below min_bytes) too
    lin = torch.nn.Linear(64, 64)
    for change in (lambda: lin.weight.add_(1.0), lambda: small.mul_(2.0)):
        small = torch.randn(4, 64, requires_grad=True)
        with mt.offload_activations(store, min_bytes=1 << 20):  # nothing stored
            y = (lin(small) * small.sum()).sum()
        with torch.no_grad():
            change()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    store.close()
    vol.close()


def test_a_budget_beyond_the_state_is_capped_to_it(tmp_path):
    tiny = torch.nn.Linear(6, 6)  # 42 parameters
    opt = mt.OffloadedAdamW(tiny.parameters(), volume=str(tmp_path / "tiny.vol"),
                            host_budget=512 << 20)
    assert opt.host_budget < 8 << 20
    x = torch.randn(4, 6)
    tiny(x).sum().backward()
    opt.step()
    assert opt.stats()["store"]["pinned_peak_bytes"] <= opt.host_budget
    opt.close()


def test_offloaded_parameters_are_what_state_dict_saves_and_close_gives_back(tmp_path):
    model = gpt.make(seed=0)
    opt = make(tmp_path, model)
    mt.offload_parameters(model, opt)
    for step in range(2):
        x, y = gpt.batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert model.blocks[0].fc.weight.numel() == 0  # offloaded between uses
    saved = model.state_dict()
    assert all(t.numel() > 0 for t in saved.values()), [k for k, t in saved.items() if not t.numel()]
    assert saved["wte.weight"].shape == (256, 64) and torch.equal(saved["wte.weight"],
                                                                   saved["head.weight"])
    path = tmp_path / "model.pt"
    torch.save(saved, path)
    opt.close()
    # The model is whole again, with the trained values, and runs without the optimizer.
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
    x, y = gpt.batch(5)
    loss = model(x, y)
    fresh = gpt.make(seed=1)
    fresh.load_state_dict(torch.load(path))
    assert torch.equal(fresh(x, y), loss)


def test_a_model_changed_under_the_hooks_is_refused_not_undone(tmp_path):
    import copy
    model = gpt.make(seed=0)
    opt = make(tmp_path, model)
    offload = mt.offload_parameters(model, opt)
    with pytest.raises(errors.FailedPreconditionError, match="state_dict"):
        copy.deepcopy(model)
    model.to(torch.float64)
    x, y = gpt.batch(0)
    with pytest.raises(errors.FailedPreconditionError, match="became torch.float64"):
        model(x, y)
    model.to(torch.float32)  # back as it was: it trains again
    model(x, y).backward()
    opt.step()
    opt.close()
    assert offload.heap_fetches >= 0  # closing the optimizer gave the model back
    assert copy.deepcopy(model) is not model  # the model given back copies as any module


def test_a_volume_has_one_owner_at_a_time(tmp_path):
    # Two optimizers on one volume object would overwrite each other's objects.
    first = make(tmp_path, gpt.make(seed=0))
    with pytest.raises(errors.FailedPreconditionError, match="already in use"):
        mt.OffloadedAdamW(gpt.make(seed=1).parameters(), volume=first._volume,
                          host_budget=1 << 20, part_elements=1 << 18)
    first.step()
    first.close()
    before = _names(tmp_path / "o.vol")
    # Another model (or another part size) on the volume of this one: refused, untouched.
    other = torch.nn.Linear(8, 8)
    with pytest.raises(errors.FailedPreconditionError, match="overwrite=True"):
        make(tmp_path, other)
    with pytest.raises(errors.FailedPreconditionError, match="another layout"):
        make(tmp_path, gpt.make(seed=0), part_elements=1 << 17)
    assert _names(tmp_path / "o.vol") == before
    # overwrite=True names the loss: the old state goes, nothing of it left behind.
    opt = make(tmp_path, other, overwrite=True)
    opt.close()
    left = _names(tmp_path / "o.vol")
    assert left and all(n.startswith("p0.") or n.startswith("p1.") or n.startswith("memascend.")
                        for n in left), left
    assert len(left) < len(before)


def _names(path):
    from memascend import _core
    v = _core.Volume.open(str(path))
    try:
        return sorted(o["name"] for o in v.objects())
    finally:
        v.close()


def test_a_grad_scaler_that_found_no_gradient_is_refused_before_the_step(tmp_path):
    # torch 2.x's GradScaler sets optimizer.found_inf to the sum of its per-device checks;
    # with every gradient gone from p.grad (offload_gradients on a GPU) that is the integer
    # 0, and its update() would fail after the step for want of a check.
    model = gpt.make(seed=0)
    opt = make(tmp_path, model)
    x, y = gpt.batch(0)
    model(x, y).backward()
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    before = [p.detach().clone() for p in model.parameters()]
    opt.grad_scale, opt.found_inf = torch.tensor(256.0), 0
    with pytest.raises(errors.FailedPreconditionError, match="offload_gradients=False"):
        opt.step()
    del opt.grad_scale, opt.found_inf
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert opt.steps == 0
    for p, g in zip(model.parameters(), grads):  # the same step, without the scaler
        p.grad = g
    opt.step()
    assert opt.steps == 1
    opt.close()
