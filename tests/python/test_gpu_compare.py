"""bench/gpu/compare.py on the CPU at a tiny size (2 layers, hidden 64, seq 32, 3 steps):
the plain-torch reference (the torch-gpu row, here on the CPU) and memascend at one budget
train the same losses; every run leaves a record with the fields the GPU comparison
reads; FSDP2 and DeepSpeed, which Debian's torch 1.13 cannot run, are recorded skipped with
the reason."""
import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("memascend.torch")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu",
                      "compare.py")
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "172", "--vocab", "256", "--seq", "32", "--batch", "2",
        "--steps", "3", "--seed", "7", "--run-timeout", "120"]
FIELDS = ["system", "model", "device", "commit", "command", "peak_rss_bytes",
          "cgroup_peak_bytes", "gpu_peak_bytes", "tokens_per_s", "losses", "step_seconds",
          "io_bytes_per_step", "mfu", "order", "run_index", "void"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    env = dict(os.environ, MEMASCEND_COMMIT="test")
    p = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--budgets", "25",
                        "--commit-every", "2", "--io-threads", "3", "--ds-aio", "1M:8",
                        "--cpu-kernels-elements", "1M"]
                       + TINY, capture_output=True, text=True, env=env,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    records = {}
    for path in glob.glob(str(out / "compare-[0-9]*.json")):
        r = json.load(open(path))
        records[r["system"]] = r
    return out, records


def test_every_system_leaves_one_record_in_the_recorded_order(run):
    out, records = run
    assert set(records) == {"torch-gpu", "fsdp2-offload", "deepspeed-zero-infinity", "memascend"}
    summary = json.load(open(out / "compare-summary.json"))
    assert sorted(summary["order"]) == sorted(["torch-gpu", "fsdp2-offload",
                                               "memascend-25pct-c2-t3",
                                               "deepspeed-zero-infinity-1Mx8"])
    assert records["memascend"]["io_threads"] == 3  # the store's I/O threads (--io-threads)
    assert summary["seed"] == 7 and summary["reference"] == "torch-gpu"
    for r in records.values():
        assert r["order"] == summary["order"]
        assert summary["order"][r["run_index"]].startswith(r["system"])
    assert not os.listdir(out / "scratch")  # each run's volumes removed after it


def test_the_trained_rows_carry_the_figures_and_agree_on_the_losses(run):
    _, records = run
    ref = records["torch-gpu"]
    for name in ("torch-gpu", "memascend"):
        r = records[name]
        for k in FIELDS:
            assert k in r, (name, k)
        assert "llama" in r["model"] and r["device"].startswith("CPU")
        assert r["commit"]
        assert len(r["losses"]) == len(r["step_seconds"]) == 3
        assert r["peak_rss_bytes"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert r["ceiling"]["label"].startswith("CPU float32 matmul")
        assert r["void"] is False and r["loss_rel_diff_max"] <= 1e-2
        for x, y in zip(r["losses"], ref["losses"]):
            assert abs(x - y) <= 1e-2 * abs(y)
    budget = records["memascend"]["budget"]
    assert budget["percent_of_state"] == 25 and budget["bytes"] > 0
    assert records["memascend"]["memascend_pinned_peak_bytes"] > 0
    assert records["memascend"]["io_bytes_per_step"]["write"] >= 0
    # Note [commit interval]: every second step durable, the last one made so at the end
    assert records["memascend"]["commit_every"] == 2
    assert records["memascend"]["staging"] == "bounded"  # the default (--staging)
    assert records["memascend"]["units"] == "layer"  # a decoder layer loaded whole
    stats = records["memascend"]["memascend_stats"]
    assert stats["durable_step"] == 3 and stats["deferred_steps"] == 0
    # Each step's forward+backward apart (here the host's time), memascend's phases per step
    # (Note [step times]), and its step over the reference's forward+backward.
    for name in ("torch-gpu", "memascend"):
        r = records[name]
        assert len(r["forward_backward_seconds"]) == 3
        assert all(0 < fb <= t for fb, t in zip(r["forward_backward_seconds"], r["step_seconds"]))
        # os.times() counts in clock ticks (10 ms): a tiny step may read 0
        assert len(r["cpu_seconds"]) == 3 and all(c >= 0 for c in r["cpu_seconds"])
        assert sum(r["cpu_seconds"]) > 0
    phases = records["memascend"]["step_phases"]
    assert len(phases) == 3 and all(p["update"] >= p["update_kernels"] >= 0 for p in phases)
    assert sum(p["update_kernels"] for p in phases) > 0
    assert records["memascend"]["step_over_forward_backward"] > 0
    assert "h2d_ratio" not in records["memascend"]  # no parameter loads to a device here
    # The CPU update's rate against the kernel's ceiling measured in the call (`memascend
    # bench kernels`, found through MEMASCEND_CLI, which ctest sets, or a build's).
    m = records["memascend"]
    assert m["update_kernels_seconds"] > 0 and m["update_gbps"] > 0
    ceiling = m["ceiling"]
    if os.environ.get("MEMASCEND_CLI"):
        assert ceiling.get("cpu_adam_parts_gbps", 0) > 0 or "AVX2" in ceiling["cpu_kernels_error"], \
            ceiling
    if ceiling.get("cpu_adam_parts_gbps"):
        assert ceiling["cpu_adam_part_elements"] == 1 << 20
        # measured on the update's threads: torch's default, which the optimizer takes
        assert ceiling["cpu_threads"] == m["update_threads"] >= 1
        assert m["update_over_cpu_adam_parts"] > 0
    assert m["offload_gradients"] is True  # one micro-batch a step


def test_memascends_traced_step_is_drawn_as_a_timeline(run):
    """The third step's spans (memascend.torch.StepTrace): the update of every group and
    the loads before each module's forward, the modules' forward, recomputation and
    backward, opt.step(); all inside the step, and drawn as an SVG."""
    out, records = run
    trace = records["memascend"]["trace"]
    assert trace["step"] == 2
    spans = trace["spans"]
    lanes = {lane for lane, _, _, _ in spans}
    assert lanes == {"update", "load", "compute", "step"}
    names = [name for lane, name, _, _ in spans if lane == "compute"]
    assert any(n.startswith("fwd ") for n in names) and any(n.startswith("bwd ") for n in names)
    assert any(n.startswith("recompute ") for n in names)  # activation checkpointing
    for _, _, begin, end in spans:
        assert 0 <= begin <= end <= trace["seconds"] * 1.01
    # Every group was updated once, before its parameters were loaded.
    groups = [name for lane, name, _, _ in spans if lane == "update" and name != "the rest"]
    covered = []
    for g in groups:
        first, last = map(int, g.split()[1].split("-"))
        covered += range(first, last + 1)
    assert covered == sorted(set(covered)) and covered[0] == 0
    assert "trace" not in records["torch-gpu"]
    svg = open(glob.glob(str(out / "timeline-*memascend*.svg"))[0]).read()
    assert svg.startswith("<svg") and svg.count("<rect") == len(spans)


def test_systems_torch_1_13_cannot_run_are_skipped_with_the_reason(run):
    import torch
    _, records = run
    if not torch.__version__.startswith("1."):
        pytest.skip("FSDP2 imports in this torch")
    fsdp, ds = records["fsdp2-offload"], records["deepspeed-zero-infinity"]
    assert fsdp["skipped"] is True and "FSDP2" in fsdp["reason"]
    # Without a GPU, whether or not deepspeed imports, ZeRO-Infinity is not run.
    assert ds["skipped"] is True and ("import deepspeed" in ds["reason"] or
                                      "CUDA" in ds["reason"])
    for r in (fsdp, ds):
        assert r["void"] is None and "losses" not in r


# ---- tools/device/deepspeed_bundle.py: the environment bench-gpu's workers get --------
TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "device")


def deepspeed_bundle():
    sys.path.insert(0, TOOLS)
    try:
        import deepspeed_bundle as m
    finally:
        sys.path.remove(TOOLS)
    return m


def test_the_deepspeed_bundle_env_adds_fallbacks_only_for_what_is_missing(tmp_path):
    m = deepspeed_bundle()
    b = str(tmp_path)
    env, notes = m.environ(b, {"PYTHONPATH": "/mine", "PATH": "/usr/bin", "CPATH": "/inc"},
                           has_module=lambda name: name == "pydantic", has_ninja=lambda: False)
    assert env["PYTHONPATH"].split(":") == [f"{b}/python", "/mine", f"{b}/fallback/cpuinfo",
                                            f"{b}/fallback/tqdm"]
    assert env["PATH"] == f"/usr/bin:{b}/bin" and env["CPATH"] == f"/inc:{b}/include"
    assert env["LIBRARY_PATH"] == env["LD_LIBRARY_PATH"] == f"{b}/lib"
    assert env["DS_SKIP_CUDA_CHECK"] == "1"
    assert notes["fallbacks"] == ["cpuinfo", "tqdm"] and notes["ninja_from_bundle"] is True
    env, notes = m.environ(b, {"PATH": "/usr/bin", "DS_SKIP_CUDA_CHECK": "0"},
                           has_module=lambda name: True, has_ninja=lambda: True)
    assert env["PYTHONPATH"] == f"{b}/python" and env["PATH"] == "/usr/bin"
    assert env["DS_SKIP_CUDA_CHECK"] == "0" and notes["fallbacks"] == []


def test_the_deepspeed_bundle_env_sh_agrees_with_environ(tmp_path):
    m = deepspeed_bundle()
    b = str(tmp_path)
    m.write_env_sh(b)
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": "/mine", "DS_PYTHON": sys.executable}
    p = subprocess.run(["bash", "-c", f". {b}/env.sh && env -0"], env=base,
                       capture_output=True, text=True, check=True)
    got = dict(kv.split("=", 1) for kv in p.stdout.split("\0") if "=" in kv)
    # The fallbacks as env.sh probes them: with sys.executable and no PYTHONPATH of ours.
    probe = {name: subprocess.run([sys.executable, "-c", f"import {name}"],
                                  capture_output=True).returncode == 0 for name in m.FALLBACK}
    want, _ = m.environ(b, base, has_module=probe.get)
    for key in ("PYTHONPATH", "PATH", "CPATH", "LIBRARY_PATH", "LD_LIBRARY_PATH",
                "DS_SKIP_CUDA_CHECK"):
        assert got.get(key) == want.get(key), key


def test_the_hjson_shim_reads_a_deepspeed_config_as_json(tmp_path):
    m = deepspeed_bundle()
    ns = {}
    exec(compile(m.HJSON, "hjson.py", "exec"), ns)
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}')

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)
    with open(path) as f:
        cfg = ns["load"](f, object_pairs_hook=no_duplicates)
    assert cfg == ns["loads"](path.read_text()) and cfg["zero_optimization"]["stage"] == 3
    with pytest.raises(AssertionError):
        ns["loads"]('{"a": 1, "a": 2}', object_pairs_hook=no_duplicates)


def test_a_commit_interval_is_timed_over_whole_intervals(run):
    # memascend Note [commit interval]: the median would leave out the steps that wait for
    # the interval's commit; the mean over whole intervals holds one per interval.
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from common import steady_step
    assert steady_step([1, 1, 5, 1, 1, 5, 1]) == (1, "median step")
    t, basis = steady_step([1, 1, 5, 1, 1, 5, 1], 3)
    assert t == 14 / 6 and basis == "mean of 6 steps, 2 whole commit interval(s) of 3"
    assert steady_step([2, 4], 3) == (3, "mean of 2 steps, under one commit interval of 3")
    _, records = run
    assert records["memascend"]["step_basis"] == "mean of 2 steps, 1 whole commit interval(s) of 2"
    assert records["torch-gpu"]["step_basis"] == "median step"


def test_the_path_bench_profiles_the_launching_thread():
    """bench/gpu/path.py's host_profile: fn's result, and its functions by their own time
    (the fifth H200 lease's path ran its backward at the host's pace, unattributed)."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import path

    def busy(n):
        return sum(i * i for i in range(n))

    def work():
        return busy(200000) + busy(10)

    result, rows = path.host_profile(work, top=5)
    assert result == busy(200000) + busy(10)
    assert len(rows) <= 5
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    named = {r[0].split("(")[-1].rstrip(")"): r for r in rows}
    assert "<genexpr>" in named and named["<genexpr>"][1] > 200000  # calls counted
    assert all(r[3] >= r[2] >= 0 for r in rows)  # cumulative covers own


def test_the_path_bench_times_whole_commit_intervals():
    """bench/gpu/path.py's window (step_window): steps 5 to the last of 8 with a commit
    every 4th would hold one commit in three steps (the fourth H200 lease's record said
    2.22 where the whole interval says 2.0); it reaches back to hold one whole interval."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import path
    steps = list(range(8))
    assert steps[path.step_window(8, 1)] == [5, 6, 7]
    assert steps[path.step_window(8, 4)] == [4, 5, 6, 7]
    assert list(range(20))[path.step_window(20, 4)] == list(range(8, 20))
    assert list(range(3))[path.step_window(3, 4)] == [1, 2]  # no whole interval: not step 0
    assert list(range(8))[path.step_window(8, 8)] == [1, 2, 3, 4, 5, 6, 7]
    assert list(range(1))[path.step_window(1, 4)] == [0]  # one step: that one
    assert list(range(1))[path.step_window(1, 1)] == [0]
    times = [4.58, 1.35, 1.06, 1.11, 1.34, 3.53, 1.35, 1.73]  # that record's steps
    from common import steady_step
    t, basis = steady_step(times[path.step_window(8, 4)], 4)
    assert abs(t - (1.34 + 3.53 + 1.35 + 1.73) / 4) < 1e-12
    assert basis == "mean of 4 steps, 1 whole commit interval(s) of 4"
    # The step that waits for no commit: the window less its slowest step an interval,
    # not a median that lands on a commit once half the steps carry one (every 2nd).
    assert path.between_commits(times[path.step_window(8, 4)], 4) == 1.35
    assert path.between_commits([1, 3, 1, 3, 1, 3, 1, 3], 2) == 1
    assert path.between_commits([1, 3, 1, 3], 1) is None  # every step commits


def test_a_worker_that_stalls_says_where():
    """systems.stall: with no step done for --stall-dump seconds a worker prints every
    Python thread's stack to stderr (kept in log_tail), once each time the period passes;
    disarmed, it prints no more."""
    code = ("import sys, argparse, time; sys.path.insert(0, %r); import systems\n"
            "a = argparse.Namespace(stall_dump=1)\n"
            "systems.stall(a); time.sleep(1.5)\n"
            "systems.stall(a, done=True); time.sleep(1.5)\n") % os.path.dirname(SCRIPT)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("Timeout (0:00:01)!") == 1
    assert "most recent call first" in p.stderr and "<string>" in p.stderr


def test_a_killed_run_keeps_the_steps_it_printed():
    """A run the parent kills (--time-budget) leaves no record; what it printed of its steps
    (systems.train's lines, parsed back by compare.partial) is kept, as DeepSpeed's first
    H200 run needed."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import compare
    out = ("[deepspeed-zero-infinity] step 0: loss 12.16171, 11.466 s, VmHWM 9000\n"
           "[2026-11-26 18:15:42,307] [INFO] noise\n"
           "[deepspeed-zero-infinity] step 1: loss 12.17725, 10.907 s, VmHWM 9100\n")
    p = compare.partial(out)["partial"]
    assert p["steps_done"] == 2
    assert p["losses"] == [12.16171, 12.17725] and p["step_seconds"] == [11.466, 10.907]
    assert p["peak_rss_bytes_so_far"] == 9100
    assert compare.partial("no step finished\n") == {}
    # The worker's own line is what the parser reads.
    line = "[memascend] step 3: loss 5.00000, 0.250 s, VmHWM 12345"
    assert compare.STEP_LINE.match(line).groups() == ("3", "5.00000", "0.250", "12345")


def test_the_calls_are_summarized_in_one_table_and_plot(run, tmp_path):
    """The call's own plot, and --summarize over its directory (as over several calls'):
    a line per run, a mark per run that trained."""
    out, records = run
    assert open(out / "compare.svg").read().startswith("<svg")
    p = subprocess.run([sys.executable, SCRIPT, "--summarize", str(out), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    table = open(tmp_path / "compare-table.md").read()
    assert table == p.stdout
    for system in records:
        assert f"| {system}" in table
    svg = open(tmp_path / "compare.svg").read()
    trained = [r for r in records.values() if r.get("tokens_per_s")]
    assert svg.count("<circle") == len(trained) >= 2


def test_the_commit_bench_times_each_depth_and_the_disk(tmp_path):
    """bench/commit.py: a run per depth and repetition in a random order, each commit of a
    whole state in memory timed by its own counter of bytes written (14 bytes a parameter:
    master weights, moments, 16-bit parameters), the disk's ceiling beside them, and each
    depth's median over it."""
    cli = os.environ.get("MEMASCEND_CLI")
    if not cli:
        found = [os.path.join(os.path.dirname(SCRIPT), "..", "..", "build", b, "tools",
                              "memascend")
                 for b in ("test", "release", "ci")]
        cli = next((c for c in found if os.access(c, os.X_OK)), None)
    out = tmp_path / "commit.json"
    bench = os.path.join(os.path.dirname(SCRIPT), "..", "commit.py")
    cmd = [sys.executable, bench, "--dir", str(tmp_path / "d"), "--params", "4M", "--depths",
           "1,4", "--reps", "1", "--commits", "2", "--out", str(out), "--seed", "3"] + (
               ["--cli", cli] if cli else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert sorted(r["order"]) == [1, 4] and r["seed"] == 3 and r["commit"]
    for run in r["runs"]:
        assert run["params"] == 4 << 20 and len(run["commits"]) == 2
        for c in run["commits"]:
            assert c["bytes"] >= 14 * run["params"] and c["seconds"] > 0
    assert set(r["by_depth"]) == {"1", "4"}
    if cli:  # through threads at least (a build or a run without io_uring: its error kept)
        ok = [c for c in r["ceilings"] if "gb_per_s" in c]
        assert {(c["backend"], c["rewrite"]) for c in ok} >= {("threads", False),
                                                              ("threads", True)}
        assert all("error" in c for c in r["ceilings"] if "gb_per_s" not in c)
        assert r["ceiling_gb_per_s"] == max(c["gb_per_s"] for c in ok) > 0
        assert all(d["over_ceiling"] > 0 for d in r["by_depth"].values())
    assert not os.listdir(tmp_path / "d")  # its volumes and files removed


def test_the_path_bench_counts_each_steps_waits(tmp_path):
    """bench/gpu/path.py's step_counters: the COUNTERS it takes from opt.stats() are in the
    store's and the device parameters' stats (the fifth lease's commit step took twice a
    plain one, with nothing that said where it waited)."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import path
    from memascend import _core
    vol = _core.Volume.open_or_create(str(tmp_path / "c.vol"), 16 << 20)
    store = _core.TensorStore(vol, host_budget=4 << 20)
    adam = _core.OffloadedAdam(store, [("g0", 1 << 16)], "bfloat16", "bfloat16", 1 << 16,
                               [1e-3], [0.0], 0.9, 0.999, 1e-8, 0.0, False, 1.0, 0, 0, 1, True)
    adam.commit(0)
    dev = _core.DeviceParameters(adam, device_budget=1 << 20, emulate=True)
    dev.acquire(0)
    dev.release(0)
    c = path.counters({"store": store.stats(), "device_parameters": dev.stats()})
    assert set(c) == {f"{k}.{n}" for k, names in path.COUNTERS.items() for n in names} | {
        "host.steal_seconds", "host.involuntary_switches", "host.voluntary_switches"}
    assert c["host.voluntary_switches"] >= 0 and c["host.steal_seconds"] >= 0
    assert c["device_parameters.bytes_to_device"] == 2 << 16 and c["device_parameters.misses"] == 1
    assert c["device_parameters.acquire_seconds"] >= c["device_parameters.read_seconds"] > 0
    assert c["store.stall_seconds"] >= 0
    for o in (dev, adam, store, vol):
        o.close()


def test_the_path_bench_says_whose_cpu_time_it_was(tmp_path):
    """bench/gpu/path.py's thread_cpu_seconds: a step's CPU time by thread name (the fifth
    lease's host took twice the step's wall time, with nothing that said which thread); the
    SDK's threads name themselves "ma-..."."""
    import threading
    import time
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import common
    from memascend import _core
    def spin(seconds=0.2):  # the calling thread's CPU, and no other's
        t = time.thread_time()
        while time.thread_time() - t < seconds:
            pass

    def store_threads():
        return [n for n, _ in common.thread_cpu_seconds().values()].count("ma-store-io")

    earlier = store_threads()  # another test's store, if one is still open
    vol = _core.Volume.open_or_create(str(tmp_path / "t.vol"), 16 << 20)
    store = _core.TensorStore(vol, host_budget=4 << 20, prefetch_threads=2)
    try:
        until = time.monotonic() + 10  # the store's threads name themselves as they start
        while store_threads() - earlier < 2 and time.monotonic() < until:
            time.sleep(0.01)
        assert store_threads() - earlier == 2
        before, cpu = common.thread_cpu_seconds(), common.cpu_seconds()
        spin()
        delta = common.thread_cpu_delta(before, common.thread_cpu_seconds(),
                                        common.cpu_seconds() - cpu)
        me = common.thread_cpu_seconds()[threading.get_native_id()][0]
        assert delta[me] >= 0.15, delta
        assert list(delta)[0] == me  # busiest first
        assert "ma-store-io" not in delta  # idle: under 10 ms
        # A thread that ended in between is counted as one: its CPU is the process's.
        ended = threading.Thread(target=spin)
        before, cpu = common.thread_cpu_seconds(), common.cpu_seconds()
        ended.start()
        ended.join()
        until = time.monotonic() + 10  # a joined thread leaves /proc a moment later
        while os.path.exists(f"/proc/self/task/{ended.native_id}") and time.monotonic() < until:
            time.sleep(0.01)
        delta = common.thread_cpu_delta(before, common.thread_cpu_seconds(),
                                        common.cpu_seconds() - cpu)
        assert delta.get("(ended threads)", 0) >= 0.1, delta
    finally:
        store.close()
        vol.close()


def _tiny_llama(seed=0):
    import torch
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import common
    import llama
    torch.manual_seed(seed)
    cfg = dict(common.LLAMA_1B, hidden_size=64, intermediate_size=172, vocab_size=256,
               num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    model = llama.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    return model


@pytest.mark.parametrize("chunk", [1, 37, 62, 1000])
def test_the_chunked_loss_is_the_models_own(chunk):
    """common.causal_lm_loss in pieces of `chunk` tokens (each recomputed in backward): the
    model's own loss and gradients, up to the order of the additions (2 sequences of 32:
    62 predicted tokens, so 62 and 1000 are one piece, 37 two unequal ones)."""
    import torch
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import common
    model = _tiny_llama()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    whole = common.causal_lm_loss(model, x, 0)
    whole.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    pieces = common.causal_lm_loss(model, x, chunk)
    pieces.backward()
    assert float(pieces) == pytest.approx(float(whole), rel=1e-6)
    for (name, p), g in zip(model.named_parameters(), want):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6), name


def test_offloaded_parameters_train_through_the_chunked_loss(tmp_path):
    """The head (tied to the embedding) called once a piece, and again in each piece's
    recomputation, under offload_parameters: the same losses as torch's AdamW on the same
    chunked loss (the path's --loss-chunk runs this way on the GPU)."""
    import torch
    import memascend.torch as mt
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import common
    x = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))] * 4

    after_backward = []

    def train(model, opt, offload=None):
        losses = []
        for t in x:
            loss = common.causal_lm_loss(model, t, 20)
            loss.backward()
            if offload is not None:
                after_backward.append(offload._backward)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses

    ref = _tiny_llama()
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01))
    model = _tiny_llama()
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                            volume=str(tmp_path / "chunked.vol"), host_budget=4 << 20,
                            part_elements=1 << 14)
    offload = mt.offload_parameters(model, opt)
    # The pieces call the head after the root's forward: every forward pass's loads must
    # be a forward pass's (on a GPU the direction steers the read-ahead), and a backward
    # pass's end says so by itself (it once stayed "backward" until the root's next
    # forward, which a loop calling submodules never makes).
    directions = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, i: directions.append(offload._backward))
    try:
        got = train(model, opt, offload)
    finally:
        hook.remove()
        offload.remove()
        opt.close()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert got[-1] < got[0]
    # Per step: the forward pass (False), then the layer's recomputation in backward (True).
    assert directions == [False, True] * len(x)
    assert after_backward == [False] * len(x)


def test_the_path_bench_sizes_its_chunked_ceiling_as_the_sdks_parts():
    """bench/gpu/path.py's PART_ELEMENTS (the parent does not import memascend) is
    memascend.torch's default part size, whose bf16 bytes the chunked ceiling copies."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import path
    from memascend.torch._common import DEFAULT_PART_ELEMENTS
    assert path.PART_ELEMENTS == DEFAULT_PART_ELEMENTS


def test_the_device_parameters_load_near_the_least_a_budget_allows(tmp_path):
    """bench/gpu/param_loads.py over the host emulation, Llama-3.2-1B's 16 layers at the
    defaults of offload_parameters (a budget of 0.85 of the model): between updates a
    micro-batch loads about what a budget that misses 0.15 of the model must, once a pass
    (0.30 of the model; the fifth H200 lease's eviction, least recently used, loaded 1.81);
    after an update, every group once more than that."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import param_loads
    r = param_loads.count(layers=16, scale=1024, micro_batches=6, workdir=str(tmp_path))
    assert abs(r["budget_fraction"] - 0.85) < 0.01
    least = 2 * (1 - r["budget_fraction"])
    steady = [m["models_loaded"] for m in r["micro_batches"] if not m["after_update"]]
    assert len(steady) == 4 and all(least - 0.01 <= x <= least + 0.05 for x in steady), steady
    # ...all of it read ahead: no acquire waits for its own copy (the lease's: 26 did).
    assert all(m["misses"] == 0 for m in r["micro_batches"] if not m["after_update"])
    after = [m["models_loaded"] for m in r["micro_batches"] if m["after_update"]]
    assert all(1.0 <= x <= 1.0 + least + 0.3 for x in after), after
    # 146 groups, 147 acquires a pass (the head takes the embedding again), two passes
    assert all(m["acquires"] == 2 * 147 for m in r["micro_batches"])
    # The loss in 16 pieces (the path's --loss-chunk): the head's embedding, used once a
    # piece forward and twice backward, stays resident: the same loads, 46 more acquires.
    pieces = param_loads.count(layers=16, scale=1024, micro_batches=6, workdir=str(tmp_path),
                               loss_pieces=16)
    assert [m["models_loaded"] for m in pieces["micro_batches"]] == pytest.approx(
        [m["models_loaded"] for m in r["micro_batches"]], rel=1e-3)
    assert all(m["misses"] == 0 for m in pieces["micro_batches"] if not m["after_update"])
    assert all(m["acquires"] == 2 * 147 + 15 + 31 for m in pieces["micro_batches"])


def test_the_fit_under_a_cap_stops_each_ladder_at_the_rung_the_kernel_kills(tmp_path):
    """--fit at a tiny size under a 400 MiB cap: 2 layers train, 3,000 (135 M fp32
    parameters a system builds first) are killed by the kernel at the cap, and that ends
    the ladder; the sequence ladder trains throughout. Skips where no cgroup can be made."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import cgroup
    probe, why = cgroup.make(f"memascend-test-probe-{os.getpid()}", 400 << 20)
    if probe is None:
        pytest.skip(f"no memory cgroup: {why}")
    probe.remove()
    p = subprocess.run([sys.executable, SCRIPT, "--fit", "--systems", "torch-gpu,memascend",
                        "--out", str(tmp_path), "--commit-every", "2",
                        "--cpu-kernels-elements", "1M", "--fit-layers", "2,3000,4",
                        "--fit-seqs", "32,64", "--fit-steps", "2", "--host-cap", "400M"]
                       + TINY, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.load(open(tmp_path / "fit-summary.json"))
    assert s["capped"] and s["host_cap_bytes"] == 400 << 20 and s["why_not_capped"] is None
    assert set(s["systems"]) == {"torch-gpu", "memascend-10pct-c2"}
    for name, o in s["systems"].items():
        assert [x["size"] for x in o["layers"]] == [2, 3000], name  # 4 never ran
        small, big = o["layers"]
        assert small["trains"] and small["parameters"] > 0 and small["cgroup_peak_bytes"] > 0
        assert not big["trains"] and big["oom_kills"] >= 1
        assert big["why"].startswith("killed at the cap")
        assert o["largest_layers"] == 2 and o["largest_parameters"] == small["parameters"]
        assert [x["trains"] for x in o["seq"]] == [True, True] and o["longest_seq"] == 64
        assert not o["layers_ladder_topped"] and o["seq_ladder_topped"]  # 64: "at least"
        assert "parameters_over_fsdp2" not in o  # no FSDP2 row ran
        record = json.load(open(tmp_path / f"fit-{name}-layers-3000.json"))
        assert record["cgroup_limit_bytes"] == 400 << 20 and record["exit"] == -9
    own, parent = cgroup._own()
    assert not [d for d in os.listdir(parent) if d.startswith("memascend-compare-")]


def test_the_fit_reports_bytes_per_parameter_and_token_where_no_cap_can_be_made():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import argparse
    import fit_under_cap
    a = argparse.Namespace(batch=2, accum=3)
    out = {"layers": [{"trains": True, "parameters": 1000, "peak_rss_bytes": 10_000},
                      {"trains": True, "parameters": 3000, "peak_rss_bytes": 42_000}],
           "seq": [{"trains": True, "size": 32, "peak_rss_bytes": 10_000},
                   {"trains": True, "size": 64, "peak_rss_bytes": 10_960}]}
    s = fit_under_cap.slopes(out, a)
    assert s == {"host_bytes_per_parameter": 16.0, "host_bytes_per_token": 5.0}
    out["seq"][1]["trains"] = False  # one size is no slope
    assert "host_bytes_per_token" not in fit_under_cap.slopes(out, a)


def test_the_step_staging_rows_are_planned_at_commit_interval_one():
    """--staging bounded,step: a row each for memascend durable every step (a commit
    interval above 1 stages whole versions anyway: one row), labelled, and the worker told."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import compare
    a = compare.parser().parse_args(["--systems", "memascend", "--budgets", "10,25",
                                     "--commit-every", "1,4", "--staging", "bounded,step"])
    runs = compare.plan(a)
    assert [compare.label(r) for r in runs] == [
        "memascend-10pct", "memascend-10pct-staged", "memascend-10pct-c4",
        "memascend-25pct", "memascend-25pct-staged", "memascend-25pct-c4"]
    parent = compare.Parent(a)
    parent.ceiling = {}
    cmd = parent.worker_cmd(runs[1], "/tmp/r.json", 1)
    assert "--staging-point=step" in cmd
    assert not any(c.startswith("--staging-point") for c in parent.worker_cmd(runs[0], "r", 0))
    assert compare.row_label({"system": "memascend", "budget": {"percent_of_state": 25},
                              "staging": "step"}) == "memascend 25% staged"
    with pytest.raises(SystemExit, match="--staging takes bounded and step"):
        compare.plan(compare.parser().parse_args(["--systems", "memascend", "--staging", "all"]))
