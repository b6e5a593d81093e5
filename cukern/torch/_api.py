"""The families' own PyTorch functions and modules (linear_cross_entropy, apply_rotary_pos_emb,
swiglu, ...): each family's ``torch_api`` built once over the custom ops. Here, below both the
package (which exports them) and ``_models`` (which routes a model's parts to them)."""
from __future__ import annotations

import functools

from .._registry import families
from . import _tools
from ._ops import OPS
from .modules import MODULES


@functools.cache
def api() -> dict:
    """{name: function or module} of every family's ``torch_api``, in registry order."""
    return {name: obj for f in families() if f.torch_api is not None
            for name, obj in f.torch_api(_tools, OPS, MODULES).items()}
