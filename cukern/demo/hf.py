"""Hugging Face ``transformers`` models built from configs (no downloads) for the demo:
GPT-2, LLaMA (grouped-query attention, LLaMA 3's vocabulary) and Mistral, at the demo's width,
depth, heads and sequence length, trained through their own ``forward(input_ids, labels)``."""
from __future__ import annotations

from .options import Config

# The vocabularies of the released models (the demo's --vocab overrides them).
VOCAB = {"gpt2": 50257, "llama": 128256, "mistral": 32768}


def _mlp_width(dim: int, ratio: float) -> int:
    return int(ratio * dim + 255) // 256 * 256


def build(cfg: Config):
    """The model ``cfg.model`` names, in float32 (train it under autocast) with dropout off
    (as in pretraining today), PyTorch's SDPA as its attention."""
    import transformers

    vocab = cfg.vocab or VOCAB[cfg.model]
    kv = max(1, cfg.heads // 4)
    if cfg.model == "gpt2":
        c = transformers.GPT2Config(n_layer=cfg.layers, n_embd=cfg.dim, n_head=cfg.heads, n_positions=cfg.seq,
                                    vocab_size=vocab, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    elif cfg.model == "llama":
        c = transformers.LlamaConfig(hidden_size=cfg.dim, intermediate_size=_mlp_width(cfg.dim, 8 / 3),
                                     num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                     num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=cfg.seq,
                                     rope_theta=500000.0)
        cls = transformers.LlamaForCausalLM
    elif cfg.model == "mistral":
        c = transformers.MistralConfig(hidden_size=cfg.dim, intermediate_size=_mlp_width(cfg.dim, 3.5),
                                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                       num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=cfg.seq)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"model: expected gpt2, llama or mistral, got {cfg.model!r}")
    c._attn_implementation = "sdpa"
    return cls(c)


def describe(cfg: Config, model) -> str:
    c = model.config
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv = getattr(c, "num_key_value_heads", heads)
    return (f"{type(model).__name__} {cfg.layers} layers, dim {cfg.dim}, heads {heads}/{kv}, "
            f"vocab {c.vocab_size}, seq {cfg.seq}")
