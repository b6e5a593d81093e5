"""Launch plans: what one call signature of an op needs, worked out once and kept.

A front checks its arguments, chooses kernels and grids, and packs the constant kernel arguments
the first time it sees a call signature (the op, the shapes, strides, dtypes, devices and
16-byte alignment of its arrays, and its scalar arguments); a repeated call then costs a
dictionary lookup, the output allocations and the launches:

    plan = cache.get(key)
    if plan is None:
        plan = cache.put(key, build())          # checks, choices, Kernel.prepare(...)
    bufs = plan(arrays)                         # allocate, launch on the caller's stream

A plan's buffer list is the call's arrays (inputs, None where an optional one is absent), then
the arrays it allocates (outputs and scratch), in order; kernel launches name them by
``Slot(i)``. Input fix-ups the kernels need (a contiguous copy of a strided view, say) are
steps of the plan too, so they happen only where the input forces them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from . import _arrays
from ._arrays import DeviceArray
from ._kernels import Slot

__all__ = ["Alloc", "Plan", "PlanCache", "Builder", "Fill", "record", "build_ahead"]

# .plans: the list a `record` block collects into, or _AHEAD inside build_ahead
_recording = threading.local()
_AHEAD = object()


class _Built(Exception):
    """Raised where a plan would run inside build_ahead."""


@dataclass(frozen=True)
class Alloc:
    """An array a plan allocates: its shape and dtype, laid out contiguously, channels-last
    (``layout="channels_last"``), or as buffer ``like``'s stride order (``layout="like"``)."""
    shape: tuple
    dtype: str
    layout: str = "contiguous"
    like: int = 0

    def __call__(self, bufs, first: DeviceArray) -> DeviceArray:
        if self.layout == "like":
            return _arrays.empty_like(bufs[self.like], self.dtype, self.shape)
        if self.layout == "channels_last":
            return _arrays.empty_channels_last(first, self.shape, self.dtype)
        return _arrays.empty(first, self.shape, self.dtype)


class Absent:
    """An allocation that is not made (an output that does not exist): its slot holds None."""

    def __call__(self, bufs, first):
        return None


class Fill:
    """A step that fills buffers ``indices`` (None ones skipped) with ``value`` on the caller's
    stream (scratch that must start at zero; the outputs of degenerate shapes)."""

    __slots__ = ("indices", "value")

    def __init__(self, indices, value: float):
        self.indices = tuple(indices)
        self.value = value

    def __call__(self, bufs, ptrs, stream):
        for i in self.indices:
            if bufs[i] is not None:
                _arrays.fill(bufs[i], self.value)


class Plan:
    """Fix-ups, allocations and steps for one call signature.

    ``fixes``: (slot, function) pairs applied to the given arrays first (each returns the
    array the kernels read, e.g. a contiguous copy); ``allocs``: what to allocate, appended to
    the buffer list; ``steps``: callables ``step(bufs, ptrs, stream)`` run in order on the
    caller's stream (a prepared :class:`cukern._kernels.Launch` is one).
    ``first`` names the buffer whose kind (torch, CuPy) and device the outputs take;
    ``outputs`` the buffers the front returns, by name (index in the buffer list).
    """

    __slots__ = ("device", "fixes", "allocs", "steps", "first", "outputs")

    def __init__(self, device: int, *, fixes=(), allocs=(), steps=(), first: int = 0, outputs=None):
        self.device = device
        self.fixes = tuple(fixes)
        self.allocs = tuple(allocs)
        self.steps = tuple(steps)
        self.first = first
        self.outputs = dict(outputs or {})

    def out(self, bufs: list, name: str):
        """The array (the caller's kind) of output ``name`` in ``bufs`` (what the plan
        returned), or None where the call does not produce it."""
        b = bufs[self.outputs[name]]
        return None if b is None else b.obj

    def __call__(self, arrays: list) -> list:
        """Run on ``arrays`` (the call's inputs, a list it may change); the buffer list."""
        plans = getattr(_recording, "plans", None)
        if plans is _AHEAD:
            raise _Built
        for slot, fix in self.fixes:
            arrays[slot] = fix(arrays[slot])
        given = len(arrays)
        first = arrays[self.first]
        with _arrays.on_device(self.device):
            bufs = arrays
            for alloc in self.allocs:
                bufs.append(alloc(bufs, first))
            if self.steps:
                ptrs = [0 if b is None else b.ptr for b in bufs]
                stream = _arrays.launch_stream(first)
                for step in self.steps:
                    step(bufs, ptrs, stream)
        if plans is not None:
            plans.append((self, bufs, given))
        return bufs


class record:
    """``with record() as plans:`` collects ``(plan, buffers, number given)`` for every plan run
    on this thread inside the block (cukern.torch's native path replays them from C++)."""

    def __enter__(self) -> list:
        self.previous = getattr(_recording, "plans", None)
        _recording.plans = []
        return _recording.plans

    def __exit__(self, *exc):
        _recording.plans = self.previous
        return False


def build_ahead(fn, *args) -> bool:
    """Call ``fn(*args)`` as far as the first plan it would run, which is built (its kernels
    compiled) and cached but not run: nothing is allocated or launched. True where a plan was
    reached; an error before it propagates. (cukern.torch builds a backward's plan this way
    while the forward runs, so that its kernels compile meanwhile.)"""
    previous = getattr(_recording, "plans", None)
    _recording.plans = _AHEAD
    try:
        fn(*args)
    except _Built:
        return True
    finally:
        _recording.plans = previous
    return False


class PlanCache:
    """Plans by call signature, for one front. Bounded: a workload that keeps changing shapes
    (every sequence length, say) drops the oldest plans rather than growing without end."""

    __slots__ = ("plans", "limit")

    def __init__(self, limit: int = 4096):
        self.plans: dict = {}
        self.limit = limit

    def plan(self, key, build, *args) -> Plan:
        """The plan of the call signature ``key``: the kept one, else ``build(*args)`` kept.
        ``key`` None: a call whose key does not determine its plan (a scalar given as an array,
        say), built every time and not kept."""
        if key is None:
            return build(*args)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.put(key, build(*args))
        return plan

    def get(self, key):
        return self.plans.get(key)

    def put(self, key, plan: Plan) -> Plan:
        if len(self.plans) >= self.limit:
            self.plans.pop(next(iter(self.plans)), None)   # (None: another thread took it first)
        self.plans[key] = plan
        return plan

    def clear(self) -> None:
        self.plans.clear()


class Builder:
    """Collects a plan while a front works it out: the slots of the given arrays, what to
    allocate (each new buffer's Slot), and the dtype of every buffer (for the launches' type
    checks against the kernels' declared pointer types)."""

    def __init__(self, arrays: list):
        self.arrays = arrays
        self.allocs: list = []
        self.fixes: list = []
        self.steps: list = []
        self.dtypes = {i: a.dtype for i, a in enumerate(arrays) if a is not None}
        self.outputs: dict[str, int] = {}

    def slot(self, i: int) -> Slot | None:
        """Input ``i``'s slot, or None (a null pointer) when it was not given."""
        return None if self.arrays[i] is None else Slot(i)

    def alloc(self, shape, dtype: str, layout: str = "contiguous", like: int = 0, name: str | None = None) -> Slot:
        """A new buffer (``name``: an output the front returns, read by that name)."""
        i = len(self.arrays) + len(self.allocs)
        self.allocs.append(Alloc(tuple(shape), dtype, layout, like))
        self.dtypes[i] = dtype
        if name is not None:
            self.outputs[name] = i
        return Slot(i)

    def absent(self, name: str | None = None) -> None:
        """A slot that stays None (an output the call does not produce)."""
        if name is not None:
            self.outputs[name] = len(self.arrays) + len(self.allocs)
        self.allocs.append(Absent())

    def output(self, name: str, slot: Slot) -> Slot:
        """Name a given buffer an output (one a kernel writes in place)."""
        self.outputs[name] = slot.index
        return slot

    def fix(self, i: int, fn) -> None:
        """Input ``i`` is replaced by ``fn(input)`` before the launches (e.g. a contiguous copy)."""
        self.fixes.append((i, fn))

    def launch(self, kernel, grid, block=None, **args) -> None:
        self.steps.append(kernel.prepare(grid, block, dtypes=self.dtypes, **args))

    def step(self, fn) -> None:
        """Any other step: ``fn(bufs, ptrs, stream)``."""
        self.steps.append(fn)

    def fill(self, value: float, *slots) -> None:
        """A step that fills the given buffers (None slots skipped) with ``value``, on the
        caller's stream (see :class:`Fill`)."""
        self.steps.append(Fill([s.index for s in slots if s is not None], value))

    def plan(self, device: int, first: int = 0) -> Plan:
        return Plan(device, fixes=self.fixes, allocs=self.allocs, steps=self.steps, first=first,
                    outputs=self.outputs)
