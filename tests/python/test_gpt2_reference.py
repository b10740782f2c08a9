"""The trainer's GPT-2 against PyTorch, on Hugging Face's GPT-2 layout.

The PyTorch side is written here from Hugging Face's definitions (GPT2LMHeadModel: learned
token and position embeddings, pre-norm blocks whose attention and MLP weights are Conv1D
[in, out] (y = x W + b), gelu_new, LayerNorm eps 1e-5, the head tied to wte unless the
config unties it). The checkpoint is written with the names GPT2LMHeadModel saves
("transformer.h.0.attn.c_attn.weight") or those of the original checkpoints (no
"transformer." prefix), with the attention mask buffer ("attn.bias") beside them, which the
trainer must ignore. hf-reference (MEMASCEND_HF_REFERENCE) gives the loss, every gradient
in Hugging Face's layout and one AdamW step; memascend-train (MEMASCEND_TRAIN) imports,
evaluates, trains and exports.
"""
import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import test_llama_reference as ref  # noqa: E402  (the safetensors writer and reader)
import test_train_hf as hf  # noqa: E402  (any-dtype reader, token files)

BIN = os.environ.get("MEMASCEND_HF_REFERENCE")
TRAIN = os.environ.get("MEMASCEND_TRAIN")
pytestmark = pytest.mark.skipif(not BIN or not TRAIN,
                                reason="MEMASCEND_HF_REFERENCE / MEMASCEND_TRAIN unset (ctest)")

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def config(tied=True):
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 97,
            "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 20, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": tied, "torch_dtype": "float32"}


def make(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    c, v, p = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    shapes = {"transformer.wte.weight": (v, c), "transformer.wpe.weight": (p, c),
              "transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
    for l in range(cfg["n_layer"]):
        pre = f"transformer.h.{l}."
        shapes.update({pre + "ln_1.weight": (c,), pre + "ln_1.bias": (c,),
                       pre + "attn.c_attn.weight": (c, 3 * c), pre + "attn.c_attn.bias": (3 * c,),
                       pre + "attn.c_proj.weight": (c, c), pre + "attn.c_proj.bias": (c,),
                       pre + "ln_2.weight": (c,), pre + "ln_2.bias": (c,),
                       pre + "mlp.c_fc.weight": (c, 4 * c), pre + "mlp.c_fc.bias": (4 * c,),
                       pre + "mlp.c_proj.weight": (4 * c, c), pre + "mlp.c_proj.bias": (c,)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, c)
    out = {}
    for name, shape in shapes.items():
        base = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
        out[name] = base + 0.1 * torch.randn(shape, generator=g)
    return out


def forward(cfg, p, ids):
    b, t1 = ids.shape
    seq = t1 - 1
    x_ids, y = ids[:, :-1], ids[:, 1:]
    c, nh = cfg["n_embd"], cfg["n_head"]
    hd, eps = c // nh, cfg["layer_norm_epsilon"]
    x = p["transformer.wte.weight"][x_ids] + p["transformer.wpe.weight"][:seq]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for l in range(cfg["n_layer"]):
        pre = f"transformer.h.{l}."
        h = F.layer_norm(x, (c,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], eps)
        qkv = h @ p[pre + "attn.c_attn.weight"] + p[pre + "attn.c_attn.bias"]
        q, k, v = (t.view(b, seq, nh, hd).transpose(1, 2) for t in qkv.split(c, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, seq, c)
        x = x + o @ p[pre + "attn.c_proj.weight"] + p[pre + "attn.c_proj.bias"]
        h = F.layer_norm(x, (c,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], eps)
        h = F.gelu(h @ p[pre + "mlp.c_fc.weight"] + p[pre + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ p[pre + "mlp.c_proj.weight"] + p[pre + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (c,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], eps)
    head = p["transformer.wte.weight"] if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = x @ head.T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def write_checkpoint(d, cfg, weights, dtype=torch.float32, prefix=True):
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    stored = {}
    for name, t in weights.items():
        key = name if prefix or name == "lm_head.weight" else name[len("transformer."):]
        stored[key] = t.to(dtype)
    n = cfg["n_positions"]
    for l in range(cfg["n_layer"]):  # the causal mask buffer older checkpoints carry
        stored[("transformer." if prefix else "") + f"h.{l}.attn.bias"] = \
            torch.ones(1, 1, n, n).tril().to(dtype)
    ref.write_safetensors(d / "model.safetensors", stored)


@pytest.mark.parametrize("tied,prefix,dtype", [
    (True, True, torch.float32), (True, False, torch.float32), (False, True, torch.bfloat16)])
def test_loss_and_every_gradient_agree_with_pytorch(tmp_path, tied, prefix, dtype):
    cfg = config(tied)
    weights = make(cfg, seed=1)
    write_checkpoint(tmp_path, cfg, weights, dtype, prefix)
    stored = {k: v.to(dtype) for k, v in weights.items()}
    # Conv1D gradients come in [in, out], as the weights.
    ref.expect_reference(tmp_path, forward, cfg, stored)


def test_trainer_imports_trains_and_exports_gpt2s_layout(tmp_path):
    cfg = config(True)
    weights = make(cfg, seed=3)
    model = tmp_path / "model"
    write_checkpoint(model, cfg, weights, torch.float32, prefix=False)
    g = torch.Generator().manual_seed(4)
    hf.write_ids(tmp_path / "train.u32", torch.randint(0, 97, (2000,), generator=g))
    evals = torch.randint(0, 97, (4 * 13,), generator=g)
    hf.write_ids(tmp_path / "eval.u32", evals)
    windows = evals.view(4, 13)
    out = hf.train(tmp_path, "--init-from", model, "--eval", tmp_path / "eval.u32", "--steps", 0)
    with torch.no_grad():
        assert out["eval_loss"] == pytest.approx(forward(cfg, weights, windows).item(), rel=1e-5)
    out = hf.train(tmp_path, "--init-from", model, "--eval", tmp_path / "eval.u32", "--steps", 3,
                   "--dtype", "bf16", "--lr", "1e-2", "--export", tmp_path / "out")
    assert out["model"] == "gpt2"
    got, dtypes, _ = hf.read_any(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(weights)  # "transformer." names, no lm_head, no buffers
    assert set(dtypes.values()) == {"F32"}
    for name, w in weights.items():
        assert got[name].shape == w.shape, name
    back = json.loads((tmp_path / "out" / "config.json").read_text())
    assert back["model_type"] == "gpt2" and back["n_positions"] == 20
    with torch.no_grad():
        assert forward(back, got, windows).item() == pytest.approx(out["eval_loss"], rel=1e-5)
    # A bf16 checkpoint exports in bf16 by default (its "transformer.wte.weight"'s dtype).
    write_checkpoint(tmp_path / "bf16", cfg, weights, torch.bfloat16)
    hf.train(tmp_path, "--init-from", tmp_path / "bf16", "--steps", 0, "--export",
             tmp_path / "bf16-out")
    _, dtypes, _ = hf.read_any(tmp_path / "bf16-out" / "model.safetensors")
    assert set(dtypes.values()) == {"BF16"}
    # Checkpointed activations, the offloaded and the in-memory runs: the same bits.
    common = ["--init-from", model, "--steps", 3, "--dtype", "bf16", "--lr", "1e-2"]
    base = hf.train(tmp_path, *common)
    assert hf.train(tmp_path, *common, "--checkpoint-activations")["losses"] == base["losses"]
    assert hf.train(tmp_path, *common, "--mode", "reference")["losses"] == base["losses"]


def test_a_gpt2_the_kernels_do_not_compute_is_refused(tmp_path):
    cfg = dict(config(True), n_inner=100)
    write_checkpoint(tmp_path / "m", cfg, make(config(True), seed=1))
    hf.write_ids(tmp_path / "train.u32", list(range(50)))
    err = hf.train(tmp_path, "--init-from", tmp_path / "m", "--steps", 0, ok=False)
    assert "n_inner 100" in err
    cfg = config(True)
    write_checkpoint(tmp_path / "m", cfg, make(cfg, seed=1))
    err = hf.train(tmp_path, "--init-from", tmp_path / "m", "--steps", 0, "--seq", 21, ok=False)
    assert "--seq 21 is longer than the model's 20 learned positions" in err
