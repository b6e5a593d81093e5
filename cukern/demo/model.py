"""The demo's model and data: a GPT-2-style decoder in ordinary PyTorch (nn.Embedding,
nn.LayerNorm or nn.RMSNorm, F.scaled_dot_product_attention, nn.Linear, a tied head); cukern
reaches it only through ``cukern.torch.patch()``. The data are sequences that repeat a random
pattern of skewed token frequencies (the loss falls from ln(vocab) as the model learns the
frequencies, then as it learns to copy: an induction task), drawn from a seeded generator, so
two runs see the same batches.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .options import Config


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        norm = nn.RMSNorm if cfg.norm == "rms" else nn.LayerNorm
        self.heads = cfg.heads
        self.ln1, self.ln2 = norm(cfg.dim), norm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.RMSNorm(cfg.dim) if cfg.norm == "rms" else nn.LayerNorm(cfg.dim)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, targets):
        s = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)   # tied head
        # (under autocast the loss is computed in float32 — autocast upcasts cross_entropy's
        # input — so no explicit .float(): a patched model then reads the half logits as they are)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def batch(gen: torch.Generator, b: int, s: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets): each row repeats a random pattern of 16-64 tokens drawn with skewed
    frequencies (token = vocab * u^3), 5% of tokens uniform noise. Drawn on the device with no
    host synchronization, so the host can queue the next step while the GPU runs this one."""
    period = torch.randint(16, 65, (1,), generator=gen, device=device)
    u = torch.rand((b, 64), generator=gen, device=device)
    pattern = (u * u * u * vocab).long().clamp_(max=vocab - 1)
    pos = torch.arange(s + 1, device=device) % period
    seq = pattern.gather(1, pos.expand(b, -1))
    noise = torch.rand(seq.shape, generator=gen, device=device) < 0.05
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen, device=device), seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
