"""The benchmarks' method (bench/frontier.py, bench/fit.py, bench/memcap.sh): the
Williams design's balance, the step-time rule, the bootstrap interval, the frontier's
statements, the selection and merging of a design's rows over several sessions, and the
memory cap the kernel enforces."""
import collections
import json
import os
import random
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
import fit  # noqa: E402
import frontier  # noqa: E402


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 10])
def test_williams_rows_are_orders_in_which_each_follows_each_other_equally_often(n):
    rows = frontier.williams(n, random.Random(n))
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    follows = collections.Counter()
    for r in rows:
        assert sorted(r) == list(range(n))
        follows.update(zip(r, r[1:]))
    assert len(follows) == n * (n - 1)
    assert len(set(follows.values())) == 1


def test_steady_step_leaves_out_the_first_and_the_last_step():
    # memascend's overlapped update: the first step holds two passes, the last none.
    assert frontier.steady_step([2.43, 1.19, 1.23, 1.19, 0.56]) == 1.19
    assert frontier.steady_step([5.0, 2.0, 0.1]) == 2.0
    with pytest.raises(SystemExit, match="3 steps or more"):
        frontier.steady_step([1.0, 0.5])


def test_steady_step_with_a_commit_interval_keeps_whole_intervals():
    # The commit's cost lands in one step of each interval: a median would leave it out.
    steps = [9.0, 5.0, 5.0, 5.0, 9.0, 5.0, 1.0]  # one interval of 4 (steps 2-5), a spare, the last
    assert frontier.steady_step(steps, 4) == 6.0
    assert frontier.steady_step(steps[:6] + [5.0, 5.0, 5.0, 1.0], 4) == 5.5  # two intervals
    with pytest.raises(SystemExit, match="6 steps or more"):
        frontier.steady_step(steps[:5], 4)
    assert frontier.label("memascend", {"budget_percent": 25, "commit_every": 4}) == \
        "memascend 25% c4"
    assert frontier.label("memascend", {"budget_percent": 25}) == "memascend 25%"
    assert frontier.label("memascend", {"budget_percent": 25, "staging": "step"}) == \
        "memascend 25% staged"


def test_bootstrap_interval_holds_the_median():
    rng = random.Random(1)
    values = [1.0, 1.1, 0.9, 1.05, 3.0, 0.95]
    b = frontier.bootstrap(values, rng)
    assert b["n"] == 6 and b["lo"] <= b["median"] <= b["hi"]
    assert frontier.bootstrap([], rng) is None


def test_frontier_statements_compare_at_or_below_each_zero_point():
    zero = [{"label": "z", "rss": 1000, "step": 10.0}]
    ours = [{"rss": 400, "step": 4.0}, {"rss": 900, "step": 3.0}, {"rss": 1200, "step": 1.0}]
    [s] = frontier.frontier_statements(zero, ours)
    assert s["time_ratio_at_rss"] == pytest.approx(0.3)  # the 1200 point is above its RSS
    assert s["rss_ratio_at_time"] == pytest.approx(0.4)
    [none] = frontier.frontier_statements(zero, [{"rss": 2000, "step": 20.0}])
    assert none["time_ratio_at_rss"] is None and none["rss_ratio_at_time"] is None


def _treatments():
    default = dict(frontier.ZERO_DEFAULTS, name="zero-default = zero-speed-tuned")
    small = dict(frontier.ZERO_DEFAULTS, sub_group_size=1, max_in_cpu=0, name="zero-memory-tuned")
    return [("zero-infinity", default), ("zero-infinity", small),
            ("memascend", {"budget_percent": 5}), ("memascend", {"budget_percent": 25})]


def test_only_selects_configurations_by_either_of_their_names_and_refuses_others():
    t = _treatments()
    assert frontier.selected(t, None) == [0, 1, 2, 3]
    assert frontier.selected(t, ["zero-speed-tuned"]) == [0]
    assert frontier.selected(t, ["zero-memory-tuned", "memascend 25%"]) == [1, 3]
    with pytest.raises(SystemExit, match="zero-fastest"):
        frontier.selected(t, ["zero-fastest"])


def test_earlier_repeats_join_their_configuration_whatever_it_was_named():
    t = _treatments()
    now = {"zero-memory-tuned": [{"policy": "zero-infinity", "settings": t[1][1], "id": "now"}]}
    renamed = dict(t[1][1], name="an earlier sweep's smallest")
    other = dict(frontier.ZERO_DEFAULTS, param_buffers=1, name="zero-memory-tuned")
    earlier = [{"policy": "zero-infinity", "settings": renamed, "id": "same"},
               {"policy": "zero-infinity", "settings": other, "id": "other"},
               {"policy": "memascend", "settings": {"budget_percent": 5}, "id": "m5"}]
    merged = frontier.merge_earlier(now, t, earlier)
    assert [r["id"] for r in merged["zero-memory-tuned"]] == ["now", "same"]
    assert [r["id"] for r in merged["memascend 5%"]] == ["m5"]
    # Another configuration under a reused name is a point of its own, named by its settings.
    [lab] = set(merged) - {"zero-memory-tuned", "memascend 5%"}
    assert lab.startswith("zero param_buffers=1,") and merged[lab][0]["id"] == "other"
    assert now["zero-memory-tuned"][0]["id"] == "now" and len(now["zero-memory-tuned"]) == 1


def test_named_rows_are_the_defaults_and_the_sweeps_fastest_and_smallest():
    def ran(step, rss, **settings):
        return {"step_seconds": step, "peak_rss_bytes": rss,
                "settings": dict(frontier.ZERO_DEFAULTS, name="sweep", **settings)}
    assert [n for n, _ in frontier.named_zero_rows([])] == ["zero-default"]
    named = dict(frontier.named_zero_rows([ran(3.0, 900, sub_group_size=1), ran(2.0, 1500),
                                           ran(2.5, 800, max_in_cpu=0)]))
    # the fastest is DeepSpeed's defaults: one configuration under both names
    assert named["zero-default"]["name"] == "zero-default = zero-speed-tuned"
    assert frontier.plain(named["zero-memory-tuned"]) == dict(frontier.ZERO_DEFAULTS, max_in_cpu=0)
    assert "zero-speed-tuned" not in named


def test_named_rows_run_under_every_release_asked():
    def ran(step, rss, **settings):
        return {"step_seconds": step, "peak_rss_bytes": rss,
                "settings": dict(frontier.ZERO_DEFAULTS, name="sweep", **settings)}
    both = frontier.RELEASES
    assert [n for n, _ in frontier.named_zero_rows([], both)] == ["zero-default",
                                                                   "zero-default 0.19.5"]
    # the sweep's fastest ran under 0.19.5, its smallest under 0.16.5: each under both
    named = dict(frontier.named_zero_rows([ran(2.0, 1500, release="0.19.5", param_buffers=1),
                                           ran(3.0, 800, max_in_cpu=0)], both))
    assert sorted(named) == ["zero-default", "zero-default 0.19.5", "zero-memory-tuned",
                             "zero-memory-tuned 0.19.5", "zero-speed-tuned",
                             "zero-speed-tuned 0.19.5"]
    assert "release" not in named["zero-speed-tuned"]
    assert named["zero-speed-tuned 0.19.5"]["release"] == "0.19.5"
    assert named["zero-memory-tuned 0.19.5"] == dict(frontier.ZERO_DEFAULTS, max_in_cpu=0,
                                                     release="0.19.5",
                                                     name="zero-memory-tuned 0.19.5")
    args = frontier.zero_args(named["zero-default 0.19.5"])
    assert args[args.index("--zero-release") + 1] == "0.19.5"
    assert "--zero-reduce-bucket" not in args


def test_the_grid_crosses_releases_and_reduce_buckets():
    grid = frontier.GRIDS["reduced"]
    one = list(frontier.zero_configs(grid))
    crossed = list(frontier.zero_configs(grid, frontier.RELEASES, [50_000_000, 500_000_000]))
    assert len(crossed) == 4 * len(one)
    assert one == [c for c in crossed if "release" not in c and "reduce_bucket" not in c]
    small = [c for c in crossed if c.get("reduce_bucket") == 50_000_000]
    assert len(small) == 2 * len(one)
    args = frontier.zero_args(small[0])
    assert args[args.index("--zero-reduce-bucket") + 1] == "50000000"


def test_the_pipelined_grid_is_the_full_one_with_both_flags_and_the_buffers_they_need():
    full = list(frontier.zero_configs(frontier.GRIDS["full"]))
    piped = list(frontier.zero_configs(frontier.GRIDS["pipelined"]))
    assert len(full) == len(piped) == 48
    assert len(list(frontier.zero_configs(frontier.GRIDS["complete"]))) == 96
    # the runs before the flags existed: the same settings, so the same configurations
    assert all("pipeline_read" not in c and c["optimizer_buffers"] == 4 for c in full)
    for off, on in zip(full, piped):
        assert on == dict(off, pipeline_read=True, pipeline_write=True, optimizer_buffers=12)
    args = frontier.zero_args(piped[0])
    assert args[args.index("--zero-optimizer-buffers") + 1] == "12"
    assert "--zero-pipeline-read" in args and "--zero-pipeline-write" in args
    assert "--zero-pipeline-read" not in frontier.zero_args(full[0])


def test_an_earlier_sweep_joins_this_one_but_what_ran_again():
    def run(model, phase="sweep", fits=True, **settings):
        return {"model": model, "phase": phase, "policy": "zero-infinity", "fits": fits,
                "settings": dict(frontier.ZERO_DEFAULTS, **settings)}
    now = [run("m", pipeline_read=True)]
    before = [run("m"), run("m", pipeline_read=True), run("m", max_in_cpu=0, fits=False),
              run("other"), run("m", phase="repeat", sub_group_size=1)]
    assert frontier.earlier_sweep(before, "m", now) == [before[0]]


def test_rows_to_run_cuts_the_design_and_starts_where_asked():
    rows = [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert [r for r, _ in frontier.rows_to_run(rows, None, 1)] == [1, 2, 3, 4]
    assert [r for r, _ in frontier.rows_to_run(rows, 2, 1)] == [1, 2]
    assert [r for r, _ in frontier.rows_to_run(rows, 4, 3)] == [3, 4]
    assert frontier.rows_to_run(rows, 0, 1) == []  # only the summary, from earlier runs
    with pytest.raises(SystemExit, match="counts from 1"):
        frontier.rows_to_run(rows, None, 0)


FAKE_TRAIN = """import json, sys, zlib
args = sys.argv[1:]
h = zlib.crc32(" ".join(a for a in args if a.startswith(("--zero", "--host", "1", "2", "3",
    "4", "5", "6", "7", "8", "9", "0"))).encode())
print(json.dumps({"params": 1000, "peak_rss_bytes": 1 + h % 1000,
    "step_seconds": [2.0, 1 + (h >> 10) % 100 / 10, 1.5, 0.5], "losses": [3.0, 2.0, 1.0, 0.5],
    "peak_pinned_bytes": 0, "step_io_bytes": [0], "model_state_bytes": 0}))
"""


def _frontier(tmp, out, *args):
    train = tmp / "train"
    train.write_text(f"#!{sys.executable}\n" + FAKE_TRAIN)
    train.chmod(0o755)
    subprocess.run([sys.executable, os.path.join(BENCH, "frontier.py"), "--train", str(train),
                    "--work", str(tmp / "work"), "--out", str(tmp / out), "--models", "llama-56m",
                    "--grid", "reduced", "--budgets", "reduced", "--seed", "7", *args],
                   check=True, capture_output=True, text=True)
    with open(tmp / out / "frontier.jsonl") as f:
        return [json.loads(line) for line in f]


def test_a_design_begun_in_one_session_ends_in_another_in_the_same_order(tmp_path):
    whole = _frontier(tmp_path, "whole", "--max-rows", "4")
    begun = _frontier(tmp_path, "split", "--max-rows", "2")
    ended = _frontier(tmp_path, "split", "--max-rows", "4", "--first-row", "3",
                      "--tuned-from", "llama-56m", "--add-to-earlier")
    assert ended[:len(begun)] == begun  # appended: the first session's runs stay
    def repeats(rows):
        return [(r["repeat"], r["label"]) for r in rows if r["phase"] == "repeat"]
    assert repeats(ended) == repeats(whole)
    assert len({r for r, _ in repeats(whole)}) == 4
    # the summary of the two sessions is the summary of one: the sweep's points included
    with open(tmp_path / "whole" / "frontier-summary.json") as f:
        one = json.load(f)["llama-56m"]
    with open(tmp_path / "split" / "frontier-summary.json") as f:
        two = json.load(f)["llama-56m"]
    def points(s):
        return sorted((p["label"], p["step"], p["rss"]) for p in s["points"])
    assert points(two) == points(one)
    assert two["statements"] and len(two["statements"]) == len(one["statements"])
    # Another seed is another design: its rows 1 and 2 are not the ones that ran.
    with pytest.raises(subprocess.CalledProcessError) as e:
        _frontier(tmp_path, "split", "--max-rows", "4", "--first-row", "3", "--seed", "8",
                  "--tuned-from", "llama-56m", "--add-to-earlier")
    assert "not the design an earlier session began" in e.value.stderr
    with pytest.raises(subprocess.CalledProcessError) as e:
        _frontier(tmp_path, "split", "--first-row", "3")
    assert "needs --add-to-earlier and --tuned-from" in e.value.stderr


def test_fit_reads_sizes_and_refuses_what_is_not_one():
    assert fit.parse_bytes("2G") == 2 << 30 and fit.parse_bytes("512M") == 512 << 20
    assert fit.parse_bytes("4096") == 4096
    with pytest.raises(SystemExit, match="not a size"):
        fit.parse_bytes("2GB")


def can_make_a_cgroup():
    if os.geteuid() != 0:
        return "needs root to make a memory cgroup"
    if not (os.path.exists("/sys/fs/cgroup/cgroup.controllers") or os.path.isdir("/sys/fs/cgroup/memory")):
        return "no memory cgroup controller mounted"
    return None


@pytest.mark.skipif(can_make_a_cgroup() is not None, reason=str(can_make_a_cgroup()))
def test_memcap_lets_what_fits_run_and_the_kernel_kills_what_does_not():
    cap = os.path.join(BENCH, "memcap.sh")
    small = subprocess.run([cap, "256M", sys.executable, "-c", "b = bytearray(32 << 20)"],
                           capture_output=True, text=True)
    assert small.returncode == 0, small.stderr
    assert "oom_kills=0" in small.stderr and "limit_bytes=268435456" in small.stderr
    big = subprocess.run([cap, "64M", sys.executable, "-c",
                          "b = bytearray(512 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1"],
                         capture_output=True, text=True)
    assert big.returncode == 137, big.stderr
    assert "oom_kills=1" in big.stderr
    bad = subprocess.run([cap, "lots", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a number" in bad.stderr


def test_a_summary_of_the_repeats_alone_counts_no_sweep_point():
    def row(label, policy, step, rss, losses=(3.0, 2.0)):
        return {"label": label, "policy": policy, "fits": True, "step_seconds": step,
                "peak_rss_bytes": rss, "losses": list(losses)}
    results = {"zero-default": [row("zero-default", "zero-infinity", 8.0, 7000)] * 2,
               "memascend 25%": [row("memascend 25%", "memascend", 12.0, 1500)] * 2}
    rng = frontier.random.Random(1)
    s = frontier.summarize(results, [], rng)
    assert [p["label"] for p in s["points"]] == ["zero-default", "memascend 25%"]
    [st] = s["statements"]
    assert st["time_ratio_at_rss"] == pytest.approx(1.5) and st["rss_ratio_at_time"] is None
    assert s["distinct_loss_sequences"] == 1
    # an earlier sweep's run (under other rules) is a point only when passed
    old = {"label": "zero old", "step_seconds": 20.0, "peak_rss_bytes": 2000}
    assert len(frontier.summarize(results, [old], rng)["statements"]) == 2

