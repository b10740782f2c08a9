"""The SDK's device paths from Python (memascend._core.DeviceParameters, DeviceGradients)
over their host emulation: what memascend.torch drives on a GPU, checked on any machine.
The GPU itself is exercised by test_cuda.py on a GPU machine."""
import ctypes

import pytest
import torch

from memascend import _core, errors

PART = 1 << 16
SIZES = [3 * PART + 100, PART + 7, 2 * PART]


def make_adam(tmp_path, name, store_parameters=True):
    vol = _core.Volume.open_or_create(str(tmp_path / f"{name}.vol"), 64 << 20)
    store = _core.TensorStore(vol, host_budget=16 << 20)
    groups = [(f"g{i}", n) for i, n in enumerate(SIZES)]
    adam = _core.OffloadedAdam(store, groups, "bfloat16", "bfloat16", PART, [1e-3] * 3,
                               [0.01] * 3, 0.9, 0.999, 1e-8, 0.0, False, 1.0, 0, 0, 2,
                               store_parameters)
    torch.manual_seed(0)
    for i, n in enumerate(SIZES):
        w = (torch.randn(n) * 0.02).to(torch.bfloat16)
        adam.initialize(i, w.data_ptr(), n, "bfloat16")
    adam.commit(0)
    return vol, store, adam


def stored(adam, i):
    out = torch.empty(SIZES[i], dtype=torch.bfloat16)
    adam.load_parameters(i, out.data_ptr(), out.numel(), "bfloat16")
    return out


def at(address, n):
    """n bf16 values at a host address the SDK gave (the emulation's "device" memory)."""
    raw = (ctypes.c_uint8 * (2 * n)).from_address(address)
    return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16)


def close(*objs):
    for o in objs:
        o.close()


def test_parameters_come_whole_and_read_ahead_follows_the_recorded_order(tmp_path):
    vol, store, adam = make_adam(tmp_path, "params")
    dev = _core.DeviceParameters(adam, device_budget=8 << 20, read_ahead=2 * SIZES[1] + 4096,
                                 emulate=True)
    for sweep in range(2):
        for i in range(3):
            address, n, dtype = dev.acquire(i)
            assert (n, dtype) == (SIZES[i], "bf16")
            assert torch.equal(at(address, n), stored(adam, i))
            dev.release(i)
        for i in range(3):
            dev.invalidate(i)
    s = dev.stats()
    assert s["recorded_groups"] == 3 and s["acquires"] == 6
    assert s["read_ahead"] >= 1 and s["hits"] >= 1  # the second sweep found groups ahead
    # The host's time: every acquire's, of which the store's reads (a part being written
    # back waited for) and the waits for earlier copies (none here: the budget has room).
    assert s["acquire_seconds"] >= s["read_seconds"] > 0
    assert s["copy_wait_seconds"] == 0
    with pytest.raises(errors.FailedPreconditionError, match="close them first"):
        adam.close()  # the device object still uses it
    close(dev, adam, store, vol)


def test_a_copy_only_object_writes_into_the_callers_memory(tmp_path):
    vol, store, adam = make_adam(tmp_path, "copy")
    dev = _core.DeviceParameters(adam, device_budget=0, emulate=True)
    out = torch.empty(SIZES[1], dtype=torch.bfloat16)
    dev.copy_to(1, out.data_ptr())
    assert torch.equal(out, stored(adam, 1))
    with pytest.raises(errors.FailedPreconditionError, match="CopyTo only"):
        dev.acquire(0)
    close(dev, adam, store, vol)


def test_derived_parameters_are_refused_for_the_device(tmp_path):
    vol, store, adam = make_adam(tmp_path, "derived", store_parameters=None)
    adam.close()
    store.close()
    vol.close()
    vol = _core.Volume.open_or_create(str(tmp_path / "derived32.vol"), 64 << 20)
    store = _core.TensorStore(vol, host_budget=16 << 20)
    adam = _core.OffloadedAdam(store, [("g0", PART)], "float32", "float32", PART, [1e-3], [0.0],
                               0.9, 0.999, 1e-8, 0.0, False, 1.0, 0, 0, 1)
    with pytest.raises(errors.FailedPreconditionError, match="store_parameters"):
        _core.DeviceParameters(adam, device_budget=1 << 20, emulate=True)
    close(adam, store, vol)


def test_gradients_offloaded_train_as_set_gradient(tmp_path):
    va, sa, a = make_adam(tmp_path, "set")
    vb, sb, b = make_adam(tmp_path, "offload")
    grads = _core.DeviceGradients(b, max_inflight=2 * PART * 2, emulate=True)
    for step in range(1, 3):
        a.begin_backward(0.0)
        b.begin_backward(0.0)
        device = []
        for i in reversed(range(3)):
            g = (torch.randn(SIZES[i], generator=torch.Generator().manual_seed(step * 10 + i))
                 * 0.05).to(torch.bfloat16)
            a.set_gradient(i, g.data_ptr(), g.numel(), "bfloat16")
            device.append(g)  # kept: the "device" memory must outlive the copy
            grads.offload(i, g.data_ptr(), g.numel(), "bfloat16")
        grads.finish()
        for opt in (a, b):
            assert not opt.end_backward(1.0)["skipped"]
            for i in range(3):
                opt.update_group(i)
            opt.commit(step)
    for i in range(3):
        assert torch.equal(stored(a, i), stored(b, i))
    assert grads.stats()["groups"] == 6
    with pytest.raises(errors.InvalidArgumentError, match="convert it on the device"):
        f = torch.zeros(SIZES[0])
        grads.offload(0, f.data_ptr(), f.numel(), "float32")
    close(grads, a, sa, va, b, sb, vb)


def test_pending_leases_let_go_of_each_lease_after_its_own_copy_whatever_the_threads():
    # Autograd runs backward hooks on a thread per device: while one thread waits for the
    # oldest copy, another may reap. Each lease goes only once its own event is done.
    import threading
    from memascend.torch.cuda import PendingLeases

    class Event:  # a copy's event: done once `done` is set; a wait also needs `gate`
        def __init__(self):
            self.done, self.gate = threading.Event(), threading.Event()
            self.waited = threading.Event()

        def query(self):
            return self.done.is_set()

        def synchronize(self):
            self.waited.set()
            self.done.wait()
            self.gate.wait()

    class Lease:
        def __init__(self, event):
            self.event, self.released_early = event, None

        def release(self):
            self.released_early = not self.event.done.is_set()

    first, second = Event(), Event()
    leases = [Lease(first), Lease(second)]
    pending = PendingLeases()
    pending.add(first, leases[0], 10, "a")
    pending.add(second, leases[1], 10, "b")
    # 20 bytes held, over a limit of 15: waits for the oldest, which leaves 10
    waiter = threading.Thread(target=pending.reap, kwargs={"limit": 15}, daemon=True)
    waiter.start()
    assert first.waited.wait(timeout=10)
    first.done.set()
    pending.reap()  # another thread, meanwhile: the first is done, the second is not
    first.gate.set()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert leases[0].released_early is False
    assert leases[1].released_early is not True  # not let go before its copy
    second.done.set()
    second.gate.set()
    pending.drain()
    assert leases[1].released_early is False and pending.bytes == 0
