// Recording a bad input found on the device, without a host synchronization.
//
// A fault record is three long longs in device memory: {kind, value, bound}. The first thread
// to find a fault sets the kind (atomically; 0 means none: 1 an embedding index, 2 a
// cross-entropy target, 3 an attention document's offsets, as cukern/_faults.py names them)
// and stores the offending value and the bound it broke; later faults keep the first one. The
// host reads and clears the record at the next explicit check (cukern.check_errors()).
#pragma once

namespace cuk {

__device__ __forceinline__ void record_fault(long long* rec, long long value, long long bound,
                                             long long kind = 1) {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(rec), 0ull, static_cast<unsigned long long>(kind)) == 0ull) {
        rec[1] = value;
        rec[2] = bound;
    }
}

}  // namespace cuk
