"""Gated linear units of transformer MLPs, forward and backward (kernels: cuda_src/swiglu.cu):
SwiGLU ``silu(gate) * up`` (LLaMA, Mistral) and GeGLU ``gelu(gate) * up`` (Gemma; exact or
tanh GELU).

Shapes: ``gate`` and ``up`` are (*, H) of one shape; ``y``, ``dgate`` and ``dup`` are (*, H),
contiguous. dtypes: float32, float16, bfloat16, one for every array of a call. gate and up may
be views with a row stride of their own (the two halves of one fused projection, (*, 2H), are
read in place); other layouts are copied first.

Numerics: PyTorch eager's for ``F.silu(gate) * up`` in the input dtype, the activation
rounded to the dtype before the product (cuda_src/swiglu.cu says where the backward rounds).

This module is the whole Python side of the family: instances, the array functions with their
launch plans, the NumPy references, the benchmark cases and the PyTorch bindings (``FAMILY``).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _arrays, _kernels
from ._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from ._arrays import DeviceArray
from ._family import Family, TorchOp
from ._kernels import Instance
from ._plans import Builder, Plan, PlanCache

__all__ = ["swiglu", "swiglu_backward", "geglu", "geglu_backward"]

SOURCE = "swiglu.cu"
THREADS = 256
# activation name -> the ACT template argument (cuda_src/swiglu.cu)
ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def instance(kind: str, dtype: str, act: int, vec: int) -> Instance:
    return Instance(SOURCE, f"glu_{kind}<{_arrays.DTYPES[dtype][0]}, {act}, {vec}, {THREADS}>", THREADS)


def instances() -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    return [instance(kind, dtype, act, vec) for kind in ("fwd", "bwd", "fwd_flat", "bwd_flat")
            for dtype, (_, size) in _arrays.DTYPES.items() for act in ACTS.values() for vec in (1, 16 // size)]


def _dense(cols: int, strides) -> bool:
    """Whether every (array, row stride) pair is dense rows (the _flat kernels then run)."""
    return all(stride == cols for _, stride in strides)


def _approximate(approximate) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return "gelu" if approximate == "none" else "gelu_tanh"


# ---- argument checks (kernels and references alike) -----------------------------------------

def _check(ga: DeviceArray, ua: DeviceArray, da: DeviceArray | None = None) -> None:
    if ga.ndim < 1:
        raise ValueError(f"{ga.name}: must have at least one axis, got a scalar")
    if ua.shape != ga.shape:
        raise ValueError(f"{ua.name}: shape {ua.shape} does not match {ga.name}'s {ga.shape}")
    for a in (ua, da):
        if a is not None and a.dtype != ga.dtype and not (a.kind == "numpy" and "float64" in (a.dtype, ga.dtype)):
            raise ValueError(f"{a.name}: dtype {a.dtype} differs from {ga.name}'s {ga.dtype}; "
                             "cast it so that all inputs share one dtype")
    if da is not None and da.shape != ga.shape:
        raise ValueError(f"{da.name}: shape {da.shape} does not match {ga.name}'s {ga.shape}")


def _rows_in_place(b: Builder, items) -> list:
    """(the array, or None for a fresh copy; its row stride) for each (slot, array): rows read
    in place where their layout allows, else a contiguous copy (a fix of the plan)."""
    out = []
    for i, a in items:
        copy, stride = _arrays.rows_view(a)
        if copy:
            b.fix(i, DeviceArray.contiguous)
        out.append((None if copy else a, stride))
    return out


def _layout(cols: int, vec: int) -> tuple[int, int]:
    """(threads a row as a power of two, log2 of it): enough for the row's vectors, at most a block."""
    tpr = min(THREADS, 1 << max(0, math.ceil(math.log2(max(1, cols // vec)))))
    return tpr, tpr.bit_length() - 1


# ---- forward and backward -----------------------------------------------------------------------

_FWD = PlanCache()
_BWD = PlanCache()


def _forward(act: str, gate, up):
    arrays = [_arrays.as_device_array(gate, "gate"), _arrays.as_device_array(up, "up")]
    key = (act, *(a.key for a in arrays))
    plan = _FWD.plan(key, _plan_forward, act, arrays)
    return plan.out(plan(arrays), "y")


def _plan_forward(act: str, arrays) -> Plan:
    ga, ua = arrays
    _check(ga, ua)
    device = _arrays.same_device(ga, ua)
    cols = ga.shape[-1]
    rows = math.prod(ga.shape[:-1])
    b = Builder(arrays)
    y = b.alloc(ga.shape, ga.dtype, name="y")
    if rows and cols:
        strides = _rows_in_place(b, enumerate(arrays))
        vec = _arrays.vector_width(ga.itemsize, cols, strides)
        if _dense(cols, strides):
            nvec = rows * cols // vec
            k = _kernels.kernel(instance("fwd_flat", ga.dtype, ACTS[act], vec), device)
            b.launch(k, -(-nvec // THREADS), gate=b.slot(0), up=b.slot(1), y=y, nvec=nvec)
        else:
            tpr, log2 = _layout(cols, vec)
            k = _kernels.kernel(instance("fwd", ga.dtype, ACTS[act], vec), device)
            b.launch(k, -(-rows // (THREADS // tpr)), gate=b.slot(0), gate_stride=strides[0][1], up=b.slot(1),
                     up_stride=strides[1][1], y=y, rows=rows, cols=cols, tpr_log2=log2)
    return b.plan(device)


def _backward(act: str, dy, gate, up):
    arrays = [_arrays.as_device_array(dy, "dy"), _arrays.as_device_array(gate, "gate"),
              _arrays.as_device_array(up, "up")]
    key = (act, *(a.key for a in arrays))
    plan = _BWD.plan(key, _plan_backward, act, arrays)
    bufs = plan(arrays)
    return plan.out(bufs, "dgate"), plan.out(bufs, "dup")


def _plan_backward(act: str, arrays) -> Plan:
    da, ga, ua = arrays
    _check(ga, ua, da)
    device = _arrays.same_device(da, ga, ua)
    cols = ga.shape[-1]
    rows = math.prod(ga.shape[:-1])
    b = Builder(arrays)
    dgate = b.alloc(ga.shape, ga.dtype, name="dgate")
    dup = b.alloc(ga.shape, ga.dtype, name="dup")
    if rows and cols:
        if not _arrays.is_contiguous(da):   # (the kernel reads dy as the outputs are laid out)
            b.fix(0, DeviceArray.contiguous)
        strides = [(None if not _arrays.is_contiguous(da) else da, cols)] + _rows_in_place(b, ((1, ga), (2, ua)))
        vec = _arrays.vector_width(ga.itemsize, cols, strides)
        if _dense(cols, strides):
            nvec = rows * cols // vec
            k = _kernels.kernel(instance("bwd_flat", ga.dtype, ACTS[act], vec), device)
            b.launch(k, -(-nvec // THREADS), dy=b.slot(0), gate=b.slot(1), up=b.slot(2), dgate=dgate, dup=dup,
                     nvec=nvec)
        else:
            tpr, log2 = _layout(cols, vec)
            k = _kernels.kernel(instance("bwd", ga.dtype, ACTS[act], vec), device)
            b.launch(k, -(-rows // (THREADS // tpr)), dy=b.slot(0), gate=b.slot(1), gate_stride=strides[1][1],
                     up=b.slot(2), up_stride=strides[2][1], dgate=dgate, dup=dup, rows=rows, cols=cols,
                     tpr_log2=log2)
    return b.plan(device)


def swiglu(gate, up):
    """SwiGLU: ``silu(gate) * up``, as PyTorch's ``F.silu(gate) * up`` computes it.

    Args:
        gate, up: (*, H) of one dtype (float32, float16, bfloat16): CuPy arrays or torch CUDA
            tensors; views with their own row stride are read in place.

    Returns:
        y (*, H), contiguous, of gate's kind and device.
    """
    return _forward("silu", gate, up)


def swiglu_backward(dy, gate, up):
    """Gradients of ``swiglu``: ``(dgate, dup)``, each (*, H) contiguous. dy (*, H) of gate's
    dtype (copied first unless contiguous)."""
    return _backward("silu", dy, gate, up)


def geglu(gate, up, approximate="none"):
    """GeGLU: ``gelu(gate, approximate) * up``, as PyTorch's ``F.gelu(gate, approximate=...) * up``;
    approximate "none" (erf) or "tanh". Shapes and dtypes as ``swiglu``."""
    return _forward(_approximate(approximate), gate, up)


def geglu_backward(dy, gate, up, approximate="none"):
    """Gradients of ``geglu``: ``(dgate, dup)``."""
    return _backward(_approximate(approximate), dy, gate, up)


# ---- NumPy references (float64, rounding where the kernels round; the oracle of the tests) ------

_erf = np.frompyfunc(math.erf, 1, 1)


def _act(name: str, x):
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu":
        return x * 0.5 * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _act_grad(name: str, x):
    if name == "silu":
        s = 1.0 / (1.0 + np.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    if name == "gelu":
        return 0.5 * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64)) + x * np.exp(-0.5 * x * x) / math.sqrt(
            2.0 * math.pi)
    beta = math.sqrt(2.0 / math.pi)
    t = np.tanh(beta * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * beta * (1.0 + 3 * 0.044715 * x * x)


def _rounder(a: DeviceArray):
    if a.dtype in ("float32", "float64"):
        return lambda v: v
    t = _arrays._np_dtype(a.dtype)
    return lambda v: np.asarray(v).astype(t).astype(np.float64)


def _host(obj, name):
    return _arrays.as_host_array(obj, name)


def _ref_forward(act, gate, up):
    ga, ua = _host(gate, "gate"), _host(up, "up")
    _check(ga, ua)
    rnd = _rounder(ga)
    return rnd(_act(act, ga.obj.astype(np.float64))) * ua.obj.astype(np.float64)


def _ref_backward(act, dy, gate, up):
    da, ga, ua = _host(dy, "dy"), _host(gate, "gate"), _host(up, "up")
    _check(ga, ua, da)
    rnd = _rounder(ga)
    d, x, u = (a.obj.astype(np.float64) for a in (da, ga, ua))
    return rnd(d * u) * _act_grad(act, x), d * rnd(_act(act, x))


def reference_swiglu(gate, up):
    """``swiglu`` in float64 from the given (rounded) values, silu(gate) rounded to the dtype."""
    return _ref_forward("silu", gate, up)


def reference_swiglu_backward(dy, gate, up):
    """``swiglu_backward`` in float64: ``(dgate, dup)``."""
    return _ref_backward("silu", dy, gate, up)


def reference_geglu(gate, up, approximate="none"):
    """``geglu`` in float64."""
    return _ref_forward(_approximate(approximate), gate, up)


def reference_geglu_backward(dy, gate, up, approximate="none"):
    """``geglu_backward`` in float64: ``(dgate, dup)``."""
    return _ref_backward(_approximate(approximate), dy, gate, up)


# ---- benchmark cases ----------------------------------------------------------------------------

# The workload: LLaMA-3 8B's MLP (intermediate 14336) for 8 x 2048 tokens.
WORKLOAD = {"full": (16384, 14336), "quick": (2048, 14336), "dtype": "bfloat16"}


def _inputs(shape, dtype, seed, *, grad=False, liger=False) -> dict:
    gen = generator(seed)
    t = {"a": randn(shape, dtype, gen), "b": randn(shape, dtype, gen)}
    if grad:
        t["dy"] = randn(shape, dtype, gen)
        t["leaves"] = tuple(x.detach().requires_grad_(True) for x in (t["a"], t["b"]))
    if liger:   # (Liger's backward writes its gradients into its inputs: copies of its own, so that
        # the others keep reading the random values; read after Liger's writes, the same
        # kernels measured twice as slow)
        t["liger_leaves"] = tuple(x.detach().clone().requires_grad_(True) for x in (t["a"], t["b"]))
    return t


def _fwd(t):
    return swiglu(t["a"], t["b"])


def _torch_fwd(t):
    import torch.nn.functional as F

    return F.silu(t["a"]) * t["b"]


def _fwd_bwd(t):
    return (swiglu(t["a"], t["b"]), *swiglu_backward(t["dy"], t["a"], t["b"]))


def _forward_on(F, t):
    """``F.swiglu`` where F has it (cukern.torch), else ``F.silu(gate) * up`` (PyTorch's)."""
    if F is None:
        import torch.nn.functional as F
    a, b = t["leaves"]
    fn = getattr(F, "swiglu", None)
    return fn(a, b) if fn is not None else F.silu(a) * b


def _torch_fwd_bwd(t):
    import torch

    y = _forward_on(None, t)
    return (y.detach(), *torch.autograd.grad(y, t["leaves"], t["dy"]))


def bench_cases(quick: bool) -> list:
    """(tokens, H); bytes in passes of tokens * H elements: fwd 3 (gate, up in; y out), fwd+bwd
    8 (+ dy, gate, up in; dgate, dup out)."""
    shape, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    p = functools.partial
    return [Case("swiglu fwd", "swiglu", shape, dt, elements_bytes(shape, dt, 3), p(_inputs, shape, dt),
                        _fwd, _torch_fwd),
            Case("swiglu fwd+bwd", "swiglu", shape, dt, elements_bytes(shape, dt, 8),
                        p(_inputs, shape, dt, grad=True), _fwd_bwd, _torch_fwd_bwd)]


def _liger(t):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(*t["liger_leaves"])


def torch_bench_cases(quick: bool) -> list:
    """swiglu through cukern.torch with autograd against PyTorch eager, torch.compile and Liger."""
    shape, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    return [TorchCase("swiglu fwd+bwd", "swiglu", shape, dt, elements_bytes(shape, dt, 8),
                             functools.partial(_inputs, shape, dt, grad=True, liger=True), _forward_on, _fwd_bwd,
                             liger=_liger, liger_leaves=True)]


# ---- PyTorch bindings -------------------------------------------------------------------------

_ACT_NAMES = {v: k for k, v in ACTS.items()}


def _fake(gate, up, act):
    import torch

    return (torch.empty_like(gate, memory_format=torch.contiguous_format),)


def _bwd_fake(dy, gate, up, act):
    import torch

    return tuple(torch.empty_like(gate, memory_format=torch.contiguous_format) for _ in range(2))


TORCH_OPS = (
    TorchOp("glu", "(Tensor gate, Tensor up, int act) -> Tensor",
            forward=lambda g, u, act: (_forward(_ACT_NAMES[act], g, u),),
            inference=lambda g, u, act: _forward(_ACT_NAMES[act], g, u),
            fake=_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1]), inputs[2]),
            backward_schema="(Tensor dy, Tensor gate, Tensor up, int act) -> (Tensor, Tensor)",
            backward=lambda dy, g, u, act: _backward(_ACT_NAMES[act], dy, g, u), backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, state), grads_to=(0, 1), native=True),
)


def _torch_glu(gate, up, act: str):
    import torch.nn.functional as F

    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="none" if act == "gelu" else "tanh") * up


def _call(T, ops, gate, up, act: str):
    """The kernels for CUDA tensors of one float dtype, shape and device; PyTorch's ops otherwise
    and inside torch.compile (Inductor fuses the two pointwise ops with what is around)."""
    if T.compiling():
        return _torch_glu(gate, up, act)
    reason = None
    if not (gate.is_cuda and up.is_cuda) or gate.dim() == 0:
        reason = "not CUDA tensors"
    elif gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        reason = "gate and up differ in shape, dtype or device"
    else:
        reason = T.float_params(gate)
    T.count("swiglu" if act == "silu" else "geglu", reason)
    return _torch_glu(gate, up, act) if reason is not None else ops["glu"](gate, up, ACTS[act])


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.swiglu`` and ``cukern.torch.geglu``."""

    def swiglu(gate, up):
        """``F.silu(gate) * up`` in one kernel, forward and backward (autograd; under
        torch.compile PyTorch's ops, which Inductor fuses). gate, up: (*, H) CUDA tensors of one
        float dtype; anything else runs PyTorch's ops."""
        return _call(T, ops, gate, up, "silu")

    def geglu(gate, up, approximate="none"):
        """``F.gelu(gate, approximate=approximate) * up`` in one kernel; see ``swiglu``."""
        return _call(T, ops, gate, up, _approximate(approximate))

    return {"swiglu": swiglu, "geglu": geglu}


FAMILY = Family(
    name="swiglu",
    api=(swiglu, swiglu_backward, geglu, geglu_backward),
    references={"swiglu": reference_swiglu, "swiglu_backward": reference_swiglu_backward,
                "geglu": reference_geglu, "geglu_backward": reference_geglu_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    torch_api=_torch_api,
)
