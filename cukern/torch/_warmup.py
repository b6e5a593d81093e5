"""``python -m cukern warmup``: fill the caches a training run's first steps would fill, ahead
of time (in a container build, or before starting many ranks).

* The C++ extension of the native eager path (``_native_build``): built in the foreground. This
  needs a C++ compiler and ninja, not a GPU. A failure recorded earlier is tried again.
* The kernels a model's training step uses: one step (forward, backward) and one forward in
  eval mode of a one-layer copy of the model, patched, at the run's sequence length, batch and
  dtype; kernel instances depend on the head sizes, dtypes and options, not on the depth. This
  needs the GPU the run uses (CuPy compiles for the device it finds).
"""
from __future__ import annotations

import time

__all__ = ["build_native", "warm_model"]


def build_native() -> tuple[bool, str]:
    """(ok, a line saying what happened) for the extension's build."""
    from . import _native_build

    where = _native_build.folder()
    if _native_build.state(where) == "built":
        return True, f"C++ extension: built already ({where})"
    t = time.perf_counter()
    try:
        _native_build.ensure(where, retry=True)
    except _native_build.BuildFailed as e:
        return False, f"C++ extension: the build failed: {e}"
    return True, f"C++ extension: built in {time.perf_counter() - t:.1f} s ({where})"


def _model(model: str | None, config: str | None, dim: int, heads: int, seq: int):
    """A one-layer model: from a transformers config (a name or a path) or the demo's models."""
    if config is not None:
        import transformers

        c = transformers.AutoConfig.from_pretrained(config)
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if hasattr(c, name):
                setattr(c, name, 1)
        if hasattr(c, "layer_types") and c.layer_types:   # (a model mixing full and windowed layers: one of each)
            kinds = list(dict.fromkeys(c.layer_types))
            c.layer_types = kinds
            c.num_hidden_layers = len(kinds)
        return transformers.AutoModelForCausalLM.from_config(c), f"{type(c).__name__} from {config}"
    from ..demo.hf import build
    from ..demo.options import Config

    cfg = Config(layers=1, dim=dim, heads=heads, seq=seq, vocab=0, model=model)
    return build(cfg), f"{model} (dim {dim}, {heads} heads)"


def warm_model(model: str | None, config: str | None, *, dim: int, heads: int, seq: int, batch: int,
               dtype: str = "bf16") -> str:
    """Run one patched training step and one eval forward of a one-layer copy of the model;
    return a line with what it compiled or loaded."""
    import torch

    import cukern.torch as ct
    from .. import _kernels

    t = time.perf_counter()
    torch.manual_seed(0)
    net, what = _model(model, config, dim, heads, seq)
    device = torch.device("cuda", torch.cuda.current_device())
    net = net.to(device)
    vocab = net.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    before = len(_kernels.cached_instances())
    with ct.patch(net):
        net.train()
        with torch.autocast("cuda", dtype=autocast):
            loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        net.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=autocast):
            net(input_ids=tokens)
    torch.cuda.synchronize(device)
    n = len(_kernels.cached_instances()) - before
    return (f"kernels: {what}, sequence {seq}, batch {batch}, {dtype} autocast: a training step and an eval "
            f"forward ran {n} kernels, compiled or loaded from the caches in {time.perf_counter() - t:.1f} s")
