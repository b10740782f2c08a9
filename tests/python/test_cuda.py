"""memascend.torch with the model on a GPU, against torch.optim.AdamW on the same GPU.

Skipped without a CUDA device; the device check (`./run device`, docs/gpu.md) runs them on
a GPU machine with that machine's PyTorch."""
import pytest
import torch

import gpt
import memascend
import memascend.torch as mt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False)")

STEPS = 10
# The reference and MemAscend run the same forward and backward kernels on the same GPU;
# the embedding's backward adds with atomics, in no fixed order, so the two runs differ by
# rounding from the first step on.
TOL = 1e-4


def train(model, opt, steps=STEPS, activations=None):
    losses = []
    for step in range(steps):
        x, y = (t.cuda() for t in gpt.batch(step))
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


def param_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}]


def reference():
    model = gpt.make(seed=0).cuda()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3, weight_decay=0.01)
    return model, train(model, opt)


def offloaded(tmp_path, model, name="opt.vol"):
    return mt.OffloadedAdamW(param_groups(model), lr=1e-3, weight_decay=0.01,
                             volume=str(tmp_path / name), host_budget=1 << 20,
                             part_elements=1 << 18)


def assert_same(model_a, model_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert a.device == b.device
        assert torch.allclose(a.detach(), b.detach(), rtol=TOL, atol=TOL), name


def test_system_info_sees_the_gpu_and_registers_host_memory():
    info = memascend.system_info()
    assert info["cuda_devices"] == torch.cuda.device_count()
    assert info["cuda"]["devices"][0]["name"] == torch.cuda.get_device_name(0)
    assert info["host_backing"] == "cuda_registered"


def test_offloaded_adamw_with_cuda_parameters_matches_torch_adamw(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0).cuda()
    opt = offloaded(tmp_path, model)
    losses = train(model, opt)
    assert losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    assert losses[-1] < losses[0]
    assert_same(ref_model, model)
    assert all(p.is_cuda for p in model.parameters())
    assert opt.stats()["store"]["evictions"] > 0  # the budget is below the state
    opt.close()


def test_parameters_and_activations_offloaded_from_the_gpu(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model, ref_losses = reference()
    model = gpt.make(seed=0).cuda()
    opt = offloaded(tmp_path, model)
    offload = mt.offload_parameters(model, opt, window=2)
    vol = memascend.Volume.open_or_create(str(tmp_path / "act.vol"), size=256 << 20)
    store = memascend.TensorStore(vol, host_budget=1 << 20)
    acts = mt.offload_activations(store, min_bytes=4096)
    losses = train(model, opt, activations=acts)
    assert losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    assert acts.saved_bytes > 0
    assert offload.fetches > 0
    offload.remove()
    assert_same(ref_model, model)
    opt.close()
    del acts
    store.close()
    vol.close()


def test_bf16_parameters_on_the_gpu_train(tmp_path):
    # bf16 weights with fp32 master weights and moments on the volume, as fine-tuning runs.
    model = gpt.make(seed=0).cuda().to(torch.bfloat16)
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=str(tmp_path / "bf16.vol"),
                            host_budget=1 << 20, part_elements=1 << 18)
    losses = []
    for step in range(STEPS):
        x, y = (t.cuda() for t in gpt.batch(step))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.float().item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    opt.close()
