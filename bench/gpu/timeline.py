"""A traced step's timeline (memascend.torch.StepTrace's spans) as a hand-written SVG: one
row per lane (the optimizer's update, the parameters' loads, the compute stream's forward,
recomputation and backward per module, and the harness's opt.step()), time across.

    python3 bench/gpu/timeline.py RECORD.json OUT.svg   # a compare.py record with "trace"
"""
import json
import sys

LANES = ("update", "load", "compute", "step")
COLORS = {"update": "#ff7f0e", "load": "#1f77b4", "fwd": "#2ca02c", "recompute": "#98df8a",
          "bwd": "#d62728", "step": "#9467bd"}


def color(lane, name):
    return COLORS.get(name.split(" ", 1)[0], COLORS.get(lane, "#7f7f7f"))


def svg(spans, title, path):
    """Writes the timeline of `spans` ((lane, name, begin, end), seconds) to `path`."""
    if not spans:
        return False
    lanes = [x for x in LANES if any(s[0] == x for s in spans)] + sorted(
        {s[0] for s in spans} - set(LANES))
    end = max(s[3] for s in spans) or 1e-9
    w, pad, row = 900, 90, 26
    h = 60 + row * len(lanes) + 50
    sx = lambda t: pad + t / end * (w - pad - 20)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="{w / 2}" y="16" text-anchor="middle">{title}</text>']
    for k, lane in enumerate(lanes):
        y = 40 + k * row
        busy = sum(s[3] - s[2] for s in spans if s[0] == lane)
        out.append(f'<text x="{pad - 6}" y="{y + row / 2 + 3}" text-anchor="end">{lane}</text>')
        out.append(f'<text x="{pad - 6}" y="{y + row / 2 + 13}" text-anchor="end" '
                   f'fill="#555">{busy * 1e3:.0f} ms</text>')
        for ln, name, b, e in spans:
            if ln != lane:
                continue
            out.append(f'<rect x="{sx(b):.2f}" y="{y + 3}" width="{max(sx(e) - sx(b), 0.5):.2f}" '
                       f'height="{row - 8}" fill="{color(lane, name)}"><title>{name}: '
                       f'{b * 1e3:.2f}-{e * 1e3:.2f} ms</title></rect>')
    axis = 40 + row * len(lanes) + 6
    out.append(f'<line x1="{sx(0)}" y1="{axis}" x2="{sx(end)}" y2="{axis}" stroke="black"/>')
    for i in range(6):
        t = end * i / 5
        out.append(f'<text x="{sx(t):.1f}" y="{axis + 14}" text-anchor="middle">'
                   f'{t * 1e3:.0f} ms</text>')
    legend = "update: the optimizer's update of the groups (host); load: the parameters made " \
             "ready (host); compute: fwd, recompute, bwd per module (the GPU's stream)"
    out.append(f'<text x="{pad}" y="{axis + 32}" fill="#555">{legend}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return True


def main():
    record = json.load(open(sys.argv[1]))
    trace = record.get("trace") or {}
    ok = svg(trace.get("spans") or [], f"{record.get('model')}: {record.get('system')}, step "
             f"{trace.get('step')}", sys.argv[2])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
