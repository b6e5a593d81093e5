"""Bad inputs found on the device (out-of-range indices), reported without a sync on the hot path.

Kernels that can meet a bad value record it in a per-device fault record (three int64s:
kind, value, bound; see cuda_src/common/fault.cuh) and carry on safely. The record is read,
and cleared, only by ``check_errors()``: an explicit synchronization point the caller chooses
(after a training step, say), which raises ``IndexError`` for the first fault it finds.
"""
from __future__ import annotations

import numpy as np

__all__ = ["record", "check_errors"]

_records: dict[int, object] = {}  # device ordinal -> cupy int64[3]

# The record's kind -> the message of its IndexError (value, bound, device filled in).
KINDS = {
    1: "indices: index {value} is out of range for {bound} embeddings (valid: 0 to {last}); found on "
       "CUDA device {device} by an embedding kernel since the last check",
    2: "target: class {value} is out of range for {bound} classes (valid: 0 to {last}, or ignore_index); "
       "found on CUDA device {device} by a cross-entropy kernel since the last check (the row was ignored)",
    3: "cu_seqlens_q / cu_seqlens_k: document {value} of {bound} has offsets that are not from 0 to the token "
       "count in order, or is longer than max_seqlen; found on CUDA device {device} by an attention kernel since "
       "the last check (that document was not computed, and documents whose offsets overlap it may be wrong: "
       "the outputs of that call are not valid)",
    4: "experts: expert id {value} is out of range for {bound} experts (valid: 0 to {last}); found on CUDA device "
       "{device} by a mixture-of-experts permutation since the last check (its pair was placed after the last "
       "expert's rows: the outputs of that call are not valid)",
    5: "row_of / order: row {value} is out of range for {bound} rows; found on CUDA device {device} by a "
       "mixture-of-experts kernel since the last check (that row was skipped: the outputs of that call are not "
       "valid)",
    6: "offsets: expert {value}'s rows are not in order within the {bound} rows (offsets[0] = 0, offsets[e] <= "
       "offsets[e + 1] <= rows); found on CUDA device {device} by a grouped expert product since the last check "
       "(the offsets were clamped: the outputs of that call are not valid)",
}


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
    out-of-range index (an embedding index, a cross-entropy target) since the last check. The
    record is cleared, so the next check passes unless new faults occur."""
    try:
        import cupy
    except ImportError as e:
        from ._environment import INSTALL_HINT

        raise ModuleNotFoundError(f"check_errors: needs CuPy, which is not installed ({e}); {INSTALL_HINT}, "
                                  "which brings CuPy with [ctk] (NVRTC and the CUDA headers)", name="cupy") from e
    for device, rec in sorted(_records.items()):
        with cupy.cuda.Device(device):
            cupy.cuda.Device(device).synchronize()
            kind, value, bound = (int(v) for v in cupy.asnumpy(rec))
            if kind:
                rec.fill(0)
                cupy.cuda.Device(device).synchronize()
                raise IndexError(message(kind, value, bound, device))


def message(kind: int, value: int, bound: int, device: int) -> str:
    """The IndexError message of a fault record."""
    text = KINDS.get(kind, "a kernel recorded a fault of unknown kind {kind}: value {value}, bound {bound}")
    return text.format(kind=kind, value=value, bound=bound, last=bound - 1, device=device)
