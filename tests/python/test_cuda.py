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


def test_a_host_wait_for_a_copy_sleeps():
    """PendingLeases waits on host_event()s, which sleep in the driver: torch's default
    event busy-waits a CPU for the whole wait (Note [blocking events])."""
    import time
    from memascend.torch.cuda import PendingLeases, host_event

    class Lease:
        released = False

        def release(self):
            self.released = True

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 30)  # about half a second of GPU cycles
        event = host_event()
        event.record(side)
    pending, lease = PendingLeases(), Lease()
    pending.add(event, lease, 1 << 20, "k")
    pending.reap(limit=1 << 30)  # under the limit: nothing waited for
    assert pending.holds("k") and not lease.released
    cpu, wall = time.thread_time(), time.perf_counter()
    pending.reap(limit=0)  # over it: waits for the copy
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert lease.released and not pending.holds("k") and pending.bytes == 0
    assert wall > 0.1, "the wait did not wait"
    assert cpu < 0.25 * wall, f"the wait spun: {cpu:.3f} s of CPU in {wall:.3f} s"


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


def test_load_state_dict_under_offload_parameters_on_the_gpu(tmp_path):
    """model.load_state_dict() mid-run: the device copies of the old values are dropped
    (model_state.py), and the run goes on as torch's AdamW's after the same load."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model = gpt.make(seed=0).cuda()
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-3, weight_decay=0.01)
    model = gpt.make(seed=0).cuda()
    opt = offloaded(tmp_path, model)
    mt.offload_parameters(model, opt)
    train(ref_model, ref_opt, steps=3)
    train(model, opt, steps=3)  # every group's device copy made, some read ahead
    other = gpt.make(seed=5).cuda().state_dict()
    ref_model.load_state_dict(other)
    model.load_state_dict(other)
    for k, v in model.state_dict().items():
        assert torch.allclose(v.float().cuda(), ref_model.state_dict()[k].float()), k
    assert train(model, opt, steps=3) == pytest.approx(train(ref_model, ref_opt, steps=3),
                                                       rel=TOL, abs=TOL)
    opt.close()
    assert_same(ref_model, model)


def test_gradients_accumulate_on_the_gpu_under_offload_parameters(tmp_path):
    """Micro-batches accumulating in p.grad on the GPU (offload_gradients=False: each
    gradient leaves at step()) with the parameters offloaded a block at a time
    (units), as bench/gpu's --accum runs:
    the losses and weights of torch.optim.AdamW accumulating the same way."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model = gpt.make(seed=0).cuda()
    ref_losses = gpt.train_accumulating(
        ref_model, torch.optim.AdamW(param_groups(ref_model), lr=1e-3, weight_decay=0.01),
        device="cuda")
    model = gpt.make(seed=0).cuda()
    opt = mt.OffloadedAdamW(param_groups(model), lr=1e-3, weight_decay=0.01,
                            volume=str(tmp_path / "accum.vol"), host_budget=1 << 20,
                            part_elements=1 << 18, offload_gradients=False)
    offload = mt.offload_parameters(model, opt, units=gpt.Block)  # a block loaded whole
    losses = gpt.train_accumulating(model, opt, device="cuda")
    assert losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    assert losses[-1] < losses[0]
    assert opt.stats()["device_gradients"]["groups"] > 0  # they left through the device path
    offload.remove()
    assert_same(ref_model, model)
    opt.close()


def test_parameters_that_move_on_the_device_are_seen_where_they_are(tmp_path):
    """A device budget of four of the largest parameters (about half the model): groups
    are evicted and come back at other addresses, and under accumulation most uses find
    theirs where it was (Note [device views]: the tensor of the last use is reused only at
    the same address), also after an evaluation pass under inference mode. Losses and
    weights as torch.optim.AdamW's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model = gpt.make(seed=0).cuda()
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-3, weight_decay=0.01)
    ref_losses = gpt.train_accumulating(ref_model, ref_opt, device="cuda")
    model = gpt.make(seed=0).cuda()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    opt = mt.OffloadedAdamW(param_groups(model), lr=1e-3, weight_decay=0.01,
                            volume=str(tmp_path / "moving.vol"), host_budget=1 << 20,
                            part_elements=1 << 18, offload_gradients=False)
    offload = mt.offload_parameters(model, opt, device_budget=4 * largest, read_ahead=largest)
    losses = gpt.train_accumulating(model, opt, device="cuda")
    assert losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    stats = opt.stats()["device_parameters"]
    assert stats["evictions"] > 0 and stats["hits"] > 0, stats
    n = len(list(model.parameters()))
    # Groups that moved got new tensors; most uses found theirs where it was.
    assert n < offload.views_made < offload.fetches, (offload.views_made, offload.fetches)
    # An evaluation pass under inference mode (where groups move and get new tensors),
    # then training again: no tensor made there may leave p an inference tensor.
    x, y = (t.cuda() for t in gpt.batch(0))
    with torch.inference_mode():
        evaluated = [float(m(x, y)) for m in (ref_model, model)]
    assert evaluated[1] == pytest.approx(evaluated[0], rel=TOL, abs=TOL)
    more_ref = gpt.train_accumulating(ref_model, ref_opt, steps=2, device="cuda")
    assert gpt.train_accumulating(model, opt, steps=2, device="cuda") == pytest.approx(
        more_ref, rel=TOL, abs=TOL)
    offload.remove()
    assert_same(ref_model, model)
    opt.close()


@pytest.mark.parametrize("block", [gpt.Block, gpt.SharedProjectionBlock],
                         ids=["block", "a module called twice"])
def test_a_checkpointed_block_keeps_its_recomputed_parameters_or_the_budget_says_so(tmp_path,
                                                                                    block):
    """Note [recomputed parameters]: a checkpointed block's recomputation saves its modules'
    parameters, views of their device blocks, for their backward. With room for a block
    and a module read ahead (groups evicted between blocks), and with the default budget,
    it trains as torch.optim.AdamW does, a module called twice in the block too (Note
    [stopped recomputation]: its earlier call's backward reads what its recomputation
    saved); below a block the backward pass is refused with the budget named, where the
    block's first module used to be evicted for its last and its backward to read another
    group's bytes."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    ref_model = gpt.CheckpointedGPT(block=block).cuda()
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-3, weight_decay=0.01)
    ref_losses = gpt.train_accumulating(ref_model, ref_opt, steps=3, device="cuda")

    def run(budget_of, name):
        torch.manual_seed(0)
        model = gpt.CheckpointedGPT(block=block).cuda()
        size = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                      for m in model.modules())
        budget = budget_of(size, largest)
        opt = mt.OffloadedAdamW(param_groups(model), lr=1e-3, weight_decay=0.01,
                                volume=str(tmp_path / f"ckpt-{name}.vol"),
                                host_budget=1 << 20, part_elements=1 << 18,
                                offload_gradients=False)
        offload = mt.offload_parameters(model, opt, device_budget=budget,
                                        read_ahead=None if budget is None else largest)
        try:
            losses, failure = gpt.train_accumulating(model, opt, steps=3, device="cuda"), None
        except memascend.ResourceExhaustedError as e:
            losses, failure = None, e
        stats = dict(opt.stats(), budget=offload._cuda.budget, layer=size, largest=largest)
        offload.remove()  # after a failed backward pass too: the model back, the state closed
        opt.close()
        return losses, failure, stats

    losses, failure, stats = run(lambda size, largest: size + 3 * largest, "room")
    assert failure is None and losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    assert stats["device_parameters"]["evictions"] > 0, stats["device_parameters"]
    losses, failure, stats = run(lambda size, largest: None, "default")
    assert failure is None and losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    size, largest = stats["layer"], stats["largest"]
    assert stats["budget"] == max(2 * largest, size + largest) + 2 * largest, stats
    losses, failure, _ = run(lambda size, largest: size - largest // 2, "below")
    assert losses is None and "device budget" in str(failure), failure


def test_a_grad_scaler_with_offloaded_parameters(tmp_path):
    """torch's GradScaler drives the step where the gradients stay in p.grad until step()
    (offload_gradients=False), and is refused, before any step, where they left during
    backward (offload_parameters' default on a GPU)."""
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
    for offload_gradients in (False, None):
        model = gpt.make(seed=0).cuda()
        opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=str(
            tmp_path / f"s{offload_gradients}.vol"), host_budget=1 << 20,
            part_elements=1 << 18, offload_gradients=offload_gradients)
        mt.offload_parameters(model, opt)
        x, y = (t.cuda() for t in gpt.batch(0))
        scaler.scale(model(x, y)).backward()
        if offload_gradients is None:
            with pytest.raises(memascend.errors.FailedPreconditionError,
                               match="offload_gradients=False"):
                scaler.step(opt)
            assert opt.steps == 0
        else:
            scaler.step(opt)
            scaler.update()
            assert opt.steps == 1 and not opt.last_step["skipped"]
        opt.close()


def test_a_sparse_gradient_sent_during_backward_is_refused_as_at_step(tmp_path):
    emb = torch.nn.Embedding(64, 16, sparse=True).cuda()
    opt = mt.OffloadedAdamW(emb.parameters(), lr=1e-3, volume=str(tmp_path / "sp.vol"),
                            host_budget=1 << 20, part_elements=1 << 10,
                            offload_gradients=True)
    with pytest.raises(memascend.errors.InvalidArgumentError, match="sparse gradient"):
        emb(torch.arange(8, device="cuda")).sum().backward()
    opt.close()


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


# ---- a transformers Llama with Llama-3.2-1B's widths (two layers), bf16 ------------------

LLAMA_1B_WIDTHS = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=True, num_hidden_layers=2)
LLAMA_STEPS, LLAMA_SEQ, LLAMA_BATCH = 20, 128, 2


def _llama(checkpointing):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B_WIDTHS))
    model = model.to(torch.bfloat16).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _llama_tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, LLAMA_1B_WIDTHS["vocab_size"], (LLAMA_STEPS, LLAMA_BATCH, LLAMA_SEQ),
                         generator=g)


def _llama_reference(checkpointing):
    """The same model with torch.optim.AdamW over fp32 master weights, all on the GPU."""
    model = _llama(checkpointing)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-5, weight_decay=0.01)
    losses = []
    for x in _llama_tokens():
        x = x.cuda()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
        losses.append(float(loss))
    return losses


def _rss():
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_RESUME_WORKER = r"""
import os, sys, json, torch
sys.path.insert(0, os.environ["TESTS"])
torch.use_deterministic_algorithms(True)  # two runs of the same steps: the same bits
import gpt, memascend.torch as mt
vol, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = gpt.make(seed=0).cuda().to(torch.bfloat16)
opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=vol, host_budget=1 << 20,
                        part_elements=1 << 18, resume=os.path.exists(vol))
offload = mt.offload_parameters(model, opt)
for step in range(opt.steps, steps):
    x, y = (t.cuda() for t in gpt.batch(step))
    loss = model(x, y)
    loss.backward()
    if step == kill_at:
        os.kill(os.getpid(), 9)  # mid-step: after backward, before the update
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(json.dumps([step, float(loss)]), flush=True)
opt.close()
"""


def test_a_gpu_run_killed_mid_step_resumes_with_the_same_losses(tmp_path):
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TESTS=os.path.dirname(__file__), CUBLAS_WORKSPACE_CONFIG=":4096:8")

    def run(vol, kill_at):
        p = subprocess.run([sys.executable, "-c", _RESUME_WORKER, vol, str(STEPS), str(kill_at)],
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode in (0, -9), p.stderr[-3000:]
        return p.returncode, dict(json.loads(line) for line in p.stdout.splitlines())

    rc, whole = run(str(tmp_path / "whole.vol"), -1)
    assert rc == 0 and sorted(whole) == list(range(STEPS))
    rc, first = run(str(tmp_path / "killed.vol"), 6)
    assert rc == -9 and sorted(first) == list(range(6))
    rc, rest = run(str(tmp_path / "killed.vol"), -1)
    assert rc == 0 and sorted(rest) == list(range(6, STEPS))
    assert {**first, **rest} == whole


_NCCL_WORKER = r"""
import os, sys, json, torch
import torch.distributed as dist
sys.path.insert(0, os.environ["TESTS"])
torch.use_deterministic_algorithms(True)  # two runs of the same steps: the same bits
import gpt, memascend.torch as mt
vol, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
group = None
if mode.startswith("nccl"):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="file://" + vol + ".init", rank=0,
                            world_size=1)
    group = dist.group.WORLD
model = gpt.make(seed=0).cuda().to(torch.bfloat16)
opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=vol, host_budget=1 << 20,
                        part_elements=1 << 18, max_grad_norm=1.0, process_group=group,
                        offload_gradients=True if mode == "nccl-hooks" else None)
pinned = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
losses = []
for step in range(steps):
    x, y = (t.cuda() for t in gpt.batch(step))
    loss = model(x, y)
    loss.backward()
    freed = all(p.grad is None for p in model.parameters())
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(float(loss))
    if step == 0 and hasattr(torch.cuda, "host_memory_stats"):
        pinned = torch.cuda.host_memory_stats()
after = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
stats = opt.stats()
print(json.dumps({"losses": losses, "grad_norm": opt.last_step["grad_norm"],
                  "comm_bytes": getattr(opt, "comm_bytes", 0),
                  "sharded": opt._sharded, "freed": freed,
                  "from_device": stats["device_gradients"]["bytes_from_device"],
                  "pinned_allocs": [pinned.get("num_host_alloc_calls", 0),
                                    after.get("num_host_alloc_calls", 0)],
                  "params": float(sum(p.float().sum() for p in model.parameters()))}))
opt.close()
if group is not None:
    dist.destroy_process_group()
"""


@pytest.mark.skipif(not (torch.distributed.is_available()
                         and torch.distributed.is_nccl_available()),
                    reason="this PyTorch has no NCCL")
def test_the_sharded_path_over_nccl_trains_as_one_process(tmp_path):
    """One GPU, torch.distributed over NCCL at world size 1 with the group passed: the
    sharded path (gradients reduce-scattered on the GPU, at step() or during backward, the
    rank's shard out by the device path, the parameters all-gathered on the GPU) gives the
    losses and parameters of the same run without torch.distributed, bit for bit, and
    stages nothing through torch's pinned cache after the first step."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TESTS=os.path.dirname(__file__), CUBLAS_WORKSPACE_CONFIG=":4096:8")

    def run(name, mode):
        p = subprocess.run([sys.executable, "-c", _NCCL_WORKER, str(tmp_path / name),
                            str(STEPS), mode], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.splitlines()[-1])

    alone = run("alone.vol", "alone")
    assert not alone["sharded"] and not alone["freed"]
    # At step(), and during backward (offload_gradients: buckets reduce-scattered from
    # the hooks, p.grad freed).
    for mode in ("nccl", "nccl-hooks"):
        nccl = run(f"{mode}.vol", mode)
        assert nccl["sharded"] and nccl["freed"] == (mode == "nccl-hooks")
        assert nccl["losses"] == alone["losses"], mode
        assert nccl["grad_norm"] == alone["grad_norm"] and nccl["params"] == alone["params"]
        assert nccl["comm_bytes"] > 0 and nccl["from_device"] > 0
        assert nccl["pinned_allocs"][1] == nccl["pinned_allocs"][0]


@pytest.mark.last  # the heaviest GPU tests (conftest.py)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_a_transformers_llama_fine_tunes_offloaded_as_on_the_gpu(tmp_path, checkpointing):
    ref = _llama_reference(checkpointing)
    torch.cuda.empty_cache()
    model = _llama(checkpointing)
    # Every fifth step durable (Note [commit interval]): each commit writes the whole
    # 6 GB state, about 3 s on the H200 machines' disk, and twenty of them per variant
    # outran the device check's share of a lease twice. The kill -9 test above keeps
    # every step durable.
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-5, weight_decay=0.01,
                            volume=str(tmp_path / "llama.vol"), host_budget=8 << 30,
                            commit_every=5)
    offload = mt.offload_parameters(model, opt)
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    losses, rss, pinned_cache = [], [], []
    for x in _llama_tokens():
        x = x.cuda()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        assert all(p.grad is None for p in model.parameters())  # gone out during backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        rss.append(_rss())
        if host_stats is not None:
            pinned_cache.append(host_stats()["num_host_alloc"])
    for step, (m, r) in enumerate(zip(losses, ref)):
        assert abs(m - r) <= 1e-3 * abs(r), (step, m, r)
    # Host memory flat over steps 5-20: nothing allocated per step.
    assert (rss[-1] - rss[4]) / rss[4] < 0.01, rss
    # torch's pinned cache: no allocation after the first step.
    if pinned_cache:
        assert pinned_cache[-1] == pinned_cache[0], pinned_cache
    stats = opt.stats()
    assert stats["device_parameters"]["read_ahead"] > 0
    assert stats["device_gradients"]["groups"] == LLAMA_STEPS * len(list(model.parameters()))
    # Page-locked memory stays within the store's budget.
    assert stats["store"]["pinned_peak_bytes"] <= 8 << 30
    offload.remove()
    opt.close()
