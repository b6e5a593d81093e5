"""Applying the upstream gradient to a kept gradient (the PyTorch binding's backward)."""
from __future__ import annotations

from .. import _arrays, _kernels
from .._arrays import DeviceArray
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .configs import Configs

# ---- applying the upstream gradient (the PyTorch binding's backward) -------------------------

_SCALE = PlanCache()


def _scale_gradient(dloss, grad, dtype: str, donate: bool, configs: Configs = _cfg.CONFIGS):
    """``grad`` (a gradient for an upstream gradient of 1, float32, contiguous) times the upstream
    gradient ``dloss`` (a scalar, or one value a row), rounded once to ``dtype``: into a new array,
    or with ``donate`` and ``dtype`` float32 over ``grad`` itself (rows whose upstream gradient is
    exactly 1 then cost nothing)."""
    arrays = [_arrays.as_device_array(dloss, "dloss"), _arrays.as_device_array(grad, "grad", ("float32",))]
    in_place = bool(donate) and dtype == "float32"
    key = (in_place, dtype, configs, *(a.key for a in arrays))
    plan = _SCALE.plan(key, _plan_scale, arrays, dtype, in_place, configs)
    return plan.out(plan(arrays), "out")


def _plan_scale(arrays: list, dtype: str, in_place: bool, configs: Configs) -> Plan:
    da, ga = arrays
    device = _arrays.same_device(da, ga)
    v = ga.shape[-1] if ga.ndim else 1
    rows = ga.size // max(v, 1)
    if da.size not in (1, rows):
        raise ValueError(f"dloss: shape {da.shape} is neither a scalar nor one value a row of {ga.shape}")
    if not _arrays.is_contiguous(ga):
        raise ValueError(f"grad: must be contiguous (the training form's output), got strides {ga.strides}")
    if da.dtype not in ("float32", dtype):
        raise ValueError(f"dloss: dtype {da.dtype} is neither float32 nor the gradient's {dtype}")
    b = Builder(arrays)
    if not _arrays.is_contiguous(da):
        b.fix(0, DeviceArray.contiguous)
    out = b.output("out", b.slot(1)) if in_place else b.alloc(ga.shape, dtype, name="out")
    if in_place:
        b.absent()
    if rows and v:
        vec = 4 if v % 4 == 0 and ga.ptr % 16 == 0 else 1
        k = _kernels.kernel(configs.scale("float32", dtype, da.dtype, vec), device)
        b.launch(k, min(rows, k.resident_blocks()), src=b.slot(1), dst=out, rows=rows, V=v, stride=v,
                 dloss=b.slot(0), dloss_stride=int(da.size == rows and rows > 1))
    return b.plan(device, first=1)
