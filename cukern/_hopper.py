"""A self-check of the Hopper primitives (cuda_src/common/hopper.cuh: TMA tile loads, mbarriers,
wgmma from shared-memory descriptors): one warpgroup's tile product C = A·Bᵀ through them,
which the tests compare with NumPy before any Hopper kernel relies on the primitives. Built for
sm_90a alone (``Instance.arch``); the compile check covers every instance."""
from __future__ import annotations

from . import _arrays, _kernels, _tensormap
from ._kernels import Instance

__all__ = ["instances", "tile_product"]

SOURCE = "hopper_check.cu"
ARCH = "sm_90a"
NS = (64, 128, 256)      # the columns of C: wgmma's N
KS = (64, 128)           # the inner size: one or two boxes of 64 columns (128 bytes: the swizzle span)
DTYPES = ("bfloat16", "float16")


def instance(dtype: str, n: int, k: int) -> Instance:
    kb = k // 64
    smem = kb * (64 * 128 + n * 128) + 1024   # the tiles, and slack to align them to 1024 bytes
    return Instance(SOURCE, f"hopper_tile_product<{_arrays.DTYPES[dtype][0]}, {n}, {kb}, {smem}>", 128, smem, ARCH)


def instances() -> list[Instance]:
    return [instance(dtype, n, k) for dtype in DTYPES for n in NS for k in KS]


def tile_product(a, b):
    """``a @ b.T`` in float32 by one warpgroup on an sm_90 GPU.

    Args:
        a: (64, K), b: (N, K): CuPy arrays or torch tensors, one dtype (bfloat16 or float16),
            rows 16-byte aligned with a unit-stride inner axis; K 64 or 128, N 64, 128 or 256.

    Returns:
        (64, N) float32, of a's kind.
    """
    aa = _arrays.as_device_array(a, "a", DTYPES)
    ba = _arrays.as_device_array(b, "b", DTYPES)
    if aa.ndim != 2 or aa.shape[0] != 64 or aa.shape[1] not in KS:
        raise ValueError(f"a: must be (64, K) with K in {KS}, got shape {aa.shape}")
    if ba.ndim != 2 or ba.shape[0] not in NS or ba.shape[1] != aa.shape[1]:
        raise ValueError(f"b: must be (N, {aa.shape[1]}) with N in {NS}, got shape {ba.shape}")
    if ba.dtype != aa.dtype:
        raise ValueError(f"b: dtype {ba.dtype} differs from a's {aa.dtype}")
    device = _arrays.same_device(aa, ba)
    if _kernels.compute_capability(device) != (9, 0):
        raise RuntimeError(f"tile_product needs an sm_90 GPU (H100, H200); device {device} is "
                           f"sm_{''.join(map(str, _kernels.compute_capability(device)))}")
    n, k = ba.shape[0], aa.shape[1]
    a_map = _tensormap.tile_map(aa, (64, 64))
    b_map = _tensormap.tile_map(ba, (n, 64))
    c = _arrays.empty(aa, (64, n), "float32")
    kern = _kernels.kernel(instance(aa.dtype, n, k), device)
    launch = kern.prepare(1, a_map=a_map, b_map=b_map, c=c)
    with _arrays.on_device(device):
        launch([], [], _arrays.launch_stream(aa))
    return c.obj
