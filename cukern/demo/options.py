"""The demo model's size and its command-line flags (no torch import: ``python -m cukern``
builds its parser from this without loading torch)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class Config:
    """A GPT-2-style decoder; the defaults are about 356M parameters at sequence 2048."""
    layers: int = 24
    dim: int = 1024
    heads: int = 16
    vocab: int = 50304
    seq: int = 2048
    norm: str = "layer"   # "layer" or "rms"


def add_model_args(p: argparse.ArgumentParser) -> None:
    d = Config()
    g = p.add_argument_group("model (the defaults: the 356M demo GPT)")
    g.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    g.add_argument("--dim", type=int, default=d.dim, help="model width")
    g.add_argument("--heads", type=int, default=d.heads, help="attention heads (head_dim = dim / heads)")
    g.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (the embedding and the tied head)")
    g.add_argument("--seq", type=int, default=d.seq, help="sequence length")
    g.add_argument("--norm", choices=("layer", "rms"), default=d.norm, help="LayerNorm or RMSNorm")
    g.add_argument("--batch", type=int, default=8, help="sequences a micro-batch (a rank)")


def config(a) -> Config:
    return Config(layers=a.layers, dim=a.dim, heads=a.heads, vocab=a.vocab, seq=a.seq, norm=a.norm)
