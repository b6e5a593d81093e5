"""cukern inside PyTorch: custom ops (``torch.ops.cukern.*``, autograd and torch.compile),
drop-in functions and modules, and ``patch()`` to route an unchanged model's calls.

    import cukern.torch
    with cukern.torch.patch():          # or cukern.torch.patch() ... cukern.torch.unpatch()
        loss = model(tokens).loss       # F.layer_norm, F.rms_norm, F.group_norm, F.embedding,
        loss.backward()                 # F.scaled_dot_product_attention go to cukern when they can
    print(cukern.torch.counts())        # {"layer_norm": {"cukern": 48, "torch": 0}, ...}

Needs torch (a CUDA build for the kernels; on other tensors everything falls back).
"""
from . import _ops as ops
from ._functional import (counts, embedding, group_norm, layer_norm, reset_counts, rms_norm,
                          scaled_dot_product_attention)
from ._patch import OPS, is_patched, patch, unpatch
from .modules import Embedding, GroupNorm, LayerNorm, RMSNorm

__all__ = ["OPS", "patch", "unpatch", "is_patched", "counts", "reset_counts", "layer_norm", "rms_norm",
           "group_norm", "embedding", "scaled_dot_product_attention", "LayerNorm", "RMSNorm",
           "GroupNorm", "Embedding", "ops"]
