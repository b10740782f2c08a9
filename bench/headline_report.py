#!/usr/bin/env python3
"""Table and memory-timeline plot for bench/headline.sh (standard library only)."""
import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict

RUNS = ["memascend", "zero-default", "zero-tuned"]
MIB = 1 << 20


def load(path):
    rows = defaultdict(list)
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[(r["size"], r["run"])].append(r["result"])
    return rows


def steady(r, applied=True):
    """Step times of a run's steps that applied the update (or were skipped for overflow),
    leaving out the first step (warm-up), the last (with the optimizer overlapped, it has
    no next forward pass to overlap) and, of the applied steps, each that follows a skipped
    one (with the optimizer overlapped, its time also holds a forward and backward pass
    that no update ran under: a step and a half). The same rule for every run."""
    flags = r.get("step_skipped") or [False] * len(r["step_seconds"])
    times = r["step_seconds"]
    return [t for i, (t, skip) in enumerate(zip(times, flags))
            if 0 < i < len(times) - 1 and skip != applied and not (applied and flags[i - 1])]


def per_step(r):
    """A run's whole time over its steps: warm-up, skipped steps and all, whatever the
    step each piece of work is counted in."""
    return r["seconds"] / r["steps"]


def summarise(results):
    steps = [t for r in results for t in steady(r)]
    skipped = [t for r in results for t in steady(r, applied=False)]
    return {
        "rss": statistics.median(r["peak_rss_bytes"] for r in results),
        "pinned": statistics.median(r["peak_pinned_bytes"] for r in results),
        "step": statistics.median(steps) if steps else float("nan"),
        "steps": len(steps),
        "skipped_step": statistics.median(skipped) if skipped else float("nan"),
        "run_step": statistics.median(per_step(r) for r in results),
        "io": statistics.median((r["io_read_bytes"] + r["io_write_bytes"]) / r["steps"] for r in results),
        "params": results[0]["params"],
        "state": results[0]["model_state_bytes"],
        "budget": results[0]["host_budget_bytes"],
        "losses": [r["losses"] for r in results],
        "ledger": results[0]["ledger"],
        "phases": {k: statistics.median(r["phase_seconds"][k] / r["steps"] for r in results)
                   for k in ("forward", "backward", "optimizer", "commit")},
    }


def seconds(x):
    return "-" if x != x else f"{x:.2f} s"  # NaN: no such steps


def table(rows, sizes):
    out = []
    out.append("| model | run | peak RSS | peak pinned | step time | skipped-step time | run time per step "
               "| I/O per step | RSS ratio | step ratio | run-time ratio |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        s = {run: summarise(rows[(size, run)]) for run in RUNS if rows.get((size, run))}
        if "memascend" not in s:
            continue
        m = s["memascend"]
        for run in RUNS:
            if run not in s:
                continue
            x = s[run]
            label = f"{size} ({x['params'] / 1e6:.1f} M params, state {x['state'] / MIB:.0f} MiB)"
            rss_ratio = "" if run == "memascend" else f"{m['rss'] / x['rss']:.2f}"
            step_ratio = "" if run == "memascend" else f"{m['step'] / x['step']:.2f}"
            run_ratio = "" if run == "memascend" else f"{m['run_step'] / x['run_step']:.2f}"
            out.append(f"| {label} | {run} | {x['rss'] / MIB:.0f} MiB | {x['pinned'] / MIB:.0f} MiB | "
                       f"{x['step']:.2f} s ({x['steps']}) | {seconds(x['skipped_step'])} | "
                       f"{x['run_step']:.2f} s | {x['io'] / MIB:.0f} MiB | {rss_ratio} | {step_ratio} "
                       f"| {run_ratio} |")
        same = all(l == s["memascend"]["losses"][0] for run in s for l in s[run]["losses"])
        out.append(f"| | losses equal step by step across runs and repeats: **{'yes' if same else 'NO'}** "
                   f"| | | | | | | | | |")
    out.append("")
    out.append("Step time: the median over every repeat's steps that applied the update, but the "
               "first, the last and each that follows a skipped step (in brackets: how many); "
               "skipped-step time: the same over steps skipped for overflow (no update). Run time "
               "per step: the median over repeats of a run's whole time (from its first step, its "
               "initial state durable) over its steps, skipped ones included. I/O per step: read "
               "and written by the run, its initial state included, over its steps. Ratios: "
               "memascend / that row (lower is better for memascend).")
    out.append("")
    out.append("Where memascend's memory goes (ledger peaks, largest model):")
    out.append("")
    big = sizes[-1]
    if rows.get((big, "memascend")):
        m = summarise(rows[(big, "memascend")])
        out.append(f"- host budget {m['budget'] / MIB:.0f} MiB (training state {m['state'] / MIB:.0f} MiB, "
                   f"{m['state'] / max(m['budget'], 1):.1f}x the budget)")
        for e in m["ledger"]:
            out.append(f"- {e['tier']} / {e['use']}: {e['peak_bytes'] / MIB:.1f} MiB")
    out.append("")
    out.append("Where a step's time goes, largest model (seconds per step, medians over repeats; "
               "the forward phase includes the head's backward pass, the optimizer phase the "
               "overflow check and Adam):")
    out.append("")
    out.append("| run | forward | backward | optimizer | commit |")
    out.append("|---|---|---|---|---|")
    for run in RUNS:
        if rows.get((big, run)):
            ph = summarise(rows[(big, run)])["phases"]
            out.append(f"| {run} | {ph['forward']:.2f} | {ph['backward']:.2f} | {ph['optimizer']:.2f} | "
                       f"{ph['commit']:.2f} |")
    # The tensor store's counters (runs that have them): how often memascend's uses found
    # their tensor read ahead, and how long the trainer waited for tensors.
    store_rows = []
    for size in sizes:
        results = [r for r in rows.get((size, "memascend"), []) if r.get("store")]
        if not results:
            continue
        def med(f):
            return statistics.median(f(r) for r in results)
        hits = med(lambda r: r["store"]["prefetch_hits"] / max(1, r["store"]["prefetch_hits"] +
                                                              r["store"]["prefetch_misses"]))
        store_rows.append(
            f"| {size} | {100 * hits:.0f}% | {med(lambda r: r['store']['prefetch_misses'] / r['steps']):.0f} "
            f"| {med(lambda r: (r['store']['prefetch_dropped'] + r['store'].get('prefetch_deferred', 0)) / r['steps']):.1f} "
            f"| {med(lambda r: r['store']['stall_seconds'] / r['steps']):.3f} s |")
    if store_rows:
        out.append("")
        out.append("memascend's tensor store (medians over repeats, per step): the share of uses that "
                   "found their tensor read ahead, the tensors the trainer read itself, the times a "
                   "prefetch found no room (dropped, or set to wait for room, again at each retry "
                   "that found none), and the time the "
                   "trainer waited for tensors:")
        out.append("")
        out.append("| model | read ahead | read by the trainer | prefetches without room | waited |")
        out.append("|---|---|---|---|---|")
        out.extend(store_rows)
    return "\n".join(out)


def svg(timelines, size, path):
    series = []
    colours = {"memascend": "#1b7837", "zero-default": "#b2182b", "zero-tuned": "#ef8a62"}
    for run in RUNS:
        try:
            with open(f"{timelines}/timeline-{size}-{run}.csv") as f:
                pts = [(float(r["seconds"]), int(r["rss_bytes"]) / MIB) for r in csv.DictReader(f)]
        except FileNotFoundError:
            continue
        if pts:
            series.append((run, pts))
    if not series:
        return
    w, h, ml, mb, mt, mr = 760, 420, 70, 50, 30, 170
    xmax = max(p[0] for _, pts in series for p in pts) or 1
    ymax = max(p[1] for _, pts in series for p in pts) * 1.05 or 1
    X = lambda x: ml + (w - ml - mr) * x / xmax
    Y = lambda y: h - mb - (h - mb - mt) * y / ymax
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{ml}" y="18" font-size="14">Process RSS during training, {size} model (MiB)</text>',
             f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
             f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
             f'<text x="{(w - mr + ml) / 2}" y="{h - 12}" text-anchor="middle">seconds since start</text>']
    for i in range(6):
        yv = ymax * i / 5
        parts.append(f'<text x="{ml - 6}" y="{Y(yv) + 4:.1f}" text-anchor="end">{yv:.0f}</text>')
        parts.append(f'<line x1="{ml}" y1="{Y(yv):.1f}" x2="{w - mr}" y2="{Y(yv):.1f}" stroke="#ddd"/>')
        xv = xmax * i / 5
        parts.append(f'<text x="{X(xv):.1f}" y="{h - mb + 16}" text-anchor="middle">{xv:.0f}</text>')
    for k, (run, pts) in enumerate(series):
        d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{colours[run]}" stroke-width="2" points="{d}"/>')
        parts.append(f'<line x1="{w - mr + 10}" y1="{mt + 20 * k + 8}" x2="{w - mr + 30}" y2="{mt + 20 * k + 8}" '
                     f'stroke="{colours[run]}" stroke-width="3"/>')
        parts.append(f'<text x="{w - mr + 36}" y="{mt + 20 * k + 12}">{run}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--timelines", default="docs/benchmarks-data")
    ap.add_argument("--size", default="large")
    ap.add_argument("--svg", default="")
    a = ap.parse_args()
    rows = load(a.jsonl)
    sizes = [s for s in ["small", "medium", "large"] if any(k[0] == s for k in rows)]
    print(table(rows, sizes))
    if a.svg:
        svg(a.timelines, a.size, a.svg)


if __name__ == "__main__":
    sys.exit(main())
