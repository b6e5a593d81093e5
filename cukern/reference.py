"""NumPy references of every op, computed in float64: the oracle of the tests.

Each takes the same arguments as the op it mirrors (NumPy arrays instead of device arrays:
float32, float16, bfloat16 through ``ml_dtypes``, or float64), checks them as the kernels do,
with the same messages, computes in float64 from the values as given (already rounded to
their dtype), and returns float64 arrays, so a test measures the kernel's whole error. The
fused residual add is rounded to the input dtype before the norm, as the kernels (and an
unfused add) do. Each family declares its references beside its kernels (``cukern/<family>.py``).

They run under ``np.errstate(all="ignore")``: inf and NaN are IEEE results they give on purpose,
where the kernels give them (an exp that overflows, a zero variance with eps=0, a NaN input),
not warnings for the caller.
"""
import functools as _functools

import numpy as _np

from ._registry import families as _families


def _quiet(ref):
    @_functools.wraps(ref)
    def quiet(*args, **kwargs):
        with _np.errstate(all="ignore"):
            return ref(*args, **kwargs)
    return quiet


for _family in _families():
    globals().update({_name: _quiet(_ref) for _name, _ref in _family.references.items()})

__all__ = sorted(name for f in _families() for name in f.references)
del _family, _families
