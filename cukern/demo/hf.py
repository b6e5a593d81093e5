"""Hugging Face ``transformers`` models built from configs (no downloads) for the demo: GPT-2,
LLaMA (grouped-query attention, LLaMA 3's vocabulary), Mistral and the other decoder families
``patch(model)`` is measured on (Qwen2, Qwen3, Gemma 2 and 3, Phi-3, OLMo 2, Granite, GPT-NeoX,
StarCoder2), at the demo's width, depth, heads and sequence length, with the released models'
vocabularies, trained through their own ``forward(input_ids, labels)``; and any other model type
transformers builds a causal LM of, from its config class's defaults at the demo's sizes."""
from __future__ import annotations

from .options import Config

# The vocabularies of the released models (the demo's --vocab overrides them).
VOCAB = {"gpt2": 50257, "llama": 128256, "mistral": 32768, "qwen2": 151936, "qwen3": 151936, "gemma2": 256000,
         "gemma3": 262144, "phi3": 32064, "olmo2": 100352, "granite": 49155, "gpt_neox": 50304,
         "starcoder2": 49152}

# The other families: (config class, model class, MLP width over the model's, the config's own
# arguments). Head dims are the model's width over its heads; dropout is off as in pretraining.
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 8 / 3, {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 3.0, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 4.0, {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", 4.0, {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", 8 / 3, {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", 8 / 3, {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", 8 / 3, {"pad_token_id": 0}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", 4.0, {"pad_token_id": 0}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", 4.0, {}),
}


def _mlp_width(dim: int, ratio: float) -> int:
    return int(ratio * dim + 255) // 256 * 256


def build(cfg: Config):
    """The model ``cfg.model`` names, in float32 (train it under autocast) with dropout off
    (as in pretraining today), PyTorch's SDPA as its attention (Gemma 2: its eager attention)."""
    import transformers

    vocab = cfg.vocab or VOCAB.get(cfg.model)
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
    elif cfg.model in FAMILIES:
        config_cls, model_cls, ratio, own = FAMILIES[cfg.model]
        c = getattr(transformers, config_cls)(
            hidden_size=cfg.dim, intermediate_size=_mlp_width(cfg.dim, ratio), num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads, num_key_value_heads=kv, head_dim=cfg.dim // cfg.heads,
            vocab_size=vocab, max_position_embeddings=cfg.seq, **own)
        cls = getattr(transformers, model_cls)
    else:
        return _any(cfg, kv)
    c._attn_implementation = "eager" if cfg.model == "gemma2" else "sdpa"   # (Gemma 2 has no SDPA path)
    _attention_dropout(c, cfg.attn_dropout)
    return cls(c)


# transformers' names for the attention weights' dropout probability in a config
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")


def _attention_dropout(c, p: float) -> None:
    """``p`` as the attention-weight dropout of config ``c``'s text config, under whichever of
    its names the config has; a config with none of them is refused for p > 0."""
    text = c.get_text_config()
    names = [n for n in _ATTENTION_DROPOUT if hasattr(text, n)]
    if p and not names:
        raise ValueError(f"attn_dropout: {type(text).__name__} has no attention dropout setting "
                         f"({', '.join(_ATTENTION_DROPOUT)})")
    for n in names:
        setattr(text, n, p)


def _any(cfg: Config, kv: int):
    """Any other transformers model type with a causal-LM head: its config class's defaults (the
    released model's vocabulary, experts, ...) with the demo's width, depth, heads and length set
    on its text config, dropout off; refused, by name, where transformers cannot configure or
    build it so."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg.model not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model: {cfg.model!r} is not a transformers model type with a causal-LM head")
    at = f"at width {cfg.dim}, {cfg.layers} layers, {cfg.heads} heads"
    try:
        c = _sized_config(cfg, kv)
        _attention_dropout(c, cfg.attn_dropout)
    except Exception as e:  # noqa: BLE001 - any model type: say which and why
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"model: transformers could not configure {cfg.model!r} {at} ({type(e).__name__}: "
                         f"{first})") from e
    sdpa = getattr(transformers.AutoModelForCausalLM._model_mapping[type(c)], "_supports_sdpa", False)
    try:
        model = transformers.AutoModelForCausalLM.from_config(c, **({"attn_implementation": "sdpa"} if sdpa else {}))
    except Exception as e:  # noqa: BLE001 - any model type: say which and why
        raise ValueError(f"model: transformers could not build {cfg.model!r} {at} ({type(e).__name__}: {e})") from e
    built = model.config.get_text_config()
    if getattr(built, "hidden_size", cfg.dim) != cfg.dim:
        raise ValueError(f"model: {cfg.model!r} was built at width {built.hidden_size}, not {cfg.dim} "
                         "(its config does not take the demo's sizes)")
    return model


def _sized_config(cfg: Config, kv: int):
    """``cfg.model``'s config with the demo's sizes on its text config and dropout off."""
    import transformers

    sizes = dict(hidden_size=cfg.dim, intermediate_size=_mlp_width(cfg.dim, 8 / 3), num_hidden_layers=cfg.layers,
                 num_attention_heads=cfg.heads, num_key_value_heads=kv, head_dim=cfg.dim // cfg.heads,
                 max_position_embeddings=cfg.seq)
    if cfg.vocab:
        sizes["vocab_size"] = cfg.vocab
    c = transformers.AutoConfig.for_model(cfg.model)
    text = c.get_text_config()
    for obj in {id(c): c, id(text): text}.values():
        for name, value in list(vars(obj).items()):   # (as in pretraining today)
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(obj, name, 0.0)
    for name, value in sizes.items():
        try:
            setattr(text, name, value)
        except (AttributeError, TypeError, ValueError):   # (a derived size: its config computes it)
            pass
    if isinstance(getattr(text, "pad_token_id", None), int) and text.pad_token_id >= text.vocab_size:
        text.pad_token_id = None   # (the released model's padding token, past a smaller --vocab)
    return c


def describe(cfg: Config, model) -> str:
    c = model.config
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv = getattr(c, "num_key_value_heads", heads)
    return (f"{type(model).__name__} {cfg.layers} layers, dim {cfg.dim}, heads {heads}/{kv}, "
            f"vocab {c.vocab_size}, seq {cfg.seq}")
