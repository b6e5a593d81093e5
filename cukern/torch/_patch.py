"""``patch()`` / ``unpatch()``: with a model, route that model's own modules (``_models``:
Hugging Face decoders included); without, route the ``torch.nn.functional``
functions that the families declare drop-ins for — and so the nn modules that call them — to
cukern for the calls it supports, to PyTorch for the others. The functions ``patch()`` replaces
(tests/test_docs.py checks this list against the families' declarations):

* ``F.layer_norm`` (nn.LayerNorm)
* ``F.rms_norm`` (nn.RMSNorm)
* ``F.group_norm`` (nn.GroupNorm)
* ``F.embedding`` (nn.Embedding)
* ``F.scaled_dot_product_attention`` (nn.MultiheadAttention's attention)
* ``F.cross_entropy`` (nn.CrossEntropyLoss)

Code that bound a function before patching (``from torch.nn.functional import layer_norm``)
keeps PyTorch's; ``torch.layer_norm`` and other aliases are not touched.
"""
from __future__ import annotations

import threading

import torch.nn.functional as F

from .. import _checks
from . import _models, _tools
from ._functional import DEFAULT_MIN_SIZE, DROPINS, ORIGINAL

OPS = tuple(DROPINS)
_lock = threading.Lock()
_depth = 0
_routed: tuple[str, ...] = ()


class _Patched:
    """What ``patch()`` returns: already in effect; as a context manager, undone on exit."""

    def __init__(self, model=None):
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch(self.model)
        return False


def patch(model=None, *, ops=None, parts=None, min_size=None) -> _Patched:
    """Route calls to cukern: a model's modules with ``patch(model)``, the functions of
    ``torch.nn.functional`` with ``patch()``. Nested calls count (each ``patch`` wants one
    ``unpatch``). Usable as a call or as ``with cukern.torch.patch(...): ...``.

    Args:
        model: an ``nn.Module`` (a Hugging Face decoder, or any model with norm, embedding
            and MLP modules): its norms, embeddings, gated MLP, rotary embedding, attention and
            masks, and LM-head loss, each found by running it, go to cukern
            (docs/torch.md), its code and state_dict unchanged, nothing global touched but
            the rotary function of its modeling module. None: the functions below.
        ops: without a model, the names of the functions to route (default: all,
            ``cukern.torch.OPS``), e.g. ``ops=("layer_norm", "embedding")`` to leave attention
            to PyTorch. The outermost ``patch()`` decides. (Also accepted in ``model``'s place.)
        parts: with a model, which of ``cukern.torch.PARTS`` to route (default: all), e.g.
            ``parts=("norm", "loss")``.
        min_size: calls smaller than this stay with PyTorch: an int for every function, or
            {name: int}. Default: each function's measured threshold (docs/torch.md), below
            which PyTorch's C++ dispatch costs less host time than the kernels save; 0 routes
            every call. The outermost ``patch`` decides; the last ``unpatch`` restores them.
    """
    global _depth, _routed
    if isinstance(model, (str, tuple, list)):
        model, ops = None, model
    sizes = _min_sizes(min_size)
    if model is not None:
        if ops is not None:
            raise ValueError("ops: choose the parts of a model with parts=, not ops=")
        _tools.prepare()
        _models.patch_model(model, parts)
        with _lock:
            if _depth == 0 and not _models.any_patched_but(model) and sizes is not None:
                _tools.MIN_SIZE.update(sizes)
        return _Patched(model)
    if parts is not None:
        raise ValueError("parts: only with a model (patch(model, parts=...))")
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
            if sizes is not None and not _models.any_patched_but(None):
                _tools.MIN_SIZE.update(sizes)
        _depth += 1
    return _Patched()


def _min_sizes(min_size) -> dict[str, int] | None:
    """``patch``'s min_size as {function: size}, each an int >= 0, checked before anything is patched."""
    if min_size is None:
        return None
    if not isinstance(min_size, dict):
        return dict.fromkeys(OPS, _size(min_size, "min_size"))
    unknown = sorted(set(min_size) - set(OPS))
    if unknown:
        raise ValueError(f"min_size: unknown {unknown}; choose from {list(OPS)}")
    return {name: _size(size, f"min_size[{name!r}]") for name, size in min_size.items()}


def _size(value, name: str) -> int:
    n = _checks.index(value, name)
    if n < 0:
        raise ValueError(f"{name}: must be >= 0, got {n}")
    return n


def unpatch(model=None) -> None:
    """Undo one ``patch(model)`` (with a model) or one ``patch()``; the last restores
    PyTorch's functions, or the model's own code."""
    global _depth, _routed
    if model is not None:
        _models.unpatch_model(model)
        with _lock:
            if _depth == 0 and not _models.any_patched_but(None):
                _tools.MIN_SIZE.update(DEFAULT_MIN_SIZE)
        return
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            for name in _routed:
                setattr(F, name, ORIGINAL[name])
            _routed = ()
            if not _models.any_patched_but(None):
                _tools.MIN_SIZE.update(DEFAULT_MIN_SIZE)


def is_patched(model=None) -> bool:
    """Whether ``patch()`` is in effect, or with a model, ``patch(model)``."""
    return _models.is_model_patched(model) if model is not None else _depth > 0
