#!/usr/bin/env python3
"""No input crashes a tool: runs every subcommand of `memascend` and `memascend-train` with
generated argument lists (bounded and seeded) and checks that each run ends with exit
status 0, 1 or 2, never a signal (abort, segfault) or an uncaught exception, and that a
failure says why on stderr in one line that names the program.

    arg_fuzz.py MEMASCEND MEMASCEND_TRAIN SCRATCH_DIR [--cases N] [--seed S]

Every path it generates is inside SCRATCH_DIR (created and removed here)."""
import os
import random
import shutil
import subprocess
import sys

args = sys.argv[1:]
cli, train, scratch = args[0], args[1], args[2]
cases = int(args[args.index("--cases") + 1]) if "--cases" in args else 300
seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 1
rng = random.Random(seed)

shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
text = os.path.join(scratch, "text.txt")
with open(text, "w") as f:
    f.write("not a volume\n" * 400)
empty = os.path.join(scratch, "empty")
open(empty, "w").close()
subdir = os.path.join(scratch, "dir")
os.makedirs(subdir)
vol = os.path.join(scratch, "vol")
subprocess.run([cli, "volume", "format", vol, "--size", "16M"], check=True,
               stdout=subprocess.DEVNULL)
subprocess.run([cli, "volume", "put", vol, "obj", text], check=True)

NUMBERS = ["0", "1", "2", "7", "-1", "1.5", "1e3", "inf", "-inf", "nan", "", "abc", "0x10",
           "99999999999999999999", "18446744073709551615", "4294967296", "1K", "3M", "1G",
           "9999T", "25%", "150%", "0%", "2x", "0.5x", "1e400"]
PATHS = [vol, text, empty, subdir, os.path.join(scratch, "missing", "x"),
         os.path.join(scratch, "new.vol"), "", "/"]
WORDS = ["obj", "other", "", "a" * 300, "../x", "memascend", "zero-infinity", "fp16", "bf16",
         "reference", "offload", "all", "pow2", "nope"]


def value():
    r = rng.random()
    return rng.choice(NUMBERS) if r < 0.5 else rng.choice(PATHS) if r < 0.75 else rng.choice(WORDS)


CLI = {
    "info": ["--json"],
    "pool-sim": ["--workload", "--policy", "--json", "--slice"],
    "volume format": ["--size", "--unit", "--journal", "--force"],
    "volume info": ["--json"], "volume ls": ["--json"], "volume rm": [], "volume get": [],
    "volume put": ["--scratch", "--meta"],
    "volume fsck": ["--verify-data", "--repair", "--allow-data-loss", "--json"],
    "bench io": ["--rw", "--block", "--qd", "--backend", "--json", "--help"],
    "bench kernels": ["--device", "--threads", "--reps", "--json", "--help"],
}
# The benchmarks move bytes: their sizes are fixed small first, and their fuzzed options
# take values from bounded lists (a fuzzed 1 TiB transfer would test the disk, not the
# parser).
BENCH_BASE = {
    "bench io": ["--target", os.path.join(scratch, "io.bin"), "--size", "1M"],
    "bench kernels": ["--elements", "4096"],
}
BENCH_VALUES = {
    "--rw": ["read", "write", "both", ""], "--block": ["4K", "1M", "3", "0", "abc", "-1", "1.5",
                                                      "9999T"],
    "--qd": ["1", "8", "0", "2000", "x", "-2"], "--backend": ["uring", "threads", "auto", "x"],
    "--device": ["cpu", "cuda", "gpu", ""], "--threads": ["1", "2", "0", "-3", "99999", "x"],
    "--reps": ["1", "2", "0", "1001", "1.5"],
}
# A small model and a scratch volume first; generated options (later, so they win) on top.
TRAIN_BASE = ["--vocab", "256", "--channels", "16", "--layers", "1", "--heads", "2", "--seq",
              "8", "--batch", "1", "--steps", "2", "--sample", "0", "--quiet", "--threads", "1",
              "--data", text]
TRAIN_OPTS = ["--steps", "--layers", "--channels", "--heads", "--seq", "--batch", "--vocab",
              "--dtype", "--mode", "--volume", "--volume-size", "--force", "--resume",
              "--host-budget", "--window", "--optimizer-chunk", "--read-ahead", "--keep",
              "--overlap-optimizer", "--io-threads", "--write-behind", "--policy", "--lr",
              "--warmup", "--clip", "--weight-decay", "--seed", "--loss-scale", "--json",
              "--sample", "--timeline", "--zero-param-buffers", "--zero-optimizer-buffers",
              "--zero-sub-group-size", "--zero-min-swap", "--zero-max-in-cpu", "--zero-block",
              "--zero-pin-optimizer", "--zero-pin-param", "--zero-release", "--zero-reduce-bucket",
              "--config", "--init-from", "--export",
              "--export-dtype", "--export-shard", "--export-overwrite", "--tokens", "--eval",
              "--checkpoint-activations", "--matmul", "--pool", "--state-versions", "--bogus"]
FLAGS = {"--force", "--resume", "--json", "--scratch", "--verify-data", "--quiet", "--repair",
         "--allow-data-loss", "--help", "--export-overwrite", "--checkpoint-activations"}


def generate():
    if rng.random() < 0.6:
        sub = rng.choice(sorted(CLI))
        argv = [cli] + sub.split()
        positional = {"volume format": 1, "volume info": 1, "volume ls": 1, "volume fsck": 1,
                      "volume rm": 2, "volume get": 3, "volume put": 3}.get(sub, 0)
        positional += rng.choice([0, 0, 0, 1, -1])
        for i in range(max(positional, 0)):
            argv.append(rng.choice(PATHS) if i == 0 else
                        rng.choice(WORDS) if i == 1 else rng.choice(PATHS))
        argv += BENCH_BASE.get(sub, [])
        for _ in range(rng.randint(0, 3)):
            o = rng.choice(CLI[sub] + ["--bogus"])
            argv.append(o)
            if o in BENCH_VALUES:
                argv.append(rng.choice(BENCH_VALUES[o]))
            elif o not in FLAGS and rng.random() < 0.9:
                argv.append(value())
        return argv
    argv = [train] + TRAIN_BASE + ["--volume", os.path.join(scratch, "train.vol")]
    for _ in range(rng.randint(1, 3)):
        o = rng.choice(TRAIN_OPTS)
        argv.append(o)
        if o not in FLAGS and rng.random() < 0.9:
            if o in ("--steps", "--layers", "--channels", "--seq", "--batch", "--vocab", "--sample"):
                # A valid huge --steps is a long run the user asked for, not a parse case.
                big = [] if o == "--steps" else ["4294967297"]
                argv.append(rng.choice(["0", "1", "3", "-1", "1.5", "nan", "99999999999999999999",
                                        "abc", ""] + big))
            elif o == "--export":  # it writes: only inside the scratch directory
                argv.append(rng.choice([subdir, os.path.join(scratch, "export"), empty, text]))
            else:
                argv.append(value())
    return argv


bad = []
statuses = {}
for case in range(cases):
    argv = generate()
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                           cwd=scratch)
    except subprocess.TimeoutExpired:
        bad.append((argv, "timed out after 60 s"))
        continue
    err = p.stderr.decode(errors="replace")
    statuses[p.returncode] = statuses.get(p.returncode, 0) + 1
    if p.returncode < 0 or p.returncode not in (0, 1, 2):
        bad.append((argv, f"exit status {p.returncode}: {err[-300:]}"))
    elif "terminate called" in err or "Aborted" in err or "AddressSanitizer" in err:
        bad.append((argv, f"crashed: {err[-300:]}"))
    elif p.returncode != 0 and not err.strip():
        bad.append((argv, f"exit status {p.returncode} with nothing on stderr"))
    shutil.rmtree(os.path.join(scratch, "export"), ignore_errors=True)
    for leftover in ("train.vol", "new.vol", "io.bin"):  # each case starts from nothing of its own
        try:
            os.unlink(os.path.join(scratch, leftover))
        except FileNotFoundError:
            pass
        shutil.rmtree(os.path.join(scratch, leftover + ".zero"), ignore_errors=True)
shutil.rmtree(scratch, ignore_errors=True)
for argv, why in bad:
    print("FAILED:", " ".join(repr(a) if (" " in a or not a) else a for a in argv), "->", why)
print("exit statuses:", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
print(f"{cases - len(bad)} passed, {len(bad)} failed")
sys.exit(1 if bad else 0)
