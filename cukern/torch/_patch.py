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
from ._functional import DEFAULT_MIN_SIZE, DROPINS, ORIGINAL

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


def patch(ops=None, *, min_size=None) -> _Patched:
    """Route the functions above to cukern (nested calls count: each ``patch()`` wants one
    ``unpatch()``). Usable as ``cukern.torch.patch()`` or ``with cukern.torch.patch(): ...``.

    Args:
        ops: names of the functions to route (default: all, ``cukern.torch.OPS``), e.g.
            ``ops=("layer_norm", "embedding")`` to leave attention to PyTorch. The outermost
            ``patch()`` decides.
        min_size: calls smaller than this stay with PyTorch: an int for every function, or
            {name: int}. Default: each function's measured threshold (docs/torch.md), below
            which PyTorch's C++ dispatch costs less host time than the kernels save; 0 routes
            every call. The outermost ``patch()`` decides; the last ``unpatch()`` restores them.
    """
    global _depth, _routed
    names = OPS if ops is None else tuple(ops)
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; choose from {list(OPS)}")
    if min_size is not None and not isinstance(min_size, (int, dict)):
        raise TypeError(f"min_size: expected an int or a dict of ints, got {type(min_size).__name__}")
    _tools.prepare()
    with _lock:
        if _depth == 0:
            _routed = names
            for name in names:
                setattr(F, name, DROPINS[name])
            if min_size is not None:
                _tools.MIN_SIZE.update(min_size if isinstance(min_size, dict)
                                       else dict.fromkeys(OPS, int(min_size)))
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
            _tools.MIN_SIZE.update(DEFAULT_MIN_SIZE)


def is_patched() -> bool:
    return _depth > 0
