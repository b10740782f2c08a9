"""`memascend plan` against measured memascend-train runs (three small models), and
memascend.plan() against the CLI.

What is compared, each within 10%:
- disk: the plan's disk_bytes against the size of the volume file the run made;
- pinned: the plan's pinned_bytes against the run's peak pinned bytes (the ledger's);
- I/O per step: the plan's io_bytes_per_step against the median of the run's per-step
  store traffic (reads and writes), with the default budget (the state resident: only
  writes); with a small given budget (part of the state streams) within 25% only;
- peak RSS: the plan's peak_rss_bytes with --base-rss set to a base measured here (a
  one-block demo GPT run's peak RSS less what the plan models for it: the binary, its libraries and
  heap), against the run's peak RSS. A tiny run's RSS is mostly that base, so the parts
  the plan models (budget, working buffers, activations) are also compared alone, against
  the measured RSS less the base, within 10% of the measured RSS.
Needs MEMASCEND_TRAIN and MEMASCEND_CLI (the binaries; ctest sets them).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

TRAIN = os.environ.get("MEMASCEND_TRAIN")
CLI = os.environ.get("MEMASCEND_CLI")
pytestmark = pytest.mark.skipif(not TRAIN or not CLI,
                                reason="MEMASCEND_TRAIN and MEMASCEND_CLI not set")

LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128,
         "intermediate_size": 352, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256,
         "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5}
GPT2 = {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 192, "n_layer": 3, "n_head": 3,
        "n_positions": 128, "tie_word_embeddings": True, "activation_function": "gelu_new"}
# name: (config or None for the demo GPT, model flags, seq, batch)
MODELS = {
    "demo_gpt": (None, [], 64, 8),
    "tiny_llama": (LLAMA, [], 64, 4),
    "gpt2_small": (GPT2, [], 64, 4),
}


def _within(plan: float, measured: float, tol: float = 0.10) -> bool:
    return abs(plan - measured) <= tol * measured


def _tokens(path: Path) -> Path:
    rng = random.Random(1)
    path.write_bytes(struct.pack("<20000I", *[rng.randrange(512) for _ in range(20000)]))
    return path


def _model_args(tmp: Path, name: str) -> tuple[list[str], list[str]]:
    config, flags, seq, batch = MODELS[name]
    common = ["--seq", str(seq), "--batch", str(batch)] + flags
    if config is None:
        return common, common
    cfg = tmp / f"{name}.json"
    cfg.write_text(json.dumps(config))
    return (common + ["--config", str(cfg), "--tokens", str(_tokens(tmp / "tok.bin"))],
            common + ["--config", str(cfg)])


def _train(tmp: Path, args: list[str], steps: int = 4) -> tuple[dict[str, Any], int]:
    vol = tmp / "run.vol"
    r = subprocess.run([TRAIN, *args, "--steps", str(steps), "--volume", str(vol), "--force",
                        "--json", "--quiet", "--sample", "0", "--threads", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), vol.stat().st_size


def _plan(args: list[str]) -> dict[str, Any]:
    r = subprocess.run([CLI, "plan", *args, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def base_rss(tmp_path_factory: pytest.TempPathFactory) -> int:
    """A one-block demo GPT run's peak RSS less what the plan models for it."""
    tmp = tmp_path_factory.mktemp("base")
    run, _ = _train(tmp, ["--layers", "1"], steps=2)  # the demo GPT's one-block version
    p = _plan(["--layers", "1"])
    modeled = p["memascend"]["pinned_bytes"] + p["memascend"]["pageable_bytes"]
    return max(run["peak_rss_bytes"] - modeled, 0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_agrees_with_a_measured_run(tmp_path: Path, name: str, base_rss: int) -> None:
    train_args, plan_args = _model_args(tmp_path, name)
    run, volume_bytes = _train(tmp_path, train_args)
    p = _plan(plan_args + ["--base-rss", str(base_rss)])
    m = p["memascend"]
    assert p["model"]["params"] == run["params"]
    figures = {
        "disk": (m["disk_bytes"], volume_bytes),
        "pinned": (m["pinned_bytes"], run["peak_pinned_bytes"]),
        "io_per_step": (m["io_bytes_per_step"], statistics.median(run["step_io_bytes"])),
        "peak_rss": (m["peak_rss_bytes"], run["peak_rss_bytes"]),
    }
    print(name, {k: (a, b, f"{(a - b) / b:+.1%}") for k, (a, b) in figures.items()})
    for what, (planned, measured) in figures.items():
        assert _within(planned, measured), (name, what, planned, measured)
    modeled = m["pinned_bytes"] + m["pageable_bytes"]
    assert abs(modeled - (run["peak_rss_bytes"] - base_rss)) <= 0.10 * run["peak_rss_bytes"]


def test_plan_streaming_io_agrees(tmp_path: Path) -> None:
    """A budget below one version and the gradients: part of the state streams each step
    (Note [plan model]: an interpolation between the minimum budget and that one)."""
    budget = str(8 << 20)
    run, _ = _train(tmp_path, ["--host-budget", budget])
    p = _plan(["--host-budget", budget])
    assert not p["memascend"]["budget_holds_state"]
    measured = statistics.median(run["step_io_bytes"])
    # Not 10%: between the minimum and a resident version the store's eviction decides
    # what is read again, and it varies from run to run (23.3 to 25.1 MB measured here
    # against 21.6 planned); the plan interpolates.
    assert _within(p["memascend"]["io_bytes_per_step"], measured, 0.25), (p["memascend"], measured)
    assert _within(p["memascend"]["pinned_bytes"], run["peak_pinned_bytes"])


def test_python_plan_is_the_cli_plan(tmp_path: Path) -> None:
    import memascend
    cfg = tmp_path / "llama.json"
    cfg.write_text(json.dumps(LLAMA))
    args = ["--config", str(cfg), "--seq", "128", "--batch", "2", "--dtype", "bf16",
            "--host-limit", str(64 << 30), "--gpu-memory", str(8 << 30)]
    py = memascend.plan(cfg, seq=128, batch=2, dtype="bf16", host_limit=64 << 30,
                        gpu_memory=8 << 30)
    assert py == _plan(args)
    assert memascend.plan(LLAMA, seq=128, batch=2, dtype="bf16", host_limit=64 << 30,
                          gpu_memory=8 << 30) == py
    assert py["gpu"]["fits"] is True
    # ZeRO-Infinity: 16 B/param on disk under max_in_cpu; pinned buffers of >= 1e8 elements.
    assert py["zero_infinity"]["disk_bytes"] == 16 * py["model"]["params"]
    assert py["zero_infinity"]["pinned_bytes"] > py["memascend"]["pinned_bytes"]


def test_plan_refusals(tmp_path: Path) -> None:
    import memascend
    with pytest.raises(memascend.InvalidArgumentError):
        memascend.plan({"model_type": "bert", "hidden_size": 8})
    with pytest.raises(memascend.InvalidArgumentError, match="fp16 or bf16"):
        memascend.plan(params=10**9, dtype="fp32")
    with pytest.raises(FileNotFoundError):
        memascend.plan(str(tmp_path / "no-such-config.json"))
    with pytest.raises(memascend.ResourceExhaustedError):
        memascend.plan(params=10**9, host_limit=64 << 20)
    r = subprocess.run([CLI, "plan", "--params", "1000", "--config", "x.json"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not both" in r.stderr
