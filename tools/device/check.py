#!/usr/bin/env python3
"""The device check: what a GPU machine can do, and whether MemAscend works on it.

Run by `./run device [WHAT...]` from the repository root, on the GPU machine, with the
bundle `./run device-prep` made (.device/) or a native CUDA build (build/device/):

    check     (the default) probe, ceilings and tests, below
    probe     the runtime: kernel, gVisor or not, io_uring step by step and the backend
              chosen, O_DIRECT, the mlock limit, the GPU, its driver and free memory
    ceilings  disk read and write (1 MiB x 32 in flight, O_DIRECT; fio too where it
              exists), pinned host<->device copies from the arena's registered memory,
              the bf16 matrix-product rate, device and CPU memory bandwidth
    tests     ctest -L 'gpu|device|io', the Python tests with this machine's PyTorch, the
              CUDA tests under compute-sanitizer memcheck
    bench-gpu-path  bench/gpu/path.py: the GPU training path against the model on the GPU
              (its options after --path-args "...")
    bench-gpu  bench/gpu/compare.py: memascend against torch on the GPU, FSDP2 CPU offload
              and DeepSpeed ZeRO-Infinity, one record per run into $OUT (its options
              after --compare-args "...", e.g. "--systems memascend,torch-gpu --layers 4");
              with .device/deepspeed (`./run device-prep --deepspeed`) in its workers'
              environment where it was carried (tools/device/deepspeed_bundle.py)
    bench-commit  bench/commit.py: a commit's write rate at several write-back depths
              against the disk's, on the scratch disk, into $OUT/commit.json (its options
              after --commit-args "...")

Everything lands in $OUT (or --out): summary.json (device, runtime, commit, date, probe,
ceilings with the command behind each figure, tests with passed/failed/skipped counts)
and one log per step. The summary is rewritten after every step, so a run cut short
still leaves what it measured. docs/gpu.md explains each figure.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUNDLE = os.path.join(ROOT, ".device")
DEEPSPEED_BUNDLE = os.path.join(BUNDLE, "deepspeed")
NATIVE = os.environ.get("MEMASCEND_DEVICE_BUILD") or os.path.join(ROOT, "build", "device")
WHATS = ("check", "probe", "ceilings", "tests", "bench-gpu-path", "bench-gpu", "bench-commit")


class Check:
    def __init__(self, out, build, manifest):
        self.out = out
        self.build = build
        self.cli = os.path.join(build, "tools", "memascend")
        self.started = time.time()
        self.summary = {
            "schema": 1,
            "kind": "device-check",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "commit": manifest.get("commit", ""),
            "commit_dirty": manifest.get("dirty", None),
            "bundle": {k: manifest.get(k) for k in ("date", "bytes", "python", "libraries")},
            "device": None,
            "runtime": None,
            "probe": {},
            "ceilings": {},
            "tests": {"passed": 0, "failed": 0, "skipped": 0, "suites": {}, "failures": []},
            "steps": [],
        }
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.path.join(build, "python") + (
            ":" + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.env["PYTHONUNBUFFERED"] = "1"
        if manifest.get("commit"):  # the benches' records name the bundle's commit (common.commit)
            self.env["MEMASCEND_COMMIT"] = manifest["commit"] + ("-dirty" if manifest.get("dirty")
                                                                 else "")

    # ---- plumbing ------------------------------------------------------------------
    def save(self):
        self.summary["wall_seconds"] = round(time.time() - self.started, 1)
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=1)

    def run(self, name, cmd, timeout=300, env=None, shell=False, stream=None):
        """Runs one step; its output goes to <out>/logs.txt. Returns (rc, stdout).
        With `stream` (a file name in <out>), stdout and stderr go there as they come, so
        a step cut short by the device call's limit still leaves what it printed."""
        text = cmd if shell else " ".join(cmd)
        t0 = time.time()
        try:
            if stream:
                path = os.path.join(self.out, stream)
                with open(path, "w") as f:
                    try:
                        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                            timeout=timeout, env=env or self.env, cwd=ROOT,
                                            shell=shell).returncode
                    except subprocess.TimeoutExpired:
                        rc = 124
                out, err = open(path).read(), f"(streamed to {stream})" + (
                    f"\n[timed out after {timeout} s]" if rc == 124 else "")
            else:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   env=env or self.env, cwd=ROOT, shell=shell)
                rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + \
                f"\n[timed out after {timeout} s]"
        except OSError as e:
            rc, out, err = 127, "", str(e)
        seconds = round(time.time() - t0, 2)
        self.summary["steps"].append({"name": name, "command": text, "rc": rc, "seconds": seconds})
        with open(os.path.join(self.out, "logs.txt"), "a") as f:
            f.write(f"\n===== {name} (rc {rc}, {seconds} s)\n$ {text}\n{out}\n{err}\n")
        print(f"[device] {name}: rc {rc} in {seconds} s", flush=True)
        self.last_log = out + "\n" + err
        return rc, out

    def json_of(self, name, cmd, timeout=300):
        rc, out = self.run(name, cmd, timeout)
        if rc != 0:
            return None
        for line in reversed(out.strip().splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    break
        return None

    def ceiling(self, key, value, unit, command, **extra):
        self.summary["ceilings"][key] = {"value": value, "unit": unit, "command": command, **extra}

    # ---- probe -----------------------------------------------------------------------
    def runtime(self):
        release = platform.release()
        evidence = []
        name = "unknown"
        try:
            dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            dmesg = ""
        cmdline = open("/proc/cmdline").read() if os.path.exists("/proc/cmdline") else ""
        if "gVisor" in dmesg:
            name = "gvisor"
            evidence.append("dmesg names gVisor")
        elif release == "4.4.0":
            name = "gvisor"
            evidence.append("kernel release 4.4.0, which gVisor reports")
        elif "-fc-" in release or "virtio_mmio" in cmdline:
            name = "firecracker"
            evidence.append("kernel " + release if "-fc-" in release else "virtio_mmio devices")
        elif shutil.which("systemd-detect-virt"):
            v = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True).stdout
            name = v.strip() or "none"
            evidence.append("systemd-detect-virt")
        return {"name": name, "kernel": release, "evidence": "; ".join(evidence)}

    def gpu(self):
        info = {}
        if shutil.which("nvidia-smi"):
            q = "name,driver_version,memory.total,memory.free,clocks.sm,clocks.mem,temperature.gpu"
            rc, out = self.run("nvidia-smi", ["nvidia-smi", f"--query-gpu={q}",
                                              "--format=csv,noheader,nounits"], timeout=60)
            if rc == 0 and out.strip():
                f = [x.strip() for x in out.strip().splitlines()[0].split(",")]
                keys = ["name", "driver", "memory_total_mib", "memory_free_mib", "sm_clock_mhz",
                        "mem_clock_mhz", "temperature_c"]
                info.update(dict(zip(keys, f)))
        return info

    def probe(self):
        s = self.summary
        s["runtime"] = self.runtime()
        s["probe"]["gpu"] = self.gpu()
        s["device"] = s["probe"]["gpu"].get("name")
        info = self.json_of("memascend info", [self.cli, "info", "--json"], timeout=120)
        self.run("memascend info (table)", [self.cli, "info"], timeout=120)
        if info:
            detail = info.get("io_uring_detail", {})
            s["probe"]["io_uring"] = detail.get("checks", [])
            s["probe"]["io_backend"] = info.get("io_backend")
            s["probe"]["io_backend_reason"] = info.get("io_backend_reason")
            s["probe"]["o_direct_tmp"] = {"dir": detail.get("probe_dir"),
                                          "ok": detail.get("direct_io")}
            s["probe"]["memlock_limit_bytes"] = info.get("memlock_limit_bytes")
            s["probe"]["host_backing"] = info.get("host_backing")
            s["probe"]["cuda"] = info.get("cuda")
            s["probe"]["cpu"] = info.get("cpu")
            s["probe"]["memory"] = info.get("memory")
            s["probe"]["numa_nodes"] = info.get("numa_nodes")
            if not s["device"] and info.get("cuda", {}).get("devices"):
                s["device"] = info["cuda"]["devices"][0]["name"]
        scratch = self.scratch()
        try:
            fd = os.open(os.path.join(scratch, "odirect.probe"), os.O_CREAT | os.O_RDWR | os.O_DIRECT)
            os.close(fd)
            s["probe"]["o_direct_scratch"] = {"dir": scratch, "ok": True}
        except OSError as e:
            s["probe"]["o_direct_scratch"] = {"dir": scratch, "ok": False, "error": str(e)}
        rc, out = self.run("torch", [sys.executable, "-c",
                                     "import torch, json; f, t = torch.cuda.mem_get_info() if "
                                     "torch.cuda.is_available() else (0, 0); print(json.dumps("
                                     "{'torch': torch.__version__, 'cuda': torch.version.cuda, "
                                     "'available': torch.cuda.is_available(), 'free_bytes': f, "
                                     "'total_bytes': t}))"], timeout=120)
        if rc == 0:
            s["probe"]["torch"] = json.loads(out.strip().splitlines()[-1])
        self.save()

    def scratch(self):
        d = os.environ.get("MEMASCEND_DEVICE_SCRATCH") or os.path.join(ROOT, "build", "device-scratch")
        os.makedirs(d, exist_ok=True)
        return d

    # ---- ceilings --------------------------------------------------------------------
    def ceilings(self):
        scratch = self.scratch()
        target = os.path.join(scratch, "io.dat")
        size = os.environ.get("MEMASCEND_DEVICE_IO_SIZE", "4G")
        backends = ["auto"]
        if self.summary["probe"].get("io_backend") == "io_uring":
            backends.append("threads")  # the fallback's figure beside io_uring's
        # Three rounds; in each the backends in a random order, a write then a read of the
        # same 4 GiB. Each figure is the median of its three, with the spread beside it.
        rng = random.Random(int(time.time()))
        figures = {}
        for round_ in range(3):
            for backend in rng.sample(backends, len(backends)):
                for rw in ("write", "read"):
                    # The target is the check's own scratch file (fio may have left data).
                    cmd = [self.cli, "bench", "io", "--target", target, "--rw", rw, "--block",
                           "1M", "--qd", "32", "--size", size, "--json", "--destroy-data"]
                    if backend != "auto":
                        cmd += ["--backend", backend]
                    r = self.json_of(f"bench io {rw} ({backend}, round {round_ + 1})", cmd,
                                     timeout=240)
                    if r:
                        key = f"disk_{rw}_gib_per_s" + ("" if backend == "auto" else f"_{backend}")
                        f = figures.setdefault(key, {"values": [], "command": " ".join(cmd),
                                                     "backend": r.get("backend")})
                        f["values"].append(round(r["gib_per_s"], 3))
            self.save()
        for key, f in figures.items():
            v = sorted(f["values"])
            self.ceiling(key, v[len(v) // 2], "GiB/s", f["command"], backend=f["backend"],
                         values=f["values"], spread=[v[0], v[-1]])
        self.save()
        if shutil.which("fio"):
            for rw in ("write", "read"):
                cmd = ["fio", "--name=seq", f"--filename={target}", f"--rw={rw}", "--bs=1M",
                       "--iodepth=32", "--direct=1", f"--size={size}", "--ioengine=io_uring",
                       "--output-format=json"]
                rc, out = self.run(f"fio {rw}", cmd, timeout=240)
                if rc == 0:
                    job = json.loads(out[out.index("{"):])["jobs"][0][rw]
                    self.ceiling(f"fio_{rw}_gib_per_s", round(job["bw_bytes"] / 2**30, 3), "GiB/s",
                                 " ".join(cmd))
        else:
            self.summary["ceilings"]["fio"] = {"value": None, "why": "fio is not installed here"}
        try:
            os.remove(target)
        except OSError:
            pass

        cmd = [self.cli, "bench", "pcie", "--size", "1G", "--reps", "5", "--json"]
        r = self.json_of("bench pcie", cmd, timeout=180)
        if r:
            for k in ("h2d_gib_per_s", "d2h_gib_per_s", "h2d_pageable_gib_per_s"):
                self.ceiling(k, round(r[k], 2), "GiB/s", " ".join(cmd),
                             median=round(r.get(k + "_median", r[k]), 2) if k + "_median" in r else None)
            self.summary["probe"]["cuda_host_register"] = {
                "ok": r.get("host_backing") == "cuda_registered" and r.get("verified", False),
                "bytes": r.get("bytes"), "seconds": round(r.get("register_seconds", 0), 3)}
        else:
            self.summary["probe"]["cuda_host_register"] = {"ok": False,
                                                           "why": "bench pcie failed: see logs.txt"}
        self.save()

        cmd = [sys.executable, os.path.join(ROOT, "tools", "device", "matmul.py")]
        r = self.json_of("bf16 matmul (torch)", cmd, timeout=180)
        if r:
            self.ceiling("bf16_matmul_tflops", round(r["median_tflops"], 1), "TFLOP/s",
                         " ".join(cmd), best=round(r["best_tflops"], 1), shape=r["shape"])
        cmd = [self.cli, "bench", "kernels", "--device", "cuda", "--elements", "256M", "--reps", "5",
               "--json"]
        r = self.json_of("bench kernels (cuda)", cmd, timeout=180)
        if r:
            self.ceiling("gpu_copy_gbps", round(r["copy_ceiling_gbps"], 1), "GB/s (read + write)",
                         " ".join(cmd))
            self.ceiling("gpu_adam_fused_gbps", round(r["adam_fused_gbps"], 1), "GB/s",
                         " ".join(cmd), over_copy_ceiling=round(r["adam_fused_over_copy_ceiling"], 3))
        cmd = [self.cli, "bench", "kernels", "--elements", "64M", "--reps", "3", "--json"]
        r = self.json_of("bench kernels (cpu)", cmd, timeout=240)
        if r:
            self.ceiling("cpu_read_gbps", round(r["read_ceiling_gbps"], 1), "GB/s", " ".join(cmd),
                         threads=r["threads"], simd=r["simd"])
            self.ceiling("cpu_copy_gbps", round(r["copy_ceiling_gbps"], 1), "GB/s (read + write)",
                         " ".join(cmd), threads=r["threads"])
            # The update's kernel, whole and part by part as OffloadedAdam runs it (Note
            # [kernel grain]).
            self.ceiling("cpu_adam_fused_gbps", round(r["adam_fused_gbps"], 1), "GB/s",
                         " ".join(cmd), threads=r["threads"])
            if r.get("adam_parts_gbps"):
                self.ceiling("cpu_adam_parts_gbps", round(r["adam_parts_gbps"], 1), "GB/s",
                             " ".join(cmd), threads=r["threads"],
                             part_elements=r["adam_part_elements"],
                             over_fused=round(r["adam_parts_over_fused"], 3))
        self.save()

    # ---- tests -----------------------------------------------------------------------
    def count_junit(self, suite, path):
        t = self.summary["tests"]
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            t["suites"][suite] = {"error": f"no results ({e})"}
            t["failed"] += 1
            t["failures"].append(f"{suite}: no results")
            return
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for case in root.iter("testcase"):
            name = case.get("classname", "") + "." + case.get("name", "")
            status = case.get("status", "")
            if case.find("failure") is not None or case.find("error") is not None or status == "fail":
                counts["failed"] += 1
                t["failures"].append(f"{suite}: {name}")
            elif case.find("skipped") is not None or status in ("notrun", "disabled"):
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        t["suites"][suite] = counts
        for k in counts:
            t[k] += counts[k]

    def tests(self):
        t = self.summary["tests"]
        ctest = shutil.which("ctest")
        if ctest:
            junit = os.path.join(self.out, "ctest.xml")
            self.run("ctest -L gpu|device|io", [ctest, "--test-dir", self.build, "-L", "gpu|device|io",
                                                "-j", str(min(8, os.cpu_count() or 1)), "--timeout",
                                                "240", "--output-on-failure", "--output-junit", junit],
                     timeout=300)
            self.count_junit("ctest", junit)
        else:
            t["suites"]["ctest"] = {"error": "ctest is not on PATH"}
            t["failed"] += 1
        self.save()

        sanitizer = shutil.which("compute-sanitizer") or next(iter(sorted(glob.glob(
            "/usr/local/cuda*/bin/compute-sanitizer") + glob.glob(
            "/opt/nvidia/*/compute-sanitizer/compute-sanitizer"))), None)
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for test in ("cuda_kernels_test", "gpu_tier_test"):
            binary = os.path.join(self.build, "tests", test)
            if not sanitizer:
                counts["skipped"] += 1
                t["suites"].setdefault("compute-sanitizer-why", "compute-sanitizer not found")
                continue
            rc, out = self.run(f"compute-sanitizer memcheck {test}",
                               [sanitizer, "--tool", "memcheck", "--error-exitcode", "3",
                                "--print-limit", "20", binary], timeout=150)
            log = self.last_log
            if rc == 0 and "ERROR SUMMARY: 0 errors" in log:
                counts["passed"] += 1
            elif "not supported" in log.lower() or "error 999" in log.lower():
                counts["skipped"] += 1
                t["suites"]["compute-sanitizer-why"] = "the sanitizer refused this device " \
                    "(gVisor machines do): see logs.txt"
            else:
                counts["failed"] += 1
                t["failures"].append(f"compute-sanitizer: {test}")
        t["suites"]["compute-sanitizer"] = counts
        for k in counts:
            t[k] += counts[k]
        self.save()

        junit = os.path.join(self.out, "pytest.xml")
        py = os.path.join(ROOT, "tests", "python")
        # Each test's name as it starts and ends (-v), the slowest at the end, and every
        # thread's stack of a test still running after 150 s (faulthandler), into pytest.log
        # as they come: the first H200 run of these was cut short at 229 s with no word.
        # The heaviest tests (test_cuda.py's transformers Llama, marked `last`) run after
        # every other file's, and the sanitizer ran before: a call cut short loses the
        # fewest results.
        # With pytest-xdist (the GPU machines have it), four workers: the serial run took
        # 181 s of the fourth lease's 208 (one transformers Llama test 33 s, the kill and
        # resume tests 20-28 s each), and each test makes its own volumes under tmp_path
        # and its NCCL group over a file of its own.
        import importlib.util
        workers = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []
        self.run("pytest (cuda, core, torch)",
                 [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs",
                  *workers, "--durations=20", "-o", "faulthandler_timeout=150",
                  f"--junitxml={junit}", os.path.join(py, "test_cuda.py"),
                  os.path.join(py, "test_device_paths.py"),
                  os.path.join(py, "test_core.py"), os.path.join(py, "test_torch.py"),
                  "-k", "not rss"], timeout=420, stream="pytest.log")
        self.count_junit("pytest", junit)
        self.save()

    def bench_gpu_path(self, args):
        cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu", "path.py"), "--out", self.out,
               "--cli", self.cli] + args
        # Streamed: a call cut short keeps each run's step lines (path.py prints them as its
        # runs go; the first 2026-11-27 run was cut with nothing to show).
        rc, out = self.run("bench-gpu-path", cmd, timeout=560, stream="bench-gpu-path.log")
        records = sorted(glob.glob(os.path.join(self.out, "gpu-path-*.json")))
        self.summary["bench_gpu_path"] = {"rc": rc, "command": " ".join(cmd),
                                          "records": [os.path.basename(r) for r in records]}
        self.save()

    def bench_commit(self, args):
        # A commit's write rate at several write-back depths against the disk's, on the
        # check's scratch disk (bench/commit.py); its record lands in OUT.
        cmd = [sys.executable, os.path.join(ROOT, "bench", "commit.py"), "--dir",
               os.path.join(self.scratch(), "commit"), "--cli", self.cli, "--out",
               os.path.join(self.out, "commit.json")] + args
        rc, out = self.run("bench-commit", cmd, timeout=300, stream="bench-commit.log")
        self.summary["bench_commit"] = {"rc": rc, "command": " ".join(cmd)}
        self.save()

    def bench_gpu(self, args):
        # Each run's record lands as it ends, and the script ends its last run 40 s before
        # this step's limit (--time-budget), so a plan longer than the call keeps what ran.
        # The limit counts from the check's start (the probe before it takes 10-30 s), so the
        # whole call stays inside a 600 s device command.
        timeout = min(560, 580 - int(time.time() - self.started))
        # Volumes and swap files on the check's scratch disk (probed for O_DIRECT above), not
        # under $OUT, which goes back to the caller (a run killed midway leaves them there).
        cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu", "compare.py"), "--out", self.out,
               "--time-budget", str(timeout - 40), "--cli", self.cli,
               "--nvme-path", os.path.join(self.scratch(), "compare")] + args
        env = None
        if os.path.isdir(DEEPSPEED_BUNDLE):
            import deepspeed_bundle  # beside this file
            env, self.summary["deepspeed_bundle"] = deepspeed_bundle.environ(DEEPSPEED_BUNDLE,
                                                                             self.env)
        rc, out = self.run("bench-gpu", cmd, timeout=timeout, env=env, stream="bench-gpu.log")
        records = sorted(glob.glob(os.path.join(self.out, "compare-*.json")) +
                         glob.glob(os.path.join(self.out, "fit-*.json")))
        self.summary["bench_gpu"] = {"rc": rc, "command": " ".join(cmd),
                                     "records": [os.path.basename(r) for r in records]}
        self.save()


def unpack(manifest):
    """The bundle's archive, unpacked afresh into .device/unpacked (a second or two)."""
    import tarfile
    target = os.path.join(BUNDLE, "unpacked")
    if os.path.exists(target):
        shutil.rmtree(target)
    t0 = time.time()
    with tarfile.open(os.path.join(BUNDLE, manifest["archive"])) as tar:
        if sys.version_info >= (3, 12):
            tar.extractall(target, filter="tar")
        else:
            tar.extractall(target)
    print(f"[device] unpacked {manifest['archive']} in {time.time() - t0:.1f} s", flush=True)
    return target


def find_build():
    """(build dir, manifest): the bundle, unpacked and its paths resolved for this machine,
    or a native build."""
    manifest_path = os.path.join(BUNDLE, "manifest.json")
    if os.path.exists(manifest_path):
        manifest = json.load(open(manifest_path))
        build = os.path.join(unpack(manifest), "build")
        ph = manifest["placeholders"]
        cmake = shutil.which("cmake") or "cmake"
        for path in glob.glob(os.path.join(build, "**", "*.cmake"), recursive=True):
            text = open(path).read()
            new = (text.replace(ph["build"], build).replace(ph["source"], ROOT)
                   .replace(ph["cmake"], cmake).replace(ph.get("python", "@MEMASCEND_PYTHON@"),
                                                        sys.executable))
            if new != text:
                open(path, "w").write(new)
        return build, manifest
    if os.path.exists(os.path.join(NATIVE, "tools", "memascend")):
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
        return NATIVE, {"commit": r.stdout.strip()}
    sys.exit("device: no bundle (.device/) and no native build (build/device/): run "
             "`./run device-prep` on a development machine and carry .device, or build here "
             "(`./run device` builds when the toolchain and libraries are installed)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="*", default=["check"], help=" | ".join(WHATS))
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "build", "device-out"))
    ap.add_argument("--path-args", default="", help="options for bench/gpu/path.py")
    ap.add_argument("--compare-args", default="", help="options for bench/gpu/compare.py")
    ap.add_argument("--commit-args", default="", help="options for bench/commit.py")
    a = ap.parse_args()
    for w in a.what:
        if w not in WHATS:
            sys.exit(f"device: unknown check '{w}' (known: {', '.join(WHATS)})")
    os.makedirs(a.out, exist_ok=True)
    build, manifest = find_build()
    c = Check(a.out, build, manifest)
    what = {"probe", "ceilings", "tests"} if "check" in a.what else set(a.what)
    c.probe()  # every run says where it ran
    if "ceilings" in what:
        c.ceilings()
    if "tests" in what:
        c.tests()
    if "bench-gpu-path" in what:
        c.bench_gpu_path(a.path_args.split())
    if "bench-commit" in what:
        c.bench_commit(a.commit_args.split())
    if "bench-gpu" in what:
        c.bench_gpu(a.compare_args.split())
    c.save()
    s = c.summary
    print(f"[device] {s['device']} on {s['runtime']['name']} ({s['runtime']['kernel']}), "
          f"commit {s['commit'][:10]}, {s['wall_seconds']} s")
    print(f"[device] io backend {s['probe'].get('io_backend')}: {s['probe'].get('io_backend_reason')}")
    for k, v in s["ceilings"].items():
        print(f"[device]   {k:<28} {v.get('value')} {v.get('unit', v.get('why', ''))}")
    t = s["tests"]
    print(f"[device] tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped "
          f"{json.dumps(t['suites'])}")
    for f in t["failures"][:30]:
        print(f"[device]   FAILED {f}")
    return 1 if t["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
