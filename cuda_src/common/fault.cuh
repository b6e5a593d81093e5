// Recording a bad input found on the device, without a host synchronization.
//
// A fault record is three long longs in device memory: {flag, value, bound}. The first thread
// to find a fault sets the flag (atomically) and stores the offending value and the bound it
// broke; later faults keep the first one. The host reads and clears the record at the next
// explicit check (cukern.check_errors()).
#pragma once

namespace cuk {

__device__ __forceinline__ void record_fault(long long* rec, long long value, long long bound) {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(rec), 0ull, 1ull) == 0ull) {
        rec[1] = value;
        rec[2] = bound;
    }
}

}  // namespace cuk
