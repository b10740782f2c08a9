"""The trainer's Llama against PyTorch: the same checkpoint, the same tokens, the same loss
and every parameter's gradient within float tolerances.

The PyTorch side is written here from Hugging Face's definitions (LlamaForCausalLM:
RMSNorm in fp32, rotate-half rotary embeddings with llama3 rescaling of the inverse
frequencies, grouped-query attention, SwiGLU, tied or untied head) and writes its weights
as a safetensors checkpoint with its own writer, so the C++ reader is checked against a
writer it does not share code with. The C++ side is hf-reference (built with the
tests; ctest passes its path in MEMASCEND_HF_REFERENCE).
"""
import json
import math
import os
import struct
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bench", "gpu"))
from llama import inv_freq, rms_norm, rotate_half  # noqa: E402  (shared with the benchmark)

BIN = os.environ.get("MEMASCEND_HF_REFERENCE")
pytestmark = pytest.mark.skipif(not BIN, reason="MEMASCEND_HF_REFERENCE is not set (run by ctest)")

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors(path, tensors, pad=True):
    """The format's own layout: u64 header length, JSON header, the data."""
    header, data, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16 \
            else t.contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(raw)]}
        data.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(data))


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32"
        b, end = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(blob[8 + n + b:8 + n + end]),
                                     dtype=torch.float32).reshape(e["shape"])
    return out


def forward(cfg, p, ids):
    b, t1 = ids.shape
    seq = t1 - 1
    x_ids, y = ids[:, :-1], ids[:, 1:]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps = cfg["rms_norm_eps"]
    freqs = torch.arange(seq).float()[:, None] * inv_freq(cfg)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = p["model.embed_tokens.weight"][x_ids]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(b, seq, nh, hd).transpose(1, 2)
        k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(b, seq, nkv, hd).transpose(1, 2)
        v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(b, seq, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, seq, nh * hd)
        x = x + o @ p[pre + "self_attn.o_proj.weight"].T
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = h @ p[pre + "mlp.gate_proj.weight"].T
        up = h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    x = rms_norm(x, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = x @ head.T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    c, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, i, v = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, \
        cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, c), "model.norm.weight": (c,)}
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}."
        shapes.update({pre + "input_layernorm.weight": (c,), pre + "self_attn.q_proj.weight": (q, c),
                       pre + "self_attn.k_proj.weight": (kv, c),
                       pre + "self_attn.v_proj.weight": (kv, c),
                       pre + "self_attn.o_proj.weight": (c, q),
                       pre + "post_attention_layernorm.weight": (c,),
                       pre + "mlp.gate_proj.weight": (i, c), pre + "mlp.up_proj.weight": (i, c),
                       pre + "mlp.down_proj.weight": (c, i)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, c)
    p = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            p[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            p[name] = 0.08 * torch.randn(shape, generator=g)
    return p


def config(tied, scaling):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97,
           "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "rope_theta": 500000.0, "tie_word_embeddings": tied, "torch_dtype": "float32",
           "rope_scaling": None}
    if scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return cfg


@pytest.mark.parametrize("tied,scaling,dtype", [
    (True, True, torch.float32), (False, True, torch.float32), (True, False, torch.float32),
    (False, True, torch.bfloat16)])
def test_loss_and_every_gradient_agree_with_pytorch(tmp_path, tied, scaling, dtype):
    cfg = config(tied, scaling)
    weights = make(cfg, seed=1)
    stored = {k: v.to(dtype) for k, v in weights.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(tmp_path / "model.safetensors", stored)
    expect_reference(tmp_path, forward, cfg, stored)


def expect_reference(model_dir, forward_fn, cfg, stored, batch=2, seq=12):
    """hf-reference over the checkpoint in `model_dir` and random token ids against
    PyTorch: the loss, every gradient (in the checkpoint's layout) and one AdamW step,
    from the weights as stored, in fp32."""
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq + 1),
                        generator=torch.Generator().manual_seed(2))
    (model_dir / "tokens.u32").write_bytes(ids.to(torch.int32).numpy().astype("<u4").tobytes())
    out = model_dir / "out.safetensors"
    r = subprocess.run([BIN, str(model_dir), str(model_dir / "tokens.u32"), str(batch), str(seq),
                        str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = read_safetensors(out)
    p = {k: v.float().requires_grad_() for k, v in stored.items()}
    loss = forward_fn(cfg, p, ids)
    loss.backward()
    assert float(got["loss"][0]) == pytest.approx(loss.item(), rel=1e-5)
    assert len([k for k in got if k.startswith("grad.")]) == len(p)
    for name, t in p.items():
        g = got["grad." + name]
        assert g.shape == t.grad.shape, name
        scale = t.grad.abs().max().item()
        assert (g - t.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name
    # One step of torch.optim.AdamW from the same weights over the C++ gradients (the
    # optimizer checked apart from the gradients' rounding, which Adam's first step, about
    # lr x sign(g), would magnify where g is near zero).
    ref = {k: torch.nn.Parameter(v.detach().float().clone()) for k, v in stored.items()}
    for name, t in ref.items():
        t.grad = got["grad." + name].clone()
    torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1).step()
    for name, t in ref.items():
        assert torch.allclose(got["param." + name], t.detach(), rtol=1e-6, atol=1e-7), name


def test_a_checkpoint_that_does_not_fit_the_config_is_refused_naming_the_tensor(tmp_path):
    cfg = config(True, False)
    weights = make(cfg, seed=1)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(47, 32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(tmp_path / "model.safetensors", weights)
    (tmp_path / "tokens.u32").write_bytes(bytes(4 * 2 * 13))
    r = subprocess.run([BIN, str(tmp_path), str(tmp_path / "tokens.u32"), "2", "12",
                        str(tmp_path / "out.safetensors")], capture_output=True, text=True)
    assert r.returncode == 1
    assert "model.layers.1.mlp.up_proj.weight" in r.stderr and "[47, 32]" in r.stderr
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(tmp_path / "model.safetensors", weights)
    r = subprocess.run([BIN, str(tmp_path), str(tmp_path / "tokens.u32"), "2", "12",
                        str(tmp_path / "out.safetensors")], capture_output=True, text=True)
    assert r.returncode == 1 and "no tensor 'model.layers.1.mlp.up_proj.weight'" in r.stderr
