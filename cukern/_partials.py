"""Fixed-order sums of float32 partial rows (kernel: cuda_src/partial_sum.cu).

The last step of every weight gradient: a family's backward kernel writes one float32 row
of partial sums per row group (or per sample), and this adds them up in a fixed order, so
the gradient has the same bits on every run. No floating-point atomics anywhere.
"""
from __future__ import annotations

from . import _arrays, _kernels
from ._kernels import Instance, Slot

SOURCE = "partial_sum.cu"
THREADS = (32, 8)   # a block: 32 columns x 8 slices of the partial rows


def instance(dtype: str) -> Instance:
    return Instance(SOURCE, f"sum_partial_rows<{_arrays.DTYPES[dtype][0]}>", THREADS[0] * THREADS[1])


def instances() -> list[Instance]:
    return [instance(dtype) for dtype in _arrays.DTYPES]


def sum_rows(builder, part: Slot, outs: list[Slot], nparts: int, cols: int, dtype: str, device: int) -> None:
    """Add to a plan the launch that sums the (len(outs), nparts, cols) float32 partials at
    ``part`` into the (cols,) arrays ``outs`` (one or two) of ``dtype``: one launch for both."""
    k = _kernels.kernel(instance(dtype), device)
    builder.launch(k, (-(-cols // THREADS[0]), len(outs)), THREADS, part=part, nparts=nparts, cols=cols,
                   out=outs[0], out2=outs[1] if len(outs) > 1 else None)
