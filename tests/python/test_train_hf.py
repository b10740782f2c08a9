"""memascend-train on Hugging Face Llama checkpoints, checked against PyTorch.

A checkpoint written here (by this file's own safetensors writer, test_llama_reference's)
goes in with --init-from; the trainer's evaluation (--eval, fp32 from the master weights)
must be PyTorch's loss on the same windows; what it exports (--export) must carry Hugging
Face's names, shapes, dtypes and config, sharded with an index when asked, and PyTorch's
loss on the exported weights must be the trainer's evaluation after training. The run
with checkpointed activations must give the losses of the run without, bit for bit, as
must the offloaded, in-memory and ZeRO-Infinity-policy runs on the BLAS path. Bad inputs
are refused with the file and what is wrong named. ctest passes the binary in
MEMASCEND_TRAIN.
"""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import test_llama_reference as ref  # noqa: E402  (the PyTorch Llama and the writer)

BIN = os.environ.get("MEMASCEND_TRAIN")
pytestmark = pytest.mark.skipif(not BIN, reason="MEMASCEND_TRAIN is not set (run by ctest)")

SEQ, BATCH = 12, 2
TORCH_OF = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_any(path):
    """A safetensors file in any of the three float dtypes, as fp32, with its dtypes."""
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out, dtypes = {}, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        raw = bytearray(blob[8 + n + b:8 + n + end])
        if e["dtype"] == "BF16":
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16)
        else:
            t = torch.frombuffer(raw, dtype=TORCH_OF[e["dtype"]])
        out[name] = t.reshape(e["shape"]).float()
        dtypes[name] = e["dtype"]
    return out, dtypes, header.get("__metadata__")


def write_ids(path, ids):
    path.write_bytes(torch.as_tensor(ids).to(torch.int64).numpy().astype("<u4").tobytes())


@pytest.fixture
def model(tmp_path):
    """A small tied Llama with llama3 rope scaling, stored in bf16, and its data."""
    cfg = ref.config(True, True)
    weights = {k: v.to(torch.bfloat16) for k, v in ref.make(cfg, seed=1).items()}
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    ref.write_safetensors(d / "model.safetensors", weights)
    g = torch.Generator().manual_seed(3)
    write_ids(tmp_path / "train.u32", torch.randint(0, cfg["vocab_size"], (3000,), generator=g))
    # Five whole windows of SEQ + 1 and a partial one (dropped); the last batch is short.
    evals = torch.randint(0, cfg["vocab_size"], (5 * (SEQ + 1) + 4,), generator=g)
    write_ids(tmp_path / "eval.u32", evals)
    return cfg, weights, d, evals[:5 * (SEQ + 1)].view(5, SEQ + 1)


def train(tmp_path, *args, ok=True):
    cmd = [BIN, "--tokens", str(tmp_path / "train.u32"), "--seq", str(SEQ), "--batch",
           str(BATCH), "--volume", str(tmp_path / "run.vol"), "--force", "--json",
           "--quiet"] + [str(a) for a in args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if not ok:
        assert r.returncode != 0, r.stdout
        return r.stderr
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("matmul", ["blas", "exact"])
def test_eval_of_the_imported_model_is_pytorchs_loss(tmp_path, model, matmul):
    cfg, weights, d, windows = model
    out = train(tmp_path, "--init-from", d, "--eval", tmp_path / "eval.u32", "--steps", 0,
                "--matmul", matmul)
    if out["matmul"] != matmul:
        pytest.skip("this build has no BLAS")
    with torch.no_grad():
        want = ref.forward(cfg, {k: v.float() for k, v in weights.items()}, windows).item()
    assert out["eval_tokens"] == 5 * SEQ
    assert out["eval_loss"] == pytest.approx(want, rel=1e-5)


def test_eval_of_a_checkpoint_needs_no_training_tokens(tmp_path, model):
    cfg, weights, d, windows = model
    r = subprocess.run([BIN, "--init-from", str(d), "--eval", str(tmp_path / "eval.u32"),
                        "--steps", "0", "--seq", str(SEQ), "--batch", str(BATCH), "--volume",
                        str(tmp_path / "eval.vol"), "--force", "--json", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with torch.no_grad():
        want = ref.forward(cfg, {k: v.float() for k, v in weights.items()}, windows).item()
    assert out["eval_tokens"] == 5 * SEQ
    assert out["eval_loss"] == pytest.approx(want, rel=1e-4)
    # No step ran: no training figures are claimed.
    assert out["losses"] == [] and out["final_loss"] is None and out["steps"] == 0
    assert out["step_seconds"] == [] and out["skipped_steps"] == 0
    # The same without --json: the report says so.
    r = subprocess.run([BIN, "--init-from", str(d), "--eval", str(tmp_path / "eval.u32"),
                        "--steps", "0", "--seq", str(SEQ), "--batch", str(BATCH), "--volume",
                        str(tmp_path / "eval.vol"), "--force"], capture_output=True, text=True)
    assert r.returncode == 0 and "no training steps" in r.stdout and "eval:" in r.stdout, r.stderr


def test_trained_model_exports_in_hugging_faces_layout_and_pytorch_agrees(tmp_path, model):
    cfg, weights, d, windows = model
    out = train(tmp_path, "--init-from", d, "--eval", tmp_path / "eval.u32", "--steps", 4,
                "--dtype", "bf16", "--lr", "1e-2", "--warmup", 0, "--export", tmp_path / "out",
                "--export-dtype", "F32")
    assert len(out["losses"]) == 4
    got, dtypes, meta = read_any(tmp_path / "out" / "model.safetensors")
    assert meta == {"format": "pt"}
    assert set(got) == set(weights) and set(dtypes.values()) == {"F32"}
    for name, w in weights.items():
        assert got[name].shape == w.shape, name
    assert not torch.equal(got["model.embed_tokens.weight"],
                           weights["model.embed_tokens.weight"].float())  # it trained
    back = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
                "rope_theta", "rms_norm_eps"):
        assert back[key] == cfg[key], key
    assert back["rope_scaling"]["rope_type"] == "llama3" and back["torch_dtype"] == "float32"
    # The exported weights are the ones the trainer evaluated (its fp32 master weights).
    with torch.no_grad():
        assert ref.forward(back, got, windows).item() == pytest.approx(out["eval_loss"], rel=1e-5)
    # Exported again from the export: the same tensors, bit for bit.
    again = train(tmp_path, "--init-from", tmp_path / "out", "--steps", 0, "--export",
                  tmp_path / "out2")
    assert again["export_bytes"] == out["export_bytes"]
    got2, dtypes2, _ = read_any(tmp_path / "out2" / "model.safetensors")
    assert set(dtypes2.values()) == {"F32"}  # the import's dtype by default
    for name in got:
        assert torch.equal(got[name], got2[name]), name


def test_export_defaults_to_the_imports_dtype_and_shards_with_an_index(tmp_path, model):
    cfg, weights, d, _ = model
    out = train(tmp_path, "--init-from", d, "--steps", 0, "--export", tmp_path / "out",
                "--export-shard", 20000)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 2 and "model.safetensors" not in files
    assert all(f.endswith(f"-of-{len(shards):05}.safetensors") for f in shards)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)
    total = 0
    for shard in shards:
        got, dtypes, _ = read_any(tmp_path / "out" / shard)
        assert set(dtypes.values()) == {"BF16"}
        for name, t in got.items():
            assert index["weight_map"][name] == shard
            assert torch.equal(t, weights[name].float()), name  # bf16 in, bf16 out: exact
            total += 2 * t.numel()
    assert index["metadata"]["total_size"] == total == out["export_bytes"]
    # The sharded export imports like any checkpoint.
    train(tmp_path, "--init-from", tmp_path / "out", "--steps", 0)


def test_a_group_of_mixed_dtypes_imports_every_tensor_exactly(tmp_path, model):
    """A layer whose tensors are stored in different dtypes (a checkpoint's norms in fp16 or
    fp32 beside bf16 projections) is read through fp32: a bf16 value beyond fp16's range, or
    an fp32 norm weight, comes back as stored (read through the first tensor's fp16 it was
    inf, through bf16 rounded)."""
    cfg, weights, _, _ = model
    mixed = {}
    for name, w in weights.items():
        if "input_layernorm" in name:
            mixed[name] = w.to(torch.float16)
        elif "post_attention_layernorm" in name:
            mixed[name] = w.float() + 1e-4  # not a bf16 value
        else:
            mixed[name] = w.clone()
    mixed["model.layers.0.self_attn.q_proj.weight"][0, 0] = 1e5  # past fp16's 65504
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    ref.write_safetensors(d / "model.safetensors", mixed)
    train(tmp_path, "--init-from", d, "--steps", 0, "--export", tmp_path / "out",
          "--export-dtype", "F32")
    got, _, _ = read_any(tmp_path / "out" / "model.safetensors")
    for name, w in mixed.items():
        assert torch.equal(got[name], w.float()), name


def test_an_existing_export_is_refused_unless_overwritten(tmp_path, model):
    _, _, d, _ = model
    target = tmp_path / "out"
    train(tmp_path, "--init-from", d, "--steps", 0, "--export", target)
    before = (target / "model.safetensors").read_bytes()
    err = train(tmp_path, "--init-from", d, "--steps", 1, "--export", target, ok=False)
    assert "already holds a model" in err and "--export-overwrite" in err
    assert (target / "model.safetensors").read_bytes() == before  # untouched
    # Nor is the imported model's own directory written over.
    err = train(tmp_path, "--init-from", d, "--steps", 0, "--export", d, ok=False)
    assert "already holds a model" in err
    train(tmp_path, "--init-from", d, "--steps", 1, "--export", target, "--export-overwrite",
          "--export-shard", 20000)
    names = sorted(p.name for p in target.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names


def test_an_export_keeps_what_is_not_its_own_and_the_tokenizers_ids(tmp_path, model):
    """--export-overwrite replaces the export's own files only (a user's model_ema.safetensors
    or model.safetensors.bak stays); the config carries the special token ids generation
    reads; a new directory given with a trailing slash is made."""
    cfg, _, _, _ = model
    cfg = dict(cfg, bos_token_id=90, eos_token_id=[91, 92], pad_token_id=-1)  # LLaMA-1's pad
    d = tmp_path / "ids"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    ref.write_safetensors(d / "model.safetensors", ref.make(cfg, seed=1))
    target = tmp_path / "out"
    train(tmp_path, "--init-from", d, "--steps", 0, "--export", str(target) + "/")
    exported = json.loads((target / "config.json").read_text())
    assert exported["bos_token_id"] == 90 and exported["eos_token_id"] == [91, 92]
    assert exported["pad_token_id"] == -1
    (target / "model_ema.safetensors").write_bytes(b"the user's EMA weights")
    (target / "model.safetensors.bak").write_bytes(b"the user's backup")
    train(tmp_path, "--init-from", d, "--steps", 0, "--export", target, "--export-overwrite",
          "--export-shard", 20000)
    assert (target / "model_ema.safetensors").read_bytes() == b"the user's EMA weights"
    assert (target / "model.safetensors.bak").read_bytes() == b"the user's backup"
    assert not (target / "model.safetensors").exists()  # the old export's, replaced
    # A token id that is not one is refused naming the key.
    (d / "config.json").write_text(json.dumps(dict(cfg, eos_token_id="</s>")))
    err = train(tmp_path, "--init-from", d, "--steps", 0, ok=False)
    assert "eos_token_id" in err


def test_a_config_transformers_would_refuse_is_refused(tmp_path, model):
    """A llama3 rope without one of its four numbers (transformers refuses it; the trainer
    guessed them), sizes whose products overflow 64 bits, and a config.json that is a FIFO
    (it waited for a writer forever) or a directory."""
    cfg, _, d, _ = model
    bad = tmp_path / "bad"
    bad.mkdir()
    rope = dict(cfg["rope_scaling"])
    del rope["original_max_position_embeddings"]
    (bad / "config.json").write_text(json.dumps(dict(cfg, rope_scaling=rope)))
    err = train(tmp_path, "--config", bad / "config.json", "--steps", 1, ok=False)
    assert "original_max_position_embeddings" in err and "rope_scaling" in err
    (bad / "config.json").write_text(json.dumps(
        dict(cfg, num_attention_heads=2 ** 24, num_key_value_heads=2 ** 24, head_dim=2 ** 40)))
    err = train(tmp_path, "--config", bad / "config.json", "--steps", 1, ok=False)
    assert "num_attention_heads" in err and "bound" in err
    (bad / "config.json").unlink()
    os.mkfifo(bad / "config.json")
    err = train(tmp_path, "--config", bad / "config.json", "--steps", 1, ok=False)
    assert "a FIFO" in err
    (bad / "config.json").unlink()
    (bad / "config.json").mkdir()
    err = train(tmp_path, "--config", bad / "config.json", "--steps", 1, ok=False)
    assert "a directory" in err


def test_checkpointed_activations_blas_and_policies_keep_the_bits(tmp_path, model):
    _, _, d, _ = model
    common = ["--init-from", d, "--steps", 5, "--dtype", "bf16", "--lr", "1e-2", "--threads", 2]
    base = train(tmp_path, *common)
    ckpt = train(tmp_path, *common, "--checkpoint-activations", "--host-budget", "2x")
    assert ckpt["checkpoint_activations"] and ckpt["losses"] == base["losses"]
    in_memory = train(tmp_path, *common, "--mode", "reference")
    assert in_memory["losses"] == base["losses"]
    # ZeRO-Infinity's rules (the baseline of docs/benchmarks.md), checkpoints in memory.
    zero = train(tmp_path, *common, "--policy", "zero-infinity", "--checkpoint-activations")
    assert zero["policy"] == "zero-infinity" and zero["losses"] == base["losses"]
    assert base["activation_bytes"] > ckpt["activation_bytes"]


def test_config_alone_builds_a_random_model(tmp_path, model):
    cfg, _, d, _ = model
    out = train(tmp_path, "--config", d / "config.json", "--steps", 3, "--eval",
                tmp_path / "eval.u32")
    assert out["model"] == "llama" and len(out["losses"]) == 3
    params = sum(t.numel() for t in ref.make(cfg, seed=1).values())
    assert out["params"] == params
    # transformers' initialisation, N(0, 0.02): the loss starts near ln(vocab).
    assert abs(out["losses"][0] - torch.log(torch.tensor(97.0)).item()) < 0.1


def test_bad_inputs_are_refused_naming_what_is_wrong(tmp_path, model):
    cfg, weights, d, _ = model
    (tmp_path / "odd.u32").write_bytes(b"\x01\x00\x00\x00\x02\x00")
    err = train(tmp_path, "--init-from", d, "--tokens", tmp_path / "odd.u32", ok=False)
    assert "odd.u32" in err and "not a whole number of uint32" in err
    write_ids(tmp_path / "big.u32", [1, 2, 97, 3])
    err = train(tmp_path, "--init-from", d, "--tokens", tmp_path / "big.u32", ok=False)
    assert "token id 97 at position 2" in err and "vocabulary of 97" in err
    err = train(tmp_path, "--init-from", d, "--eval", tmp_path / "big.u32", ok=False)
    assert "big.u32" in err and "token id 97" in err
    # A Hugging Face model trains on token ids, not on the demo's text.
    r = subprocess.run([BIN, "--init-from", str(d), "--volume", str(tmp_path / "v.vol"),
                        "--force"], capture_output=True, text=True)
    assert r.returncode == 1 and "--tokens" in r.stderr
    # Another architecture is refused naming the file and the key.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    err = train(tmp_path, "--config", other / "config.json", ok=False)
    assert "model_type" in err and "mistral" in err and "config.json" in err
    # A truncated checkpoint names the file and the tensor.
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[:len(blob) - 100])
    err = train(tmp_path, "--init-from", d, "--steps", 0, ok=False)
    assert "model.safetensors" in err


def test_outputs_are_checked_before_the_first_step_and_never_written_over_inputs(tmp_path, model):
    _, _, d, _ = model
    eval_file = tmp_path / "eval.u32"
    eval_bytes = eval_file.read_bytes()
    config_bytes = (d / "config.json").read_bytes()
    weights_bytes = (d / "model.safetensors").read_bytes()
    # The timeline is not a token file of the run, nor a file of the checkpoint imported.
    err = train(tmp_path, "--init-from", d, "--steps", 2, "--eval", eval_file, "--timeline",
                eval_file, ok=False)
    assert "is a token file of this run" in err
    err = train(tmp_path, "--init-from", d, "--steps", 2, "--timeline", d / "config.json", ok=False)
    assert "is a file of the checkpoint --init-from" in err
    # Nor is the volume (which --force formats).
    cmd = [BIN, "--tokens", str(tmp_path / "train.u32"), "--seq", str(SEQ), "--init-from", str(d),
           "--volume", str(d / "model.safetensors"), "--force", "--steps", "1", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "is a file of the checkpoint --init-from" in r.stderr, r.stderr
    assert eval_file.read_bytes() == eval_bytes
    assert (d / "config.json").read_bytes() == config_bytes
    assert (d / "model.safetensors").read_bytes() == weights_bytes
    # A timeline whose folder does not exist, and an export over a model, are refused before
    # the first step (the message comes from the checks, not from the end of the run).
    err = train(tmp_path, "--init-from", d, "--steps", 500, "--timeline",
                tmp_path / "missing" / "t.csv", ok=False)
    assert "its folder" in err and "does not exist" in err
    err = train(tmp_path, "--init-from", d, "--steps", 500, "--export", d, ok=False)
    assert err.startswith("memascend-train: --export: directory") and "--export-overwrite" in err
