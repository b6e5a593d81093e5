"""Experiment (on a GPU): does sorting the lookup indices within each warp speed up the
embedding forward? (The seed's idea; measured, not shipped: docs/notes-embedding.md.)

    python3 tools/experiment_embedding_warpsort.py

Three kernels copy the same rows, bf16, 65536 tokens from a 128256-row table, uniform and
Zipf-distributed indices, at several model dims:
  * cukern.embedding as shipped (a block a token);
  * warp: a warp takes 32 consecutive tokens and copies their rows one after another;
  * warp+sort: the same, after a bitonic sort of the 32 (index, lane) keys with shuffles, so
    that equal and nearby rows are read back to back.
warp vs warp+sort isolates the sort. Times are device times (median), GB/s on 2*T*D*2 bytes.
"""
import cupy
import numpy as np
import torch

import cukern
from cukern import _bench

SOURCE = r"""
template <bool SORT>
__global__ void __launch_bounds__(256) fwd_warp(const long long* __restrict__ idx, long long ntok,
                                                const uint4* __restrict__ w, int row_vecs,
                                                uint4* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = (gridDim.x * (long long)blockDim.x) >> 5;
    for (long long base = warp * 32; base < ntok; base += nwarps * 32) {
        const long long t = base + lane;
        unsigned long long key = t < ntok ? ((unsigned long long)idx[t] << 32) | lane : ~0ull;
        if (SORT) {
            for (int k = 2; k <= 32; k <<= 1) {
                for (int j = k >> 1; j > 0; j >>= 1) {
                    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, j);
                    const bool up = (lane & k) == 0, lower = (lane & j) == 0;
                    key = (lower == up) ? min(key, other) : max(key, other);
                }
            }
        }
        for (int k = 0; k < 32; ++k) {
            const unsigned long long kk = __shfl_sync(0xffffffffu, key, k);
            if (kk == ~0ull) break;
            const uint4* src = w + (long long)(kk >> 32) * row_vecs;
            uint4* dst = out + (base + (long long)(kk & 31)) * row_vecs;
            for (int c = lane; c < row_vecs; c += 32) dst[c] = src[c];
        }
    }
}
"""


def main():
    mod = cupy.RawModule(code=SOURCE, options=("--std=c++17",), name_expressions=["fwd_warp<false>", "fwd_warp<true>"])
    kern = {s: mod.get_function(f"fwd_warp<{'true' if s else 'false'}>") for s in (False, True)}
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    T, V = 65536, 128256
    print(f"{torch.cuda.get_device_name()}  copy {_bench.copy_bandwidth():.0f} GB/s  T={T} V={V} bf16")
    for dist in ("uniform", "zipf"):
        if dist == "zipf":
            idx = torch.from_numpy((np.random.default_rng(0).zipf(1.2, T) % V).astype(np.int64)).cuda()
        else:
            idx = torch.randint(0, V, (T,), device="cuda")
        for D in (64, 256, 512, 1024, 2048, 4096):
            w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.embedding(idx, w)
            out = torch.empty_like(ref)
            rv = D * 2 // 16

            def run(sort):
                kern[sort]((sms * 8,), (256,),
                           (idx.data_ptr(), np.int64(T), w.data_ptr(), np.int32(rv), out.data_ptr()))

            line = []
            for name, fn in (("cukern", lambda: cukern.embedding(idx, w)), ("warp", lambda: run(False)),
                             ("warp+sort", lambda: run(True)),
                             ("torch", lambda: torch.nn.functional.embedding(idx, w))):
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    ms = _bench.time_cuda(fn, warmup=5, reps=30)
                    if name.startswith("warp"):
                        torch.cuda.synchronize()
                        assert torch.equal(out, ref), name
                line.append(f"{name} {ms*1e3:7.1f} us {2*T*D*2/ms/1e6:6.0f} GB/s")
            print(f"{dist:7s} D={D:5d}: " + " | ".join(line))


if __name__ == "__main__":
    main()
