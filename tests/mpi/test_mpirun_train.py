"""memascend-train under mpirun (Note [data parallel] in examples/offload_train/data_parallel.cpp):
two ranks train as one process of the same global batch; a rank killed with SIGKILL stops
the job; --resume on every rank continues with the uninterrupted run's losses."""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest

TRAIN = os.environ.get("MEMASCEND_TRAIN", "")
MPIRUN = os.environ.get("MEMASCEND_MPIEXEC") or shutil.which("mpirun")

pytestmark = pytest.mark.skipif(
    not TRAIN or not MPIRUN, reason="mpirun (openmpi-bin) or memascend-train is not available")

# OpenMPI refuses root unless told; CI runs as root. Two cores: oversubscribed.
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
MODEL = ["--vocab", "256", "--channels", "32", "--layers", "2", "--heads", "2", "--seq", "16",
         "--batch", "4", "--sample", "0", "--matmul", "exact", "--threads", "1",
         "--optimizer-chunk", "262144"]


def mpirun(n, *args):
    return [MPIRUN, "--oversubscribe", "-np", str(n), TRAIN, *MODEL, *args]


def run_json(cmd, timeout=300):
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1, "rank 0 alone prints the summary:\n" + p.stdout
    return json.loads(lines[0])


def test_two_ranks_train_as_one_process(tmp_path):
    one = run_json([TRAIN, *MODEL, "--steps", "8", "--json", "--volume", str(tmp_path / "one.vol")])
    two = run_json(mpirun(2, "--steps", "8", "--json", "--volume",
                          str(tmp_path / "rank{rank}.vol")))
    assert two["world"] == 2 and len(two["ranks"]) == 2
    assert (tmp_path / "rank0.vol").exists() and (tmp_path / "rank1.vol").exists()
    assert sum(r["state_elements"] for r in two["ranks"]) == one["params"]
    assert all(r["comm_bytes_per_step"] > 0 for r in two["ranks"])
    # The rows of the batch are summed in another order: rounding, no more.
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    # A rank count's run repeats exactly.
    again = run_json(mpirun(2, "--steps", "8", "--json", "--force", "--volume",
                            str(tmp_path / "rank{rank}.vol")))
    assert again["losses"] == two["losses"]


def test_an_error_on_the_ranks_is_named_and_stops_the_job(tmp_path):
    p = subprocess.run(mpirun(2, "--batch", "3", "--steps", "2", "--volume",
                              str(tmp_path / "rank{rank}.vol")),
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    # Whichever rank stops first stops the other.
    assert re.search(r"rank [01] of 2: --batch 3 \(the global batch\) does not divide among 2 "
                     r"ranks: give a multiple of 2", p.stderr), p.stderr


def rank_pid(rank, volume_dir):
    """The pid of memascend-train's rank `rank` of the job writing to `volume_dir`."""
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (cmdline and cmdline[0].endswith(b"memascend-train")
                and any(str(volume_dir).encode() in a for a in cmdline)
                and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ):
            return int(proc.name)
    return None


def test_a_killed_rank_stops_the_job_and_resume_continues_on_every_rank(tmp_path):
    steps = "100"
    whole = run_json(mpirun(2, "--steps", steps, "--json", "--volume",
                            str(tmp_path / "whole{rank}.vol")))
    vol = tmp_path / "run"
    vol.mkdir()
    cmd = mpirun(2, "--steps", steps, "--json", "--volume", str(vol / "rank{rank}.vol"))
    job = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    # Rank 0's progress (stderr, with --json): kill rank 1 once step 5 is committed.
    killed = False
    for line in job.stderr:
        if line.startswith("step ") and int(line.split()[1]) >= 5:
            pid = rank_pid(1, vol)
            assert pid is not None, "rank 1 not found"
            os.kill(pid, signal.SIGKILL)
            killed = True
            break
    assert killed, "the run ended before step 5"
    out, err = job.communicate(timeout=120)
    assert job.returncode != 0, "the job went on without rank 1"
    assert "signal 9" in err or "Killed" in err, err  # mpirun names the rank that died
    resumed = run_json(mpirun(2, "--steps", steps, "--json", "--resume", "--volume",
                              str(vol / "rank{rank}.vol")))
    first = resumed["first_step"]
    assert 5 <= first <= int(steps)
    assert resumed["losses"] == whole["losses"][first - 1:]
