"""Drop-ins for the functions of ``torch.nn.functional`` that the families declare (DropIn),
with the same signatures: a call cukern supports goes to its kernels, any other to PyTorch's
own function, so whatever a model passes keeps working. ``counts()`` says which calls went where.

Mixed precision follows PyTorch: under ``torch.autocast`` the inputs are cast the way autocast
casts them for PyTorch's op (measured on tiny tensors, so it tracks the installed PyTorch).
Inside torch.compile a drop-in calls the custom op where the family measured it faster than
what Inductor makes of PyTorch's code, and PyTorch's function otherwise (``DropIn.compile``).
"""
from __future__ import annotations

import inspect
import types
from typing import Callable

import torch
import torch.nn.functional as F

from .._registry import families
from . import _tools
from ._ops import OPS
from ._tools import count as _count, counts, reset_counts  # noqa: F401 (re-exported)

DROPIN_SPECS = {d.replaces: d for f in families() for d in f.dropins}
# PyTorch's own functions, saved before any patching (the fallbacks).
ORIGINAL: dict[str, Callable] = {name: getattr(F, name) for name in DROPIN_SPECS}
ORIGINAL_F = types.SimpleNamespace(**ORIGINAL)   # (the same, as attributes: ORIGINAL_F.layer_norm)
_tools.ORIGINAL.update(ORIGINAL)
_tools.PROBES.update({name: d.probe for name, d in DROPIN_SPECS.items() if d.probe is not None})
DEFAULT_MIN_SIZE = {name: d.min_size for name, d in DROPIN_SPECS.items()}
_tools.MIN_SIZE.update(DEFAULT_MIN_SIZE)


# ---- the drop-ins ------------------------------------------------------------------------------

def _make(name: str) -> Callable:
    spec = DROPIN_SPECS[name]
    original, route, routed_in_graphs = ORIGINAL[name], spec.route, spec.compile

    def dropin(*args, **kwargs):
        compiling = _tools.compiling()
        if compiling and not routed_in_graphs:
            return original(*args, **kwargs)
        if not compiling and _tools.traced(args):
            # PyTorch's function, run without the __torch_function__ bounce back to this name
            with torch._C.DisableTorchFunctionSubclass():
                return original(*args, **kwargs)
        r = route(_tools, *args, **kwargs)
        if isinstance(r, str):   # (isinstance: what dynamo folds in every release)
            if not compiling:
                _count(name, r)
            return original(*args, **kwargs)
        op, op_args, post = r
        if compiling:
            out = OPS[op].compiled(*op_args)
        else:
            _count(name, None)
            out = OPS[op](*op_args)
        return out if post is None else post(out)

    # F's signature for inspect, but no __wrapped__: dynamo would take a wrapper of F.layer_norm
    # for F.layer_norm itself and put the call in the graph instead of tracing it.
    try:
        dropin.__signature__ = inspect.signature(original)
    except ValueError:   # a builtin (scaled_dot_product_attention)
        pass
    dropin.__name__ = dropin.__qualname__ = name
    dropin.__doc__ = (f"``torch.nn.functional.{name}`` on cukern's kernels when it supports the call, "
                      f"PyTorch's otherwise (same signature; see cukern.torch.counts()).\n\n"
                      f"cukern takes the call when: {(route.__doc__ or 'see docs/torch.md').strip()}")
    return dropin


DROPINS: dict[str, Callable] = {name: _make(name) for name in DROPIN_SPECS}
