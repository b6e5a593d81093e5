"""A self-check of the fp8 conversions every fp8 output uses (cuda_src/common/dtype.cuh): float32
to OCP E4M3 ("fn") and E5M2, round to nearest even, saturating to the largest finite value,
NaN to NaN. ``convert`` runs the hardware conversion (sm_89+) or, with ``soft=True``, the code
sm_80 runs instead, on any GPU: the tests compare both with ml_dtypes bit for bit."""
from __future__ import annotations

from . import _arrays, _kernels
from ._kernels import Instance

__all__ = ["instances", "convert"]

SOURCE = "fp8_check.cu"


def instance(dtype: str, soft: bool) -> Instance:
    return Instance(SOURCE, f"fp8_convert<{_arrays.FP8[dtype][0]}, {str(soft).lower()}>", 256)


def instances() -> list[Instance]:
    return [instance(dtype, soft) for dtype in _arrays.FP8 for soft in (False, True)]


def convert(x, dtype: str, soft: bool = False):
    """The fp8 codes (uint8, x's kind) of a contiguous 1-D float32 array of even length."""
    xa = _arrays.as_device_array(x, "x", ("float32",))
    if dtype not in _arrays.FP8:
        raise ValueError(f"dtype: expected one of {', '.join(_arrays.FP8)}, got {dtype!r}")
    if xa.ndim != 1 or xa.shape[0] % 2 or not _arrays.is_contiguous(xa):
        raise ValueError(f"x: must be contiguous, 1-D and of even length, got shape {xa.shape}")
    y = _arrays.empty(xa, xa.shape, "uint8")
    pairs = xa.shape[0] // 2
    if pairs:
        launch = _kernels.kernel(instance(dtype, soft), xa.device).prepare(-(-pairs // 256), x=xa, y=y, pairs=pairs)
        with _arrays.on_device(xa.device):
            launch([], [], _arrays.launch_stream(xa))
    return y.obj
