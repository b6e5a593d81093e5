"""``patch()`` / ``unpatch()``: route the ``torch.nn.functional`` functions that the families
declare drop-ins for (layer_norm, rms_norm, group_norm, embedding, scaled_dot_product_attention)
— and so the nn modules that call them (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Embedding,
nn.MultiheadAttention's attention) — to cukern for the calls it supports, to PyTorch for the
others.

Code that bound a function before patching (``from torch.nn.functional import layer_norm``)
keeps PyTorch's; ``torch.layer_norm`` and other aliases are not touched.
"""
from __future__ import annotations

import threading

import torch.nn.functional as F

from . import _tools
from ._functional import DROPINS, ORIGINAL

OPS = tuple(DROPINS)
_lock = threading.Lock()
_depth = 0
_routed: tuple[str, ...] = ()


class _Patched:
    """What ``patch()`` returns: already in effect; as a context manager, undone on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch()
        return False


def patch(ops=None) -> _Patched:
    """Route the functions above to cukern (nested calls count: each ``patch()`` wants one
    ``unpatch()``). Usable as ``cukern.torch.patch()`` or ``with cukern.torch.patch(): ...``.

    Args:
        ops: names of the functions to route (default: all, ``cukern.torch.OPS``), e.g.
            ``ops=("layer_norm", "embedding")`` to leave attention to PyTorch. The outermost
            ``patch()`` decides.
    """
    global _depth, _routed
    names = OPS if ops is None else tuple(ops)
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; choose from {list(OPS)}")
    _tools.prepare()
    with _lock:
        if _depth == 0:
            _routed = names
            for name in names:
                setattr(F, name, DROPINS[name])
        _depth += 1
    return _Patched()


def unpatch() -> None:
    """Undo one ``patch()``; the last one restores PyTorch's functions."""
    global _depth, _routed
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            for name in _routed:
                setattr(F, name, ORIGINAL[name])
            _routed = ()


def is_patched() -> bool:
    return _depth > 0
