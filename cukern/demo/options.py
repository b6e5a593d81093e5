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
    model: str = "gpt"    # "gpt" (this demo's own) or a Hugging Face model family (MODELS)
    attn_dropout: float = 0.0   # attention-weight dropout of a Hugging Face model (others off)


def add_model_args(p: argparse.ArgumentParser) -> None:
    d = Config()
    g = p.add_argument_group("model (the defaults: the 356M demo GPT)")
    g.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    g.add_argument("--dim", type=int, default=d.dim, help="model width")
    g.add_argument("--heads", type=int, default=d.heads, help="attention heads (head_dim = dim / heads)")
    g.add_argument("--model", type=model_type, default=d.model, metavar="TYPE",
                   help=f"the demo's own GPT, or a Hugging Face transformers model built from a config "
                        f"(needs transformers; patch(model) routes it): {', '.join(MODELS[1:])} (measured "
                        f"at the demo's sizes), or any other transformers model type with a causal-LM head "
                        f"(mixtral, gemma, cohere, ...)")
    g.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: 50304 for the demo GPT, the released model's for the others: "
                        "GPT-2 50257, LLaMA 3 128256, Mistral 32768, Qwen 151936, ...)")
    g.add_argument("--seq", type=int, default=d.seq, help="sequence length")
    g.add_argument("--norm", choices=("layer", "rms"), default=d.norm, help="LayerNorm or RMSNorm")
    g.add_argument("--batch", type=int, default=8, help="sequences a micro-batch (a rank)")
    g.add_argument("--attn-dropout", type=probability, default=0.0, metavar="P",
                   help="attention-weight dropout of a --model built from a config (GPT-2's own default trains "
                        "with 0.1); every other dropout stays off, as in pretraining today")


MODELS = ("gpt", "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite",
          "gpt_neox", "starcoder2")


def probability(text: str) -> float:
    """--attn-dropout: a number in [0, 1)."""
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a probability in [0, 1)")
    return p


def model_type(name: str) -> str:
    """--model: one of MODELS, or a model type transformers builds a causal LM of (checked against
    transformers, imported only for such a name)."""
    if name in MODELS:
        return name
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise argparse.ArgumentTypeError(f"{name!r}: needs transformers (pip install transformers), "
                                         f"or one of {', '.join(MODELS)}") from None
    if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise argparse.ArgumentTypeError(f"{name!r} is not a transformers model type with a causal-LM head "
                                         f"(e.g. {', '.join(MODELS[1:6])}, mixtral, gemma)")
    return name


def config(a) -> Config:
    model = getattr(a, "model", "gpt")
    vocab = a.vocab if a.vocab is not None else (Config.vocab if model == "gpt" else 0)
    p = float(getattr(a, "attn_dropout", 0.0))
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attn_dropout: must be in [0, 1), got {p}")
    if p and model == "gpt":
        raise ValueError("attn_dropout: only with a transformers --model (the demo GPT trains without dropout)")
    return Config(layers=a.layers, dim=a.dim, heads=a.heads, vocab=vocab, seq=a.seq, norm=a.norm, model=model,
                  attn_dropout=p)
