"""What the families' PyTorch routing needs from torch, in one place (the ``T`` their
``DropIn.route`` and ``TorchOp.backward_args`` functions receive): autocast, casts, the
checks every route shares, and the dtype sets."""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Optional

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT32_EPS = float(torch.finfo(torch.float32).eps)

# (op, input dtype, autocast dtype) -> the dtype PyTorch's op computes in under autocast.
_policy: dict[tuple, torch.dtype] = {}
# op -> probe(f, x): calls PyTorch's function f on a tiny tensor x (from the families' DropIns).
PROBES: dict[str, object] = {}
ORIGINAL: dict[str, object] = {}
# op -> the size below which its calls stay with PyTorch (the DropIns' min_size; patch() may
# override it).
MIN_SIZE: dict[str, int] = {}
SMALL = "small: PyTorch's dispatch costs less host time than the kernels save"


def small(op: str, size: int) -> bool:
    """Whether a call of ``op`` of ``size`` is too small to be worth cukern's host time."""
    return size < MIN_SIZE.get(op, 0)


def compiling() -> bool:
    """Inside a torch.compile trace: the custom ops (traceable) instead of the eager path."""
    return torch.compiler.is_compiling()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def traced(args) -> bool:
    """Whether a drop-in is being called on fake tensors while a graph is traced below dynamo
    (AOTAutograd runs a graph that kept PyTorch's function: through its __torch_function__
    dispatch that reaches the patched name, i.e. the drop-in, again)."""
    t = args[0] if args else None
    if type(t) in _PLAIN or not isinstance(t, torch.Tensor):
        return False
    from torch._guards import detect_fake_mode

    return detect_fake_mode(args) is not None


def deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled()


# (absent from a torch too old to say: then every graph counts as retained)
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


def saved_used_once() -> bool:
    """Inside a backward: whether autograd frees the graph after this pass (``retain_graph``
    false), so that the saved tensors will not be read again and a backward may write into the
    buffers its forward made (``TorchOp.donating_backward``), as PyTorch's own compiled
    backwards do. False outside a backward pass."""
    return not _keep_graph()


def autocast_dtype(op: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype PyTorch's ``op`` computes in for an input of ``dtype`` under the current CUDA
    autocast (``dtype`` itself when autocast is off). Autocast's cast lists are an
    implementation detail that changes between releases, so they are measured, not copied."""
    if not torch.is_autocast_enabled("cuda"):
        return dtype
    ac = torch.get_autocast_dtype("cuda")
    got = _policy.get((op, dtype, ac))
    if got is None:   # (prepare() fills the table when patch() is called, so traces never probe)
        got = _policy[(op, dtype, ac)] = _probe(op, dtype, ac)
    return got


def prepare() -> None:
    """Measure the autocast table for every op with a probe, input and autocast dtype (tiny
    calls on the current CUDA device); patch() calls it, so torch.compile traces find it full."""
    if not torch.cuda.is_available():
        return
    for op in PROBES:
        for dt in FLOAT_DTYPES:
            for ac in HALF_DTYPES:
                if (op, dt, ac) not in _policy:
                    _policy[(op, dt, ac)] = _probe(op, dt, ac)


def _probe(op: str, dtype: torch.dtype, ac: torch.dtype) -> torch.dtype:
    global _probe_eager
    if _probe_eager is None:   # (decorated at the first call: torch.compiler.disable imports
        _probe_eager = torch.compiler.disable(_run_probe)   # torch._dynamo, seconds of an import)
    return _probe_eager(op, dtype, ac)


_probe_eager = None


def _run_probe(op: str, dtype: torch.dtype, ac: torch.dtype) -> torch.dtype:
    x = torch.ones((2, 4, 2, 8), dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
    with torch.autocast("cuda", dtype=ac):
        return PROBES[op](ORIGINAL[op], x).dtype


def cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def float_params(x: Tensor, *params: Optional[Tensor]) -> Optional[str]:
    """Why x and its parameters do not suit the kernels, or None."""
    if not x.is_cuda:
        return "not a CUDA tensor"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype}"
    for p in params:
        if p is not None and (p.device != x.device or p.dtype != x.dtype):
            return "parameter dtype or device differs from the input's"
    return None


# ---- counts: which calls went where -----------------------------------------------------------

_counts: dict[str, dict[str, int]] = defaultdict(lambda: {"cukern": 0, "torch": 0})
_reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_count_lock = threading.Lock()
_quiet = threading.local()


@contextlib.contextmanager
def uncounted():
    """Calls made inside are not counted: ``patch(model)``'s own checks of a candidate routing
    are not the model's calls."""
    before = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = before


def count(op: str, reason: Optional[str]) -> None:
    """One eager call of ``op``: on cukern's kernels (reason None) or PyTorch's (why). Not
    called inside a torch.compile trace: there the routing is fixed in the graph (visible as
    torch.ops.cukern.*), and a trace-time count would mislead."""
    if getattr(_quiet, "on", False):
        return
    with _count_lock:
        _counts[op]["cukern" if reason is None else "torch"] += 1
        if reason is not None:
            _reasons[op][reason] += 1


def counts(reasons: bool = False) -> dict:
    """{op: {"cukern": n, "torch": m}} of the eager calls since the last ``reset_counts()``;
    with ``reasons=True`` also {op: {"torch_reasons": {reason: n}}} for the fallbacks."""
    with _count_lock:
        out = {op: dict(c) for op, c in _counts.items()}
        if reasons:
            for op, r in _reasons.items():
                out.setdefault(op, {"cukern": 0, "torch": 0})["torch_reasons"] = dict(r)
        return out


def reset_counts() -> None:
    with _count_lock:
        _counts.clear()
        _reasons.clear()
