"""OffloadedAdamW with no host_budget (memascend Note [default host budget]): the budget
comes from the machine, says why, trains under an 8 MiB RLIMIT_MEMLOCK on unlocked memory
with one MemlockWarning, and a given budget past the memory limit is refused."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import memascend.torch as mt
from memascend import _core, errors

# A state well above 8 MiB (1 M fp32 parameters: 16 MiB of master weights and moments),
# trained for two steps; prints what the optimizer chose and the warnings it gave.
CHILD = r"""
import sys, warnings
import torch
import memascend.torch as mt
from memascend import errors
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=sys.argv[1])
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
    opt.close()
memlock = [w for w in caught if issubclass(w.category, errors.MemlockWarning)]
print("warnings", len(memlock))
for w in memlock:
    print("warning", w.message)
print("locked", opt.host_budget_locked)
print("budget", opt.host_budget)
print("reason", opt.host_budget_reason)
"""


def test_default_budget_comes_from_the_machine(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, volume=str(tmp_path / "a.vol"))
    try:
        assert opt.host_budget > 0
        assert opt.host_budget_reason  # which limit decided, or that the state fits
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    finally:
        opt.close()


def test_given_budget_above_the_memory_limit_is_refused():
    with pytest.raises(errors.ResourceExhaustedError) as e:
        _core.choose_host_budget(1 << 20, 1 << 55, 0, given=1 << 54)
    assert "more than the memory limit" in str(e.value)
    assert "MemTotal" in str(e.value) or "cgroup memory" in str(e.value)


def test_a_budget_that_cannot_fit_says_so():
    with pytest.raises(errors.ResourceExhaustedError, match="does not fit"):
        _core.choose_host_budget(1 << 55, 1 << 56, 0)


def test_under_an_8_mib_memlock_limit_the_default_trains_unlocked():
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop to user nobody")
        # nobody: no CAP_IPC_LOCK, as a Debian user (root's CAP_IPC_LOCK ignores the limit).
        run = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               "--bounding-set=-ipc_lock", "--"]
    else:
        run = []
    work = tempfile.mkdtemp(prefix="memascend-memlock-")
    try:
        os.chmod(work, 0o777)
        script = os.path.join(work, "child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        os.chmod(script, 0o644)
        cmd = "ulimit -l 8192 && exec \"$@\""
        out = subprocess.run(
            ["sh", "-c", cmd, "sh", *run, sys.executable, script, os.path.join(work, "run.vol")],
            capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert out.returncode == 0, out.stdout + out.stderr
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line
                     and not line.startswith("warning "))
        assert lines["warnings"] == "1", out.stdout
        assert lines["locked"] == "False", out.stdout
        assert "RLIMIT_MEMLOCK" in lines["reason"], out.stdout
        for want in ("ulimit -l", "LimitMEMLOCK=", "--ulimit memlock=-1"):
            assert want in out.stdout, out.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)
