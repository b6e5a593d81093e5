"""Bad inputs found on the device (out-of-range indices), reported without a sync on the hot path.

Kernels that can meet a bad value record it in a per-device fault record (three int64s:
flag, value, bound; see cuda_src/common/fault.cuh) and carry on safely. The record is read,
and cleared, only by ``check_errors()``: an explicit synchronization point the caller chooses
(after a training step, say), which raises ``IndexError`` for the first fault it finds.
"""
from __future__ import annotations

import numpy as np

__all__ = ["record", "check_errors"]

_records: dict[int, object] = {}  # device ordinal -> cupy int64[3]


def record(device: int):
    """The fault record of ``device`` (a CuPy array, zero-initialized on first use)."""
    rec = _records.get(device)
    if rec is None:
        import cupy

        with cupy.cuda.Device(device):
            rec = cupy.zeros(3, dtype=np.int64)
            cupy.cuda.Device(device).synchronize()  # once per device and process: initialized
        _records[device] = rec
    return rec


def check_errors() -> None:
    """Synchronize every device cukern has used and raise ``IndexError`` if a kernel met an
    out-of-range index since the last check. The record is cleared, so the next check
    passes unless new faults occur."""
    import cupy

    for device, rec in sorted(_records.items()):
        with cupy.cuda.Device(device):
            cupy.cuda.Device(device).synchronize()
            flag, value, bound = (int(v) for v in cupy.asnumpy(rec))
            if flag:
                rec.fill(0)
                cupy.cuda.Device(device).synchronize()
                raise IndexError(f"indices: index {value} is out of range for {bound} embeddings "
                                 f"(valid: 0 to {bound - 1}); found on CUDA device {device} by an "
                                 "embedding kernel since the last check")
