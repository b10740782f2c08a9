"""docs/python.md's "A complete example", run as it is written, as a user's first hour
would: in a child process as user nobody (no CAP_IPC_LOCK) under Debian's default
`ulimit -l` of 8 MiB, then again to resume from its volume.

The block is read from the docs, not copied, and run as it is written: its `/nvme/` paths
point into a temporary folder, and its `total_steps` is the test's. ctest passes the source tree in
MEMASCEND_SOURCE_DIR (else the tree this file is in).
"""
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (Debian: python3-torch)")

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("MEMASCEND_SOURCE_DIR", os.path.join(HERE, "..", ".."))
DOC = os.path.join(SOURCE, "docs", "python.md")


def complete_example():
    with open(DOC) as f:
        text = f.read()
    m = re.search(r"^## A complete example\n.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/python.md has no ```python block under '## A complete example'"
    return m.group(1)


# What the example leaves to the reader, then the example itself under warnings that are
# recorded; prints what the test checks.
CHILD = r"""
import math, sys, warnings
from memascend import errors

EXAMPLE = EXAMPLE.replace("total_steps = 20", f"total_steps = {int(sys.argv[2])}")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(compile(EXAMPLE, "docs/python.md (A complete example)", "exec"))
print("start", start)
print("steps", opt.steps)
print("loss", loss.item())
print("activation_locked", act_store.host_budget_locked)
memlock = [str(w.message) for w in caught if issubclass(w.category, errors.MemlockWarning)]
print("memlock_warnings", len(memlock), len(set(memlock)))
for w in memlock:
    print("warning", w)
"""


def run_as_a_user(work, total_steps):
    if os.geteuid() == 0:
        # nobody: no CAP_IPC_LOCK, as a Debian user (root's CAP_IPC_LOCK ignores the limit).
        run = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               "--bounding-set=-ipc_lock", "--"]
    else:
        run = []
    script = os.path.join(work, "example.py")
    out = subprocess.run(
        ["sh", "-c", "ulimit -l 8192 && exec \"$@\"", "sh", *run, sys.executable, script,
         HERE, str(total_steps)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines()
                if " " in line and not line.startswith("warning "))


def test_the_complete_example_trains_and_resumes_as_a_user_under_an_8_mib_memlock_limit():
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root, and no setpriv to drop to user nobody")
    example = complete_example()
    assert "/nvme/" in example and "total_steps = 20" in example  # what the test moves
    work = tempfile.mkdtemp(prefix="memascend-example-")
    try:
        os.chmod(work, 0o777)
        example = example.replace("/nvme/", work + "/")
        with open(os.path.join(work, "example.py"), "w") as f:
            f.write(f"EXAMPLE = {example!r}\n" + CHILD)

        first = run_as_a_user(work, total_steps=3)
        assert first["start"] == "0"
        assert first["steps"] == "3"
        assert math.isfinite(float(first["loss"]))
        # The activation store's 512 MiB is past the limit: ordinary memory, one warning;
        # the optimizer's default budget warns once more only if it is past it too.
        assert first["activation_locked"] == "False"
        count, distinct = map(int, first["memlock_warnings"].split())
        assert 1 <= count <= 2 and distinct == count, first

        again = run_as_a_user(work, total_steps=5)  # resume=True: from the committed step
        assert again["start"] == "3"
        assert again["steps"] == "5"
        assert math.isfinite(float(again["loss"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
