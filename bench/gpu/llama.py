"""A Llama written in PyTorch from Hugging Face's definitions (LlamaForCausalLM): RMSNorm in
fp32, rotate-half rotary embeddings with llama3 rescaling of the inverse frequencies,
grouped-query attention, SwiGLU, a tied or untied head.

Two users: tests/python/test_llama_reference.py checks the C++ trainer against its
functions (`inv_freq`, `rms_norm`, `rotate_half`), and bench/gpu/compare.py trains
`LlamaForCausalLM` below where transformers cannot be imported (Debian's torch 1.13 on the
CPU). The module keeps transformers' parameter names (model.embed_tokens,
model.layers.N.self_attn.q_proj, ...), its `forward(input_ids, labels)` returns an object
with `.loss` (the labels shifted by one, as transformers does) and
`gradient_checkpointing_enable()` recomputes each decoder layer in backward.
"""
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


def inv_freq(cfg):
    dim = cfg["head_dim"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x, w, eps):
    """x / sqrt(mean(x^2) + eps) * w, the normalisation in fp32 and back to x's dtype."""
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(c, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(c, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(c, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, c, bias=False)

    def forward(self, h, cos, sin):
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        att = att.masked_fill(~mask, float("-inf")).float().softmax(-1).to(q.dtype)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(c, i, bias=False)
        self.up_proj = nn.Linear(c, i, bias=False)
        self.down_proj = nn.Linear(i, c, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """transformers' LlamaModel: the embedding, the decoder layers, the final norm; its
    forward returns `.last_hidden_state` (normalised), as transformers' does."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.checkpointing = False

    def forward(self, input_ids):
        t = input_ids.shape[1]
        freqs = torch.arange(t, device=input_ids.device).float()[:, None] * \
            inv_freq(self.cfg).to(input_ids.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return types.SimpleNamespace(last_hidden_state=self.norm(x))


class LlamaForCausalLM(nn.Module):
    """transformers' LlamaForCausalLM's structure and loss, in plain PyTorch."""

    def __init__(self, cfg):
        super().__init__()
        cfg = dict(cfg)
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        self.config = types.SimpleNamespace(**cfg)
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg.get("tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, p in self.named_parameters():  # transformers' initialisation
            if not name.endswith("norm.weight"):
                nn.init.normal_(p, std=0.02)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.model.checkpointing = True

    def forward(self, input_ids, labels=None, logits_to_keep=0):
        hidden = self.model(input_ids).last_hidden_state
        if logits_to_keep:  # transformers': the last tokens' logits only
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss, logits=logits)
