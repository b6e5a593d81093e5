"""Fixed-order sums of float32 partial rows (kernel: cuda_src/partial_sum.cu).

The last step of every weight gradient: a family's backward kernel writes one float32 row
of partial sums per row group (or per sample), and this adds them up in a fixed order, so
the gradient has the same bits on every run. No floating-point atomics anywhere.
"""
from __future__ import annotations

import numpy as np

from . import _arrays, _kernels
from ._arrays import DeviceArray

SOURCE = "partial_sum.cu"


def instances() -> list[str]:
    return [f"sum_partial_rows<{ctype}>" for ctype, _ in _arrays.DTYPES.values()]


def sum_rows(part: DeviceArray | None, like: DeviceArray, nparts: int, cols: int, device: int):
    """(nparts, cols) float32 partials -> (cols,) array of ``like``'s dtype and kind, or None."""
    if part is None:
        return None
    out = _arrays.empty(like, (cols,))
    fn = _kernels.function(SOURCE, f"sum_partial_rows<{like.ctype}>", device)
    _kernels.launch(fn, -(-cols // 32), (32, 8), (part, np.int32(nparts), np.int32(cols), out))
    return out
