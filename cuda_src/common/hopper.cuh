// Hopper (sm_90a) primitives as inline PTX: mbarriers, TMA tile loads (cp.async.bulk.tensor)
// completing on an mbarrier, and warpgroup matrix products (wgmma.mma_async) with both operands
// from shared memory through matrix descriptors. Compiled for every architecture (so that the
// sources that include it compile everywhere); the instructions exist only on sm_90a, and the
// kernels that use them are built for it alone (Instance.arch, cukern/_kernels.py).
//
//
// The primitives by feature: sm90_base.cuh, sm90_barriers.cuh, sm90_tma.cuh, sm90_wgmma.cuh.
#pragma once
#include "sm90_base.cuh"
#include "sm90_barriers.cuh"
#include "sm90_tma.cuh"
#include "sm90_wgmma.cuh"
