#!/usr/bin/env python3
"""bench/frontier.py: the memory/speed frontier of memascend against ZeRO-Infinity's
complete rules (issue 25; Note [zero rules] in examples/offload_train/zero_infinity.h).

Per model of a Llama-shaped ladder (bench/configs/), at --seq 256 (bf16, batch 1):

1. the sweep: every ZeRO-Infinity configuration of a grid over parameter buffers (count,
   size), sub_group_size, max_in_cpu, aio block size and queue depth, and the pipeline
   flags (--grid: full without them, pipelined with both, complete both), and memascend at
   every budget of a list fixed here before any run (5, 10, 15, 25, 40, 60 and 100% of
   the training state, the same for every model), each once, in a random order;
2. from the sweep, "zero speed-tuned" (the fastest ZeRO configuration that ran) and
   "zero memory-tuned" (the smallest peak RSS that ran), beside DeepSpeed's defaults;
3. the repeats: those three and memascend's budgets, in a Williams design (each
   configuration follows each other equally often), rows in a random order, at least
   --repeats of them; medians with bootstrap 95% intervals.

One JSON object per run goes to OUT/frontier.jsonl: policy, model, parameters, settings,
peak_rss_bytes, step_seconds (the median of the run's steps but the first and the last, or
with a commit interval the mean of whole intervals between them: steady_step below),
steps_seconds (every step), fits (it
finished), command (the argv that reproduces it), phase (sweep or repeat), repeat. The
summary (OUT/frontier-summary.json) holds each configuration's medians and intervals and
the frontier's statements; OUT/../frontier.svg plots step time against peak RSS per model.

  /usr/bin/python3 bench/frontier.py --train build/release/examples/offload_train/memascend-train
  /usr/bin/python3 bench/frontier.py --reduced ...   # a few minutes: the smallest model,
                                                     # a grid of 4, 3 budgets, 6 repeats

`--commit-every 1,4` runs memascend's budgets at each commit interval (memascend-train
--commit-every, Note [commit interval]: a crash loses at most N-1 steps, where ZeRO-Infinity's
swapped state survives none), labelled "memascend 25% c4"; 1, the default, is durable
every step. `--staging bounded,step` runs the durable budgets both ways (memascend-train
--staging): step stages a whole step, the volume a version larger, labelled "memascend 25%
staged".

The full run takes hours on 2 cores (the 1B model's steps take about half a minute
each): run it outside CI. Needs disk for one volume of the largest model (2x its state).
"""
import argparse
import itertools
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LADDER = {  # name: config (Llama shapes; bench/configs/)
    "llama-56m": "bench/configs/llama-dp-56m.json",
    "llama-250m": "bench/configs/llama-250m.json",
    "llama-1b": "bench/configs/llama-3.2-1b.json",
}
# Fixed before any run, the same for every model (percent of the training state).
BUDGETS = [5, 10, 15, 25, 40, 60, 100]
REDUCED_BUDGETS = [10, 25, 60]
# DeepSpeed's defaults (offload_param, offload_optimizer, aio; ANCHORS.md).
ZERO_DEFAULTS = {"param_buffers": 5, "param_buffer_size": 100_000_000,
                 "optimizer_buffers": 4, "sub_group_size": 1_000_000_000,
                 "max_in_cpu": 1_000_000_000, "aio_block": 1 << 20, "queue_depth": 8}
ZERO_GRID = {
    "param_buffers": [1, 5],
    "param_buffer_size": [1, 100_000_000],  # 1: raised to the largest parameter by the rule
    "sub_group_size": [1, 10_000_000, 1_000_000_000],
    "max_in_cpu": [0, 1_000_000_000],
    "aio": [(1 << 20, 8), (8 << 20, 32)],  # ds_nvme_tune's corners
}
# offload_optimizer's pipeline_read and pipeline_write, both on: the next sub-group read
# and the previous written while one steps (12 optimizer buffers, four per sub-group in
# flight). "pipelined" is the full grid with them; "complete" both halves.
PIPELINE_ON = [(True, True)]
REDUCED_ZERO_GRID = {
    "param_buffers": [1, 5], "param_buffer_size": [100_000_000],
    "sub_group_size": [1, 1_000_000_000], "max_in_cpu": [1_000_000_000],
    "aio": [(1 << 20, 8)],
}


GRIDS = {"full": ZERO_GRID, "reduced": REDUCED_ZERO_GRID,
         "pipelined": dict(ZERO_GRID, pipeline=PIPELINE_ON),
         "complete": dict(ZERO_GRID, pipeline=[(False, False)] + PIPELINE_ON)}


# DeepSpeed's releases whose rules the baseline follows (--zero-release; Note [zero rules]):
# 0.19.5 pins the swap buffers at their size and turns both pin_memory flags on.
RELEASES = ["0.16.5", "0.19.5"]
DEFAULT_RELEASE = "0.16.5"  # a configuration without "release" is one of 0.16.5
DEFAULT_REDUCE_BUCKET = 500_000_000


def zero_configs(grid, releases=(DEFAULT_RELEASE,), reduce_buckets=(DEFAULT_REDUCE_BUCKET,)):
    """The grid's configurations, under each of RELEASES and REDUCE_BUCKETS (reduce_bucket_size).
    The pipeline flags, a release other than 0.16.5 and a bucket other than the default
    appear in a configuration only when set (a configuration without them, as every run
    before them, has the defaults), with the optimizer buffers the flags need."""
    keys = ["param_buffers", "param_buffer_size", "sub_group_size", "max_in_cpu", "aio"]
    pipeline = grid.get("pipeline", [(False, False)])
    for values in itertools.product(*(grid[k] for k in keys), pipeline, releases,
                                    reduce_buckets):
        c = dict(ZERO_DEFAULTS)
        c.update(zip(keys[:-1], values[:-4]))
        c["aio_block"], c["queue_depth"] = values[-4]
        read, write = values[-3]
        if read or write:
            c.update(pipeline_read=read, pipeline_write=write,
                     optimizer_buffers=4 * (1 + read + write))
        if values[-2] != DEFAULT_RELEASE:
            c["release"] = values[-2]
        if values[-1] != DEFAULT_REDUCE_BUCKET:
            c["reduce_bucket"] = values[-1]
        yield c


def zero_args(c):
    return ["--policy", "zero-infinity", "--zero-param-buffers", str(c["param_buffers"]),
            "--zero-param-buffer-size", str(c["param_buffer_size"]),
            "--zero-optimizer-buffers", str(c["optimizer_buffers"]),
            "--zero-sub-group-size", str(c["sub_group_size"]),
            "--zero-max-in-cpu", str(c["max_in_cpu"]),
            "--zero-block", str(c["aio_block"]), "--zero-queue-depth", str(c["queue_depth"]),
            *(["--zero-pipeline-read", "1"] if c.get("pipeline_read") else []),
            *(["--zero-pipeline-write", "1"] if c.get("pipeline_write") else []),
            "--zero-release", c.get("release", DEFAULT_RELEASE),
            *(["--zero-reduce-bucket", str(c["reduce_bucket"])] if "reduce_bucket" in c else [])]


def plain(settings):
    """A configuration's settings without the name it ran under."""
    return {k: v for k, v in settings.items() if k != "name"}


def label(policy, settings):
    if policy == "memascend":
        every = settings.get("commit_every", 1)
        return (f"memascend {settings['budget_percent']}%" + (f" c{every}" if every > 1 else "")
                + (" staged" if settings.get("staging") == "step" else ""))
    return settings.get("name") or "zero " + ",".join(
        f"{k}={v}" for k, v in plain(settings).items())


def settings_key(policy, settings):
    """A configuration's identity: its policy and settings, whatever name it ran under."""
    return policy, json.dumps(plain(settings), sort_keys=True)


def merge_earlier(results, treatments, earlier):
    """This run's repeats (label: rows) with earlier repeats of the same model: a row of a
    configuration this design holds joins that configuration, under this design's label;
    a row of another configuration (a tuned row an earlier sweep found) stays a point of
    its own, named by its settings."""
    names = {settings_key(p, s): label(p, s) for p, s in treatments}
    merged = {lab: list(rs) for lab, rs in results.items()}
    for r in earlier:
        k = settings_key(r["policy"], r["settings"])
        lab = names.get(k) or label(r["policy"], plain(r["settings"]))
        merged.setdefault(lab, []).append(r)
    return merged


def in_release(settings, release):
    """SETTINGS under RELEASE's rules."""
    out = {k: v for k, v in settings.items() if k != "release"}
    if release != DEFAULT_RELEASE:
        out["release"] = release
    return out


def named_zero_rows(zero_ran, releases=(DEFAULT_RELEASE,)):
    """ZeRO's named rows: DeepSpeed's defaults, and the fastest and the smallest of the
    sweep's runs that finished (ZERO_RAN, in the sweep's order: a tie goes to the first),
    each under every one of RELEASES (a release other than 0.16.5 named after the row:
    "zero-default 0.19.5"), so the frontier meets the stronger of the releases' rules at
    each point. A configuration found twice runs once, under both names ("zero-default =
    zero-speed-tuned")."""
    candidates = [("zero-default", ZERO_DEFAULTS)]
    if zero_ran:
        candidates.append(("zero-speed-tuned", min(zero_ran, key=lambda r: r["step_seconds"])["settings"]))
        candidates.append(("zero-memory-tuned", min(zero_ran, key=lambda r: r["peak_rss_bytes"])["settings"]))
    named = []
    for base, settings in candidates:
        for release in releases:
            name = base if release == DEFAULT_RELEASE else f"{base} {release}"
            c = in_release(plain(settings), release)
            same = [n for n, s in named if plain(s) == c]
            if same:
                print(f"frontier: {name} is {same[0]}'s configuration", file=sys.stderr)
                named = [(n, dict(s, name=f"{s['name']} = {name}") if n == same[0] else s)
                         for n, s in named]
            else:
                named.append((name, dict(c, name=name)))
    return named


def earlier_sweep(before, model, now):
    """The ZeRO configurations of MODEL's earlier sweeps that finished, but those NOW ran
    again."""
    ran = {settings_key(r["policy"], r["settings"]) for r in now}
    return [r for r in before if r["model"] == model and r["phase"] == "sweep"
            and r["policy"] == "zero-infinity" and r["fits"]
            and settings_key(r["policy"], r["settings"]) not in ran]


def rows_to_run(rows, max_rows, first_row):
    """(repeat number, order) of the design's rows this run takes: the design cut at
    MAX_ROWS rows (None: all; 0: none, the summary is rewritten from earlier runs), from
    row FIRST_ROW (1-based: the rest of a design an earlier session began with the same
    --seed)."""
    if first_row < 1:
        raise SystemExit(f"frontier: --first-row counts from 1, not {first_row}")
    if max_rows is not None:
        rows = rows[:max_rows]
    return [(rep, order) for rep, order in enumerate(rows, 1) if rep >= first_row]


def check_design_begun(design, earlier, first_row):
    """Refuses to end a design that is not the one an earlier session began: DESIGN's
    rows before FIRST_ROW (lists of labels) must be the orders EARLIER's repeats of
    this model ran in."""
    for rep in range(1, first_row):
        ran = [r["label"] for r in earlier if r["phase"] == "repeat" and r["repeat"] == rep]
        if ran != design[rep - 1]:
            raise SystemExit(
                f"frontier: row {rep} of this design is {design[rep - 1]} but the earlier "
                f"runs' row {rep} was {ran}: not the design an earlier session began "
                "(another --seed, --grid, --budgets or --only?)")


def selected(treatments, only):
    """The indices of the treatments named in ONLY (labels; a configuration run under two
    names answers to either); every treatment without ONLY."""
    if not only:
        return list(range(len(treatments)))
    keep = [i for i, (p, s) in enumerate(treatments)
            if set(label(p, s).split(" = ")) & set(only)]
    names = {n for p, s in treatments for n in label(p, s).split(" = ")}
    unknown = sorted(set(only) - names)
    if unknown:
        raise SystemExit(f"frontier: --only names no configuration of the design: {unknown} "
                         f"(the design's: {sorted(names)})")
    return keep


def williams(n, rng):
    """Orders of n treatments in which each follows each other equally often: a Williams
    design (n rows for n even, 2n for n odd), labels and rows shuffled."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [list(reversed(r)) for r in rows]
    names = list(range(n))
    rng.shuffle(names)
    rows = [[names[x] for x in r] for r in rows]
    rng.shuffle(rows)
    return rows


def steady_step(steps, commit_every=1):
    """A run's step time: the median of its steps but the first and the last, whatever the
    policy. The first warms the caches; the last is short under memascend's overlapped
    update, which reports a step when the next one's update starts (Note [background
    commit]): its step 1 holds two forward and backward passes and its last step none, so
    the last would flatter memascend. Needs 3 steps or more. With a commit interval of N
    steps, the mean of the most whole intervals between the first and the last step: a
    median would leave out the steps that pay for the commit. Needs N + 2 steps or more."""
    if len(steps) < 2 + commit_every:
        raise SystemExit(f"frontier: a run needs {2 + commit_every} steps or more (the first "
                         f"and last are left out, and whole intervals of {commit_every} kept)")
    if commit_every == 1:
        return statistics.median(steps[1:-1])
    whole = (len(steps) - 2) // commit_every * commit_every
    return statistics.mean(steps[1:1 + whole])


def bootstrap(values, rng, reps=2000):
    """The median and its bootstrap 95% interval."""
    if not values:
        return None
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return {"median": statistics.median(values), "lo": meds[int(0.025 * reps)],
            "hi": meds[int(0.975 * reps) - 1], "n": len(values)}


def tokens_file(work):
    """WORK/train.u32: 200,000 random token ids below 32000 (seed 1), made once."""
    path = os.path.join(work, "train.u32")
    if not os.path.exists(path):
        r = random.Random(1)
        with open(path, "wb") as f:
            f.write(struct.pack("<200000I", *(r.randrange(32000) for _ in range(200000))))
    return path


class Runner:
    def __init__(self, args):
        self.a = args
        self.out = open(os.path.join(args.out, "frontier.jsonl"), "a" if args.append else "w")
        self.tokens = tokens_file(args.work)

    def run(self, model, policy, settings, phase, repeat):
        cfg = os.path.join(ROOT, LADDER[model])
        vol = os.path.join(self.a.work, "run.vol")
        cmd = [self.a.train, "--config", cfg, "--tokens", self.tokens, "--seq", str(self.a.seq),
               "--batch", "1", "--steps", str(self.a.steps), "--dtype", "bf16", "--json",
               "--quiet", "--sample", "0", "--force", "--volume", vol,
               "--matmul", "blas"]
        if policy == "memascend":
            cmd += ["--policy", "memascend", "--host-budget", f"{settings['budget_percent']}%"]
            if settings.get("commit_every", 1) > 1:
                cmd += ["--commit-every", str(settings["commit_every"])]
            if settings.get("staging") == "step":
                cmd += ["--staging", "step"]
        else:
            cmd += zero_args(settings)
        for stale in (vol,):
            if os.path.exists(stale):
                os.remove(stale)
        subprocess.run(["rm", "-rf", vol + ".zero"], check=False)
        if self.a.volume_size:
            cmd += ["--volume-size", self.a.volume_size]
        t0 = time.time()
        run = cmd if not self.a.cap else [os.path.join(ROOT, "bench/memcap.sh"), self.a.cap, *cmd]
        p = subprocess.run(run, capture_output=True, text=True, timeout=self.a.timeout)
        row = {"policy": policy, "model": model, "settings": settings, "label": label(policy, settings),
               "phase": phase, "repeat": repeat, "fits": p.returncode == 0, "command": cmd,
               "wall_seconds": round(time.time() - t0, 1)}
        try:
            s = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("{")))
            row.update(parameters=s["params"], peak_rss_bytes=s["peak_rss_bytes"],
                       step_seconds=steady_step(s["step_seconds"], settings.get("commit_every", 1)),
                       steps_seconds=s["step_seconds"],
                       losses=s["losses"], peak_pinned_bytes=s["peak_pinned_bytes"],
                       io_bytes_per_step=statistics.mean(s["step_io_bytes"]),
                       model_state_bytes=s["model_state_bytes"])
        except StopIteration:
            row["error"] = p.stderr.strip().splitlines()[-1:] if p.stderr else []
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        print(f"  {phase} {repeat} {model} {row['label']}: fits={row['fits']} "
              f"rss={row.get('peak_rss_bytes', 0) / 2**20:.0f} MiB step={row.get('step_seconds', 0):.2f} s",
              file=sys.stderr, flush=True)
        return row


def frontier_statements(zero_rows, ours):
    """Per ZeRO configuration: memascend's best step time at or below its peak RSS, and
    memascend's smallest peak RSS at or below its step time (ratios; None: no such)."""
    out = []
    for z in zero_rows:
        under_rss = [m for m in ours if m["rss"] <= z["rss"]]
        under_time = [m for m in ours if m["step"] <= z["step"]]
        best_time = min((m["step"] for m in under_rss), default=None)
        best_rss = min((m["rss"] for m in under_time), default=None)
        out.append({"zero": z["label"], "zero_rss": z["rss"], "zero_step": z["step"],
                    "time_ratio_at_rss": best_time / z["step"] if best_time else None,
                    "rss_ratio_at_time": best_rss / z["rss"] if best_rss else None})
    return out


def plot(summary, path):
    """step time against peak RSS, one panel per model (hand-written SVG)."""
    models = list(summary)
    w, h, pad = 420, 300, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(models)}" height="{h}" '
             'font-family="sans-serif" font-size="10">']
    for i, m in enumerate(models):
        pts = summary[m]["points"]
        if not pts:
            continue
        xs = [p["rss"] / 2**30 for p in pts]
        ys = [p["step"] for p in pts]
        x0, x1, y0, y1 = 0, max(xs) * 1.1, 0, max(ys) * 1.1
        ox = i * w
        sx = lambda x: ox + pad + (x - x0) / (x1 - x0) * (w - 2 * pad)
        sy = lambda y: h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)
        parts.append(f'<text x="{ox + w / 2}" y="15" text-anchor="middle">{m}</text>')
        parts.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(x1)}" y2="{sy(0)}" stroke="black"/>')
        parts.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(0)}" y2="{sy(y1)}" stroke="black"/>')
        parts.append(f'<text x="{ox + w / 2}" y="{h - 12}" text-anchor="middle">peak RSS (GiB)</text>')
        parts.append(f'<text x="{ox + 12}" y="{h / 2}" transform="rotate(-90 {ox + 12} {h / 2})" '
                     'text-anchor="middle">step time (s)</text>')
        for k in range(5):
            xv, yv = x1 * k / 4, y1 * k / 4
            parts.append(f'<text x="{sx(xv)}" y="{sy(0) + 12}" text-anchor="middle">{xv:.2f}</text>')
            parts.append(f'<text x="{sx(0) - 4}" y="{sy(yv) + 3}" text-anchor="end">{yv:.1f}</text>')
        ours = sorted((p for p in pts if p["policy"] == "memascend"), key=lambda p: p["rss"])
        if len(ours) > 1:
            d = " ".join(f'{sx(p["rss"] / 2**30)},{sy(p["step"])}' for p in ours)
            parts.append(f'<polyline points="{d}" fill="none" stroke="#1f77b4"/>')
        for p in pts:
            x, y = sx(p["rss"] / 2**30), sy(p["step"])
            if p["policy"] == "memascend":
                parts.append(f'<circle cx="{x}" cy="{y}" r="3" fill="#1f77b4"><title>{p["label"]}</title></circle>')
            else:
                big = p.get("named")
                parts.append(f'<rect x="{x - (4 if big else 2)}" y="{y - (4 if big else 2)}" '
                             f'width="{8 if big else 4}" height="{8 if big else 4}" '
                             f'fill="{"#d62728" if big else "#ff9896"}"><title>{p["label"]}</title></rect>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", default=os.path.join(ROOT, "build/release/examples/offload_train/memascend-train"))
    ap.add_argument("--work", default="/tmp/memascend-frontier")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks-data"))
    ap.add_argument("--models", default=",".join(LADDER))
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="at least this many repeats")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--reduced", action="store_true",
                    help="the smallest model, a grid of 4, budgets 10/25/60%%, 3 steps")
    ap.add_argument("--grid", choices=sorted(GRIDS), help="override --reduced's grid (full: "
                    "without the pipeline flags; pipelined: the same with both on; complete: both)")
    ap.add_argument("--releases", default=",".join(RELEASES),
                    help="DeepSpeed releases whose rules ZeRO's grid and named rows run under "
                    "(comma-separated; default both: the frontier meets the stronger)")
    ap.add_argument("--reduce-buckets", default=str(DEFAULT_REDUCE_BUCKET),
                    help="reduce_bucket_size values the grid sweeps (comma-separated elements)")
    ap.add_argument("--commit-every", default="1", help="memascend's commit intervals "
                    "(comma-separated): each budget runs at each; 1 is durable every step")
    ap.add_argument("--staging", default="bounded", help="memascend's staging when durable "
                    "every step (comma-separated, memascend-train --staging): bounded (the "
                    "default, the state's disk footprint) or step (a whole step staged, a "
                    "volume a version larger), labelled \"memascend 25%% staged\"")
    ap.add_argument("--budgets", choices=["all", "reduced", "none"],
                    help="override --reduced's budgets (none: ZeRO's sweep only)")
    ap.add_argument("--cap", help="run each command under bench/memcap.sh at this limit "
                    "(a run the kernel kills does not fit): keeps the machine alive")
    ap.add_argument("--volume-size", help="--volume-size for every run (the 1B model's "
                    "default, twice its state, is more than a 64 GiB disk)")
    ap.add_argument("--tuned-from", help="no sweep: ZeRO's speed- and memory-tuned rows are "
                    "the fastest and the smallest of this model's sweep in frontier.jsonl")
    ap.add_argument("--max-rows", type=int, help="at most this many rows of the design "
                    "(unbalanced; for models whose runs take minutes); 0: none, rewrite the "
                    "summary from earlier runs (with --add-to-earlier)")
    ap.add_argument("--first-row", type=int, default=1, help="start at this row of the "
                    "design (1-based): the rest of a design an earlier session began, with "
                    "its --seed, --grid, --budgets and --only, --tuned-from the model itself "
                    "and --add-to-earlier (the rows it ran are checked)")
    ap.add_argument("--only", help="run only these configurations of the design (comma-"
                    "separated labels: zero-default, zero-speed-tuned, zero-memory-tuned, "
                    "'memascend 5%%', ...)")
    ap.add_argument("--add-to-earlier", action="store_true",
                    help="the summary also counts this model's earlier repeats in "
                    "frontier.jsonl (a design's rows run over several sessions: the 1B model); "
                    "implies --append")
    ap.add_argument("--named-only", action="store_true",
                    help="the statements count the design's rows only, not the sweep's runs "
                    "(--tuned-from a sweep that ran under other rules)")
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: the summary of the repeats in OUT/frontier.jsonl of "
                    "--models, by label, without sweep points")
    ap.add_argument("--append", action="store_true",
                    help="add to frontier.jsonl and the summary (other models' results stay)")
    a = ap.parse_args()
    a.append = a.append or a.add_to_earlier
    only = [x.strip() for x in a.only.split(",")] if a.only else None
    if a.reduced:
        a.models = "llama-56m" if a.models == ",".join(LADDER) else a.models
        a.steps = min(a.steps, 3)
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    if a.summarize:
        return summarize_file(a, rng)
    earlier, before = [], []
    if a.first_row > 1 and not (a.add_to_earlier and a.tuned_from):
        raise SystemExit("frontier: --first-row ends a design an earlier session began: "
                         "it needs --add-to-earlier and --tuned-from (the model itself)")
    if a.tuned_from or a.add_to_earlier:  # read before the runner (re)opens the file
        with open(os.path.join(a.out, "frontier.jsonl")) as f:
            before = [json.loads(line) for line in f]
    if a.tuned_from:
        earlier = [r for r in before if r["model"] == a.tuned_from
                   and r["phase"] == "sweep" and r["policy"] == "zero-infinity" and r["fits"]]
        if not earlier:
            raise SystemExit(f"frontier: no ZeRO sweep of {a.tuned_from} in frontier.jsonl")
    runner = Runner(a)
    budgets = {"all": BUDGETS, "reduced": REDUCED_BUDGETS, "none": []}[
        a.budgets or ("reduced" if a.reduced else "all")]
    grid = GRIDS[a.grid or ("reduced" if a.reduced else "full")]
    releases = [x.strip() for x in a.releases.split(",")]
    if not releases or set(releases) - set(RELEASES):
        raise SystemExit(f"frontier: --releases {a.releases}: one or more of {RELEASES}")
    buckets = [int(float(x)) for x in a.reduce_buckets.split(",")]
    everies = [int(x) for x in a.commit_every.split(",")]
    if not everies or min(everies) < 1 or a.steps < 2 + max(everies):
        raise SystemExit(f"frontier: --commit-every {a.commit_every}: intervals of 1 or more, "
                         f"and --steps at least 2 more than the longest")
    stagings = [x.strip() for x in a.staging.split(",")]
    if not stagings or set(stagings) - {"bounded", "step"}:
        raise SystemExit(f"frontier: --staging {a.staging}: bounded, step or both")
    # An interval above 1 stages a whole version anyway (Note [commit interval]).
    ours = [("memascend", dict({"budget_percent": b}, **({"commit_every": n} if n > 1 else {}),
                               **({"staging": "step"} if st == "step" else {})))
            for b in budgets for n in everies for st in stagings if n == 1 or st == "bounded"]
    summary = {}
    summary_path = os.path.join(a.out, "frontier-summary.json")
    if a.append and os.path.exists(summary_path):  # the other models' results stay
        with open(summary_path) as f:
            summary = json.load(f)
    for model in a.models.split(","):
        print(f"frontier: {model}", file=sys.stderr)
        # 1. the sweep, in a random order
        configs = [("zero-infinity", c) for c in zero_configs(grid, releases, buckets)]
        configs += ours
        rng.shuffle(configs)
        if a.tuned_from:
            sweep, zero_ran = [], earlier
        else:
            sweep = [runner.run(model, p, s, "sweep", 0) for p, s in configs]
            zero_ran = [r for r in sweep if r["policy"] == "zero-infinity" and r["fits"]]
            if a.add_to_earlier:  # the part of the grid an earlier session ran
                zero_ran = earlier_sweep(before, model, zero_ran) + zero_ran
        # 2. ZeRO's named rows
        named = named_zero_rows(zero_ran, releases)
        # 3. the repeats, a Williams design
        treatments = [("zero-infinity", s) for _, s in named]
        treatments += ours
        rows = []
        while len(rows) < a.repeats:
            rows += williams(len(treatments), rng)
        keep = set(selected(treatments, only))
        if a.first_row > 1:
            check_design_begun([[label(*treatments[t]) for t in r if t in keep] for r in rows],
                               [r for r in before if r["model"] == model], a.first_row)
        results = {}
        # fewer rows than a whole design are not balanced for carry-over until the rest
        # of it runs (--first-row, the same --seed)
        for rep, order in rows_to_run(rows, a.max_rows, a.first_row):
            for t in order:
                if t not in keep:
                    continue
                p, s = treatments[t]
                r = runner.run(model, p, s, "repeat", rep)
                results.setdefault(label(p, s), []).append(r)
        if a.add_to_earlier:
            results = merge_earlier(results, treatments, [
                r for r in before if r["model"] == model and r["phase"] == "repeat"])
        # the sweep's points: this model's, run now or by an earlier session
        sweep_points = [] if a.tuned_from not in (None, model) or a.named_only else zero_ran
        summary[model] = summarize(results, sweep_points, rng)
    write_summary(summary, summary_path, a.out)


def summarize(results, sweep, rng):
    """A model's summary: each configuration's medians with intervals (RESULTS: label ->
    rows), the SWEEP's ZeRO runs as points of their own, the frontier's statements over
    every ZeRO point, and the distinct loss sequences."""
    points, ours = [], []
    for lab, rs in results.items():
        ok = [r for r in rs if r["fits"]]
        st = bootstrap([r["step_seconds"] for r in ok], rng)
        rss = bootstrap([r["peak_rss_bytes"] for r in ok], rng)
        if st is None:
            continue
        pt = {"label": lab, "policy": rs[0]["policy"], "step": st["median"], "rss": rss["median"],
              "step_ci": st, "rss_ci": rss, "named": rs[0]["policy"] == "zero-infinity"}
        points.append(pt)
        if pt["policy"] == "memascend":
            ours.append(pt)
    for r in sweep:
        points.append({"label": r["label"], "policy": "zero-infinity", "step": r["step_seconds"],
                       "rss": r["peak_rss_bytes"], "named": False})
    zero_points = [p for p in points if p["policy"] == "zero-infinity"]
    losses = {tuple(r["losses"]) for rs in results.values() for r in rs if r["fits"]}
    return {"points": points, "statements": frontier_statements(zero_points, ours),
            "distinct_loss_sequences": len(losses)}


def summarize_file(a, rng):
    """--summarize: the summary of the repeats in OUT/frontier.jsonl alone, model by model
    (each configuration's rows by label; the named rows and memascend's budgets, no sweep
    points), without running anything."""
    with open(os.path.join(a.out, "frontier.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    summary = {}
    for model in a.models.split(","):
        results = {}
        for r in rows:
            if r["model"] == model and r["phase"] == "repeat":
                results.setdefault(r["label"], []).append(r)
        if results:
            summary[model] = summarize(results, [], rng)
    write_summary(summary, os.path.join(a.out, "frontier-summary.json"), a.out)


def write_summary(summary, summary_path, out):
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, os.path.join(os.path.dirname(out), "frontier.svg"))
    for model, s in summary.items():
        print(f"\n{model}: {s['distinct_loss_sequences']} distinct loss sequence(s) among the repeats")
        print("| configuration | step s (95% CI) | peak RSS MiB (95% CI) |")
        print("|---|---|---|")
        for p in sorted(s["points"], key=lambda p: p["rss"]):
            if "step_ci" not in p:
                continue
            c, r = p["step_ci"], p["rss_ci"]
            print(f"| {p['label']} | {c['median']:.2f} ({c['lo']:.2f}-{c['hi']:.2f}) | "
                  f"{r['median'] / 2**20:.0f} ({r['lo'] / 2**20:.0f}-{r['hi'] / 2**20:.0f}) |")
        worst_t = max((x["time_ratio_at_rss"] for x in s["statements"] if x["time_ratio_at_rss"]), default=None)
        worst_r = max((x["rss_ratio_at_time"] for x in s["statements"] if x["rss_ratio_at_time"]), default=None)
        none_t = sum(1 for x in s["statements"] if x["time_ratio_at_rss"] is None)
        none_r = sum(1 for x in s["statements"] if x["rss_ratio_at_time"] is None)
        print(f"worst over ZeRO's {len(s['statements'])} configurations: memascend's best time at or "
              f"below its RSS {worst_t and f'{worst_t:.2f}x'} ({none_t} with no memascend point at or below "
              f"its RSS); memascend's smallest RSS at or below its time {worst_r and f'{worst_r:.2f}x'} "
              f"({none_r} with none at or below its time)")


if __name__ == "__main__":
    main()
