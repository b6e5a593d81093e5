"""A self-check of the Hopper primitives (cuda_src/common/hopper.cuh: TMA tile loads, mbarriers,
wgmma from shared-memory descriptors and from registers): the two products attention makes, by
one warpgroup through them, which the tests compare with NumPy before any Hopper kernel relies
on the primitives. ``tile_product``: C = A·Bᵀ, both operands K-major in shared memory (S = QKᵀ);
``tile_pv``: C = P·V, P from registers and V read MN-major as it is stored (O += P·V). Built for
sm_90a alone (``Instance.arch``); the compile check covers every instance."""
from __future__ import annotations

from . import _arrays, _kernels, _tensormap
from ._kernels import Instance

__all__ = ["instances", "tile_product", "tile_pv"]

SOURCE = "hopper_check.cu"
ARCH = "sm_90a"
NS = (64, 128, 256)      # the columns of C: wgmma's N
KS = (64, 128)           # the inner size: one or two boxes of 64 columns (128 bytes: the swizzle span)
DTYPES = ("bfloat16", "float16")
DS = (64, 128, 256)      # tile_pv: the columns of V and C
KVS = (64, 128)          # tile_pv: the keys (P's columns, V's rows)


def instance(dtype: str, n: int, k: int) -> Instance:
    kb = k // 64
    smem = kb * (64 * 128 + n * 128) + 1024   # the tiles, and slack to align them to 1024 bytes
    return Instance(SOURCE, f"hopper_tile_product<{_arrays.DTYPES[dtype][0]}, {n}, {kb}, {smem}>", 128, smem, ARCH)


def pv_instance(dtype: str, d: int, kv: int) -> Instance:
    smem = (d // 64) * kv * 128 + 1024   # V's boxes of 64 columns, and the alignment slack
    return Instance(SOURCE, f"hopper_tile_pv<{_arrays.DTYPES[dtype][0]}, {d}, {kv}, {smem}>", 128, smem, ARCH)


def instances() -> list[Instance]:
    return ([instance(dtype, n, k) for dtype in DTYPES for n in NS for k in KS]
            + [pv_instance(dtype, d, kv) for dtype in DTYPES for d in DS for kv in KVS])


def _check_device(device: int, what: str) -> None:
    if _kernels.compute_capability(device) != (9, 0):
        raise RuntimeError(f"{what} needs an sm_90 GPU (H100, H200); device {device} is "
                           f"sm_{''.join(map(str, _kernels.compute_capability(device)))}")


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
    _check_device(device, "tile_product")
    n, k = ba.shape[0], aa.shape[1]
    a_map = _tensormap.tile_map(aa, (64, 64))
    b_map = _tensormap.tile_map(ba, (n, 64))
    return _run_one(instance(aa.dtype, n, k), aa, (64, n), a_map=a_map, b_map=b_map)


def tile_pv(p, v):
    """``p @ v`` in float32 by one warpgroup on an sm_90 GPU, P read into wgmma's A registers
    and V read MN-major from shared memory.

    Args:
        p: (64, KV) contiguous, v: (KV, D) with rows 16-byte aligned and a unit-stride inner
            axis; one dtype (bfloat16 or float16); KV 64 or 128, D 64, 128 or 256.

    Returns:
        (64, D) float32, of p's kind.
    """
    pa = _arrays.as_device_array(p, "p", DTYPES)
    va = _arrays.as_device_array(v, "v", DTYPES)
    if pa.ndim != 2 or pa.shape[0] != 64 or pa.shape[1] not in KVS or not _arrays.is_contiguous(pa):
        raise ValueError(f"p: must be a contiguous (64, KV) array with KV in {KVS}, got shape {pa.shape} "
                         f"strides {pa.strides}")
    if va.ndim != 2 or va.shape[0] != pa.shape[1] or va.shape[1] not in DS:
        raise ValueError(f"v: must be ({pa.shape[1]}, D) with D in {DS}, got shape {va.shape}")
    if va.dtype != pa.dtype:
        raise ValueError(f"v: dtype {va.dtype} differs from p's {pa.dtype}")
    device = _arrays.same_device(pa, va)
    _check_device(device, "tile_pv")
    kv, d = va.shape
    v_map = _tensormap.tile_map(va, (kv, 64))
    return _run_one(pv_instance(pa.dtype, d, kv), pa, (64, d), p=pa, v_map=v_map)


def _run_one(inst: Instance, like, c_shape: tuple, **args):
    """One block of ``inst`` on ``like``'s device and stream, writing a new float32 ``c``."""
    c = _arrays.empty(like, c_shape, "float32")
    launch = _kernels.kernel(inst, like.device).prepare(1, c=c, **args)
    with _arrays.on_device(like.device):
        launch([], [], _arrays.launch_stream(like))
    return c.obj
