"""A small GPT written in PyTorch, the model the Python tests train."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # No bias: the key's would get a gradient of zero plus rounding noise (softmax does
        # not see it), which Adam turns into full-size steps in a direction that noise
        # picks; two correct AdamW implementations then part ways.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SharedProjectionBlock(Block):
    """A Block that calls its attention projection twice (on the attention's output, then
    on the block's): a module used twice within one layer."""

    def forward(self, x):
        x = super().forward(x)
        return x + self.proj(x)


class GPT(nn.Module):
    def __init__(self, vocab=256, d=64, layers=2, heads=4, seq=32, block=Block):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class CheckpointedGPT(GPT):
    """GPT with each block under torch's non-reentrant checkpoint (as transformers'
    gradient_checkpointing_enable), which from torch 2.1 stops a recomputation once it has
    what it needs; `on_input_grad` is called when the first block's backward is done."""
    on_input_grad = None
    gradient_checkpointing = True  # as transformers marks a model it checkpoints

    def forward(self, idx, targets):
        from torch.utils.checkpoint import checkpoint
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        if x.requires_grad and self.on_input_grad is not None:
            x.register_hook(lambda g: self.on_input_grad())
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        logits = self.head(self.ln(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 targets.reshape(-1))


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(**kw)


def batch(step, vocab=256, batch_size=4, seq=32):
    """Step `step`'s tokens: the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train_accumulating(model, opt, steps=6, micro=2, device="cpu"):
    """Each step `micro` micro-batches (batch(step * micro + k)), each loss divided by
    `micro` before its backward, then opt.step(); the steps' mean losses."""
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(micro):
            x, y = (t.to(device) for t in batch(step * micro + k))
            loss = model(x, y)
            (loss / micro).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / micro)
    return losses
