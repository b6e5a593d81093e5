"""NumPy references of every op, computed in float64: the oracle of the tests.

Each takes the same arguments as the op it mirrors (NumPy arrays instead of device arrays:
float32, float16, bfloat16 through ``ml_dtypes``, or float64), checks them as the kernels do,
with the same messages, computes in float64 from the values as given (already rounded to
their dtype), and returns float64 arrays, so a test measures the kernel's whole error. The
fused residual add is rounded to the input dtype before the norm, as the kernels (and an
unfused add) do. Each family declares its references beside its kernels (``cukern/<family>.py``).
"""
from ._registry import families as _families

for _family in _families():
    globals().update(_family.references)

__all__ = sorted(name for f in _families() for name in f.references)
del _family, _families
