"""The native eager path: an op's launch plans run from C++ under a C++ autograd node.

A Python ``torch.autograd.Function`` costs more host time than PyTorch's own C++ node for the
same op, before any of cukern's work (docs/torch.md: 1.63x for a Function that wraps PyTorch's
own layer_norm). So, for ops whose plans depend on nothing but their arguments
(``TorchOp.native``), the first call of a signature runs the Python path while
``cukern._plans.record`` notes the plans it runs (the forward's, and later the backward's);
those are handed to the extension (``_native.cpp``), and later calls of the signature go
straight to C++: key, lookup, allocations, driver launches, and a C++ node whose backward
runs the backward plan with no Python and no hand-off of the GIL.

The extension (``_native_build``: a host C++ compiler and ninja, about 30 s, once a machine) is
never waited for by default: the first native op call on CUDA tensors starts its build in a
process of its own, calls take the Python path meanwhile, and the first call after the build is
done switches over. ``CUKERN_NATIVE=wait`` waits for it at the first call instead;
``CUKERN_NATIVE=0`` keeps every call on the Python path. Where the build fails or cannot run
(no compiler, no ninja), the process that started it warns once; the failure is recorded, and
later processes take the Python path without trying again (``python -m cukern warmup`` tries
again). A signature whose calls the recorder cannot replay (a plan that copies an
input first, a step other than a kernel launch or a fill, more than one plan, empty
buffers) is declined and stays on the Python path. A backward that cannot be recorded for a
reason of that call alone (a gradient with gaps in its layout, or in a layout the backward
copies first; the deterministic setting changed since the forward) leaves the signature to be
recorded again by a later call, ``RECORD_TRIES`` times in all, before it is declined.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings

__all__ = ["module", "wait", "enabled", "begin", "take", "forward_parts", "register_inference", "register_training"]

_PENDING = object()   # a build runs (this process's or another's); calls take the Python path
_module = None       # the extension, _PENDING, or False once it failed or was turned off
_state_lock = threading.Lock()
_next_look = 0.0     # (monotonic) when a pending build is looked at next
_builder = None      # the build process this process started (it warns when that one fails)
LOOK_S = 1.0         # how often a call looks whether a pending build is done
_local = threading.local()   # .recording: the key of the signature the next Function.forward records
RECORD_TRIES = 4     # recordings of one signature whose backward could not be taken, before declining it
_failed_tries: dict[tuple, int] = {}


def _mode() -> str:
    """"off", "wait" or "background" (the default), from ``CUKERN_NATIVE``."""
    value = os.environ.get("CUKERN_NATIVE", "1").strip().lower()
    return "off" if value == "0" else "wait" if value == "wait" else "background"


def enabled() -> bool:
    """Whether the native path is on (``CUKERN_NATIVE`` is not 0) and has not failed."""
    return _module is not False and _mode() != "off"


def module():
    """The extension (bound to the driver), or None where it is off, failed, or still being
    built (the first call starts the build; see the module's docstring)."""
    m = _module
    if m is not None and m is not _PENDING:
        return m or None
    if m is _PENDING and time.monotonic() < _next_look:
        return None
    return _resolve(_mode() == "wait")


def wait():
    """The extension, built here or waited for if it is not built yet (None where it is off or
    its build failed): what a benchmark calls before it times the native path."""
    m = _module
    if m is not None and m is not _PENDING:
        return m or None
    return _resolve(True)


def _resolve(wait_for_it: bool):
    global _module, _next_look, _builder
    from . import _native_build

    with _state_lock:
        if _module is not None and _module is not _PENDING:
            return _module or None
        if _mode() == "off":
            _module = False
            return None
        _next_look = time.monotonic() + LOOK_S
        try:
            where = _native_build.folder()
            if wait_for_it:
                ext = _native_build.ensure(where)
            else:
                st = _native_build.state(where)
                if st == "failed":
                    if _builder is not None:   # (a failure recorded earlier stays quiet: reported once)
                        _warn(_native_build.failure(where))
                    _module = False
                    return None
                if st == "absent" and _builder is not None and _builder.poll() is not None:
                    _warn(f"its build process ended with status {_builder.returncode} and no result; "
                          f"see {where / 'build.log'}")
                    _module = False
                    return None
                if st != "built":
                    if st == "absent" and _builder is None:
                        _builder = _native_build.start(where)
                    _module = _PENDING
                    return None
                ext = _native_build.load(where)
            _module = _bind(ext)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, an ABI it cannot build against
            _warn(f"{type(e).__name__}: {str(e)[:300]}")
            _module = False
    return _module or None


def _warn(reason: str) -> None:
    warnings.warn(f"cukern.torch: the native eager path is off, its C++ extension could not be built ({reason}); "
                  "calls take the Python path. The failure is recorded and not retried; "
                  "`python -m cukern warmup` tries again, CUKERN_NATIVE=0 skips the build.",
                  RuntimeWarning, stacklevel=4)


def _bind(ext):
    """Hand the extension the driver entry points it launches through."""
    from .. import _driver

    lib = _driver.library()

    def address(fn) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    ext.init(address(lib.cuLaunchKernel), address(lib.cuCtxGetCurrent), address(lib.cuCtxSetCurrent),
             address(lib.cuDeviceGet), address(lib.cuDevicePrimaryCtxRetain), address(lib.cuTensorMapEncodeTiled))
    return ext


# ---- recording --------------------------------------------------------------------------------

def begin(key) -> None:
    """The next Function.forward on this thread records its plans for signature ``key``."""
    _local.recording = key


def take():
    """The key if the Function.forward now running should record, else None (and clears it)."""
    rec = getattr(_local, "recording", None)
    if rec is not None:
        _local.recording = None
    return rec


def _same(t, arr) -> bool:
    """Whether tensor ``t`` and plan buffer ``arr`` (a DeviceArray) are the same view of memory."""
    return (t is not None and arr is not None and hasattr(t, "data_ptr") and t.data_ptr() == arr.ptr
            and tuple(t.shape) == arr.shape and tuple(t.stride()) == arr.strides
            and str(t.dtype).removeprefix("torch.") == arr.dtype)


def _dense(t) -> bool:
    """Whether ``t`` is laid out densely in some axis order (no gaps, no overlap)."""
    from .._arrays import like_strides

    return tuple(t.stride()) == like_strides(tuple(t.shape), tuple(t.stride()))


def _find(t, bufs) -> int:
    for i, b in enumerate(bufs):
        if _same(t, b):
            return i
    return -1


def _export(ext, rec):
    """A recorded (plan, bufs, inputs) as the extension's plan tuple, or None where it cannot be
    replayed from C++ (input fix-ups, steps other than launches and fills). Holds no
    tensors (a recording kept on a Function's ctx must not hold its outputs: a reference cycle)."""
    from .._kernels import Launch
    from .._plans import Fill

    plan, bufs, n_in = rec
    # (a plan of empty buffers is declined: they share addresses, so which tensor is which
    # could not be told apart)
    if plan.fixes or any(b is not None and b.size == 0 for b in bufs):
        return None
    from .._tensormap import encode_args

    allocs = [None if b is None else ext.layout(b.obj) for b in bufs[n_in:]]
    steps = []
    for s in plan.steps:
        if isinstance(s, Fill):
            steps.append(("fill", list(s.indices), float(s.value)))
            continue
        if not isinstance(s, Launch):
            return None
        offsets = s.kernel.signature.offsets   # (a field's byte offset in the packed buffer)
        # a tensor map a launch: all of cuTensorMapEncodeTiled's arguments but the address are
        # fixed by the signature
        maps = [[offsets[at], m.index, *_map_fields(encode_args(bufs[m.index], m.box, m.swizzle))]
                for at, m in s.maps]
        steps.append((s.kernel.ptr, list(s.grid), list(s.block), s.kernel.instance.smem, s.layout.pack(*s.values),
                      [[offsets[at], slot, off] for at, slot, off in s.slots], maps,
                      [] if s.offsets is None else list(s.offsets)))
    return (n_in, allocs, steps)


def _map_fields(args) -> list:
    """encode_args' tuple flattened for the extension: data type, rank, dims (5), strides (4),
    box (5), swizzle, L2 promotion."""
    data_type, dims, strides, box, swizzle, l2 = args
    pad = lambda v, n: list(v) + [0] * (n - len(v))
    return [data_type, len(dims), *pad(dims, 5), *pad(strides, 4), *pad(box, 5), swizzle, l2]


def _sources(bufs, n_in, named: list) -> list | None:
    """For each given buffer of a plan: [kind, index] of the ``named`` tensors ((kind, index,
    tensor) triples) it is, [0, 0] for an absent one; None when one is none of them."""
    out = []
    for b in bufs[:n_in]:
        if b is None:
            out.append([0, 0])
            continue
        hit = next(([kind, i] for kind, i, t in named if _same(t, b)), None)
        if hit is None:
            return None
        out.append(hit)
    return out


ARG, OUTPUT, GRAD, SAVED = 1, 2, 3, 4


def forward_parts(ext, args, outputs, saved, plans):
    """(device, tensor argument positions, number of arguments, forward plan, its input
    sources, output buffer indices, saved sources) of a recorded forward, or None where it
    cannot be replayed. Nothing in it holds a tensor."""
    if len(plans) != 1:
        return None
    plan = _export(ext, plans[0])
    _, bufs, n_in = plans[0]
    sources = _sources(bufs, n_in, [(ARG, j, a) for j, a in enumerate(args)])
    outs = [_find(o, bufs) for o in outputs]
    if plan is None or sources is None or any(o < n_in for o in outs):
        return None
    refs = []
    for t in saved:
        hit = next(([ARG, j] for j, a in enumerate(args) if a is t), None) or \
            next(([OUTPUT, k] for k, o in enumerate(outputs) if o is t), None)
        if hit is None:
            return None
        refs.append(hit)
    return plans[0][0].device, tensor_args(args), len(args), plan, sources, outs, refs


def tensor_args(args) -> list[int]:
    """The positions of the arguments that are tensors (the C++ node's inputs)."""
    return [j for j, a in enumerate(args) if hasattr(a, "data_ptr")]


def register_inference(ext, key, args, outputs: tuple, plans: list) -> None:
    """Add a no-grad call's signature (``outputs`` its visible outputs), or decline it."""
    parts = forward_parts(ext, args, outputs, (), plans)
    if parts is None:
        ext.decline(key)
        return
    device, tensors, _, plan, sources, outs, _ = parts
    ext.add(key, device, tensors, plan, sources, outs, len(outputs), [], None, [], [], [])


def _backward_parts(ext, bargs, grads, saved, out, grads_to, nargs: int, plans: list):
    """(backward plan, its input sources, a buffer index an op argument or -1), or None."""
    if len(plans) != 1:
        return None
    plan = _export(ext, plans[0])
    _, bufs, n_in = plans[0]
    # (the C++ backward hands the plan dense, aligned gradients in this call's layout)
    if plan is None or not all(g is not None and _dense(g) and g.data_ptr() % 16 == 0 for g in grads):
        return None
    named = [(GRAD, g, t) for g, t in enumerate(grads)] + [(SAVED, s, t) for s, t in enumerate(saved)]
    if not all(any(t is a for _, _, t in named) for a in bargs if hasattr(a, "data_ptr")):
        return None   # a backward argument made in Python (it would not be made in C++)
    sources = _sources(bufs, n_in, named)
    gradients = [-1] * nargs
    for r, g in enumerate(out):
        if g is not None:   # (a given buffer too: a donating backward's, written into a saved one)
            b = _find(g, bufs)
            if b < 0:
                return None
            for j in (grads_to[r] if isinstance(grads_to[r], tuple) else (grads_to[r],)):
                gradients[j] = b
    return (plan, sources, gradients, [list(g.stride()) for g in grads]) if sources is not None else None


def retry(ext, key) -> None:
    """A backward that could not be recorded this time (see RECORD_TRIES): the signature is
    recorded again by a later call, or declined after too many tries."""
    tries = _failed_tries[tuple(key)] = _failed_tries.get(tuple(key), 0) + 1
    if tries >= RECORD_TRIES:
        ext.decline(key)


def register_training(ext, key, fwd, visible: int, bargs: tuple, grads: tuple, saved: tuple, out: tuple,
                      grads_to: tuple, plans: list) -> None:
    """Add signature ``key`` from its forward's parts (``forward_parts``) and the backward just
    run (``bargs`` its arguments, ``out`` its gradients, ``plans`` what it recorded), or
    decline it."""
    import torch

    device, tensors, nargs, plan, sources, outs, saved_refs = fwd
    # (the key holds torch.use_deterministic_algorithms as the forward saw it; a backward run
    # under the other setting made a plan for that one)
    same = bool(key[2]) == torch.are_deterministic_algorithms_enabled()
    bwd = same and _backward_parts(ext, bargs, grads, saved, out, grads_to, nargs, plans)
    if not bwd:
        # (what the backward recorded depends on this call's gradients and setting, not only on
        # the signature: a gradient in another layout, e.g. out.sum()'s or a contiguous one for a
        # channels-last output, must not keep later calls off the native path for good)
        retry(ext, key)
        return
    bplan, bsources, gradients, grad_strides = bwd
    ext.add(key, device, tensors, plan, sources, outs, visible, saved_refs, bplan, bsources, gradients, grad_strides)
