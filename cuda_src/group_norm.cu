// GroupNorm over (N, C, *spatial), forward and backward, on two memory layouts:
//  * CL = false: contiguous (N, C, HW). A group (n, g) is one contiguous run of Cg*HW
//    elements: Cg channel rows of HW.
//  * CL = true:  channels-last, stored as (N, HW, C). A group is HW rows of Cg contiguous
//    channels, C apart.
// (HW is the product of the spatial sizes; Cg = C / G.)
//
// One block normalizes one tile of GT adjacent groups at a time (a grid-stride loop over the
// N*G/GT tiles; GT > 1 only channels-last, where it widens the contiguous run a row from
// Cg to GT*Cg channels). It reads the tile twice: once for the statistics, once to write the
// output. The host caps the grid so that the tiles in flight fit in L2, so the second read is
// served by L2 and DRAM sees about the byte floor (docs/notes-group-norm.md).
//
// Traversal: vectors of VEC elements along the unit-stride axis.
//  * CL = false: the group's Cg*SEG tasks (a channel row cut into SEG segments) are dealt to
//    warps in turn; a warp's lanes stride over the vectors of a task, so every task has one
//    channel, and the backward's per-channel sums are warp shuffles.
//  * CL = true: a warp covers 32/TCV rows x TCV vectors (TCV = the tile's vectors a row,
//    rounded up to a power of two, at most 32; wider tiles go in chunks of 32 vectors). A
//    lane always holds the same channels (and, for GT > 1, which the host allows only for
//    tiles of one chunk, the same group), and lanes holding the same channels reduce with
//    shuffles, then warps through shared memory, in a fixed order.
// All arithmetic is float32; every reduction has a fixed order, so results are bitwise
// reproducible and the weight gradients need no atomics: the backward writes per-sample
// partial rows (N, C) that sum_partial_rows (partial_sum.cu) adds up over N.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/reduce.cuh"
#include "common/mma.cuh"

namespace cuk {
namespace group_norm {

struct Geometry {
    int C, Cg, G;
    int Ct;                 // channels a tile: GT * Cg
    long long HW;
    long long M;            // elements in a group: Cg * HW
    int seg, seg_len;       // CL = false: segments a channel row, vectors a segment
    int tcv;                // CL = true: lanes a row (power of two <= 32)
};

__device__ __forceinline__ Geometry make_geometry(int C, int G, int GT, long long HW, int seg,
                                                 int seg_len, int tcv) {
    Geometry g;
    g.C = C;
    g.G = G;
    g.Cg = C / G;
    g.Ct = GT * g.Cg;
    g.HW = HW;
    g.M = static_cast<long long>(g.Cg) * HW;
    g.seg = seg;
    g.seg_len = seg_len;
    g.tcv = tcv;
    return g;
}

// Element offset of a tile's first element, and the channel it starts at.
template <bool CL, int GT>
__device__ __forceinline__ long long tile_base(const Geometry& g, long long tile, int& c0) {
    const long long per_sample = g.G / GT;
    const long long n = tile / per_sample;
    c0 = static_cast<int>(tile % per_sample) * g.Ct;
    return CL ? n * g.HW * g.C + c0 : (n * g.C + c0) * g.HW;
}

// a[j] for a j known only at run time, without local memory (GT is 1, 2 or 4).
template <int GT>
__device__ __forceinline__ float pick(const float (&a)[GT], int j) {
    float r = a[0];
#pragma unroll
    for (int k = 1; k < GT; ++k) r = j == k ? a[k] : r;
    return r;
}

// The group (within the tile) of this lane's channels: fixed for the whole tile when GT > 1.
template <bool CL, int GT, int VEC>
__device__ __forceinline__ int lane_group(const Geometry& g) {
    if (!CL || GT == 1) return 0;
    return min((static_cast<int>(threadIdx.x % 32) % g.tcv) * VEC / g.Cg, GT - 1);
}

// Calls f(off, stride, count, channel) for batches of vectors of one warp task: the batch's
// vectors are at off + u * stride (u < count <= U; count may be 0), in elements from the
// tile's base, all with the same first channel (CL = false: the task's channel; CL = true:
// the lane's first channel in this chunk). unit_end(channel, task) follows each task
// (CL = false, warp-uniform) or each chunk (CL = true, block-uniform: it may synchronize;
// task is then the chunk's first channel).
template <bool CL, int VEC, int THREADS, int U, typename F, typename E>
__device__ __forceinline__ void for_each_vec(const Geometry& g, F&& f, E&& unit_end) {
    constexpr int W = THREADS / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if constexpr (!CL) {
        const long long hwv = g.HW / VEC;
        const int tasks = g.Cg * g.seg;
        for (int t = warp; t < tasks; t += W) {
            const int c = t / g.seg;
            const long long v0 = static_cast<long long>(t % g.seg) * g.seg_len;
            const long long v1 = min(hwv, v0 + g.seg_len);
            const long long row = static_cast<long long>(c) * g.HW;
            for (long long v = v0 + lane; v < v1; v += 32 * U) {
                const int count = static_cast<int>(min(static_cast<long long>(U), (v1 - v + 31) / 32));
                f(row + v * VEC, 32 * VEC, count, c);
            }
            unit_end(c, t);
        }
    } else {
        const int ctv = g.Ct / VEC;
        const int rw = 32 / g.tcv;                 // rows a warp covers per step
        const int cv = lane % g.tcv, rs = lane / g.tcv;
        const long long step = static_cast<long long>(W) * rw;
        for (int chunk = 0; chunk < ctv; chunk += g.tcv) {
            const int vcol = chunk + cv;
            const bool col_ok = vcol < ctv;
            for (long long r = static_cast<long long>(warp) * rw + rs; r < g.HW; r += step * U) {
                const int count = col_ok ? static_cast<int>(min(static_cast<long long>(U), (g.HW - r + step - 1) / step)) : 0;
                f(r * g.C + static_cast<long long>(vcol) * VEC, step * g.C, count, vcol * VEC);
            }
            unit_end(chunk * VEC, chunk * VEC);
        }
    }
}

// The batch's vectors of two tensors of one shape (dy and x), at off + u * stride for
// u < count: all loads issued first (so they are in flight together), then f(u, fa, fb) for
// each pair, unpacked to float32.
template <typename T, int VEC, int U, typename F>
__device__ __forceinline__ void for_each_pair(const T* a, const T* b, long long off, long long stride, int count,
                                              F&& f) {
    Vec<T, VEC> av[U], bv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < count) {
            av[u] = load_vec<T, VEC>(a + off + u * stride);
            bv[u] = load_vec<T, VEC>(b + off + u * stride);
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u >= count) continue;
        float fa[VEC], fb[VEC];
        unpack(av[u], fa);
        unpack(bv[u], fb);
        f(u, fa, fb);
    }
}

// sum += x - c and sum_sq += (x - c)^2 over a vector's elements, in order (the forwards'
// one-pass sums about the group's first element, and their exact passes about the mean).
template <int VEC>
__device__ __forceinline__ void add_deviations(const float (&f)[VEC], float c, float& sum, float& sum_sq) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - c;
        sum += d;
        sum_sq += d * d;
    }
}

}  // namespace group_norm
}  // namespace cuk

// ---------------------------------------------------------------------------------------------
// Forward. x: (N, C, HW) or (N, HW, C) per CL; w, b: (C,) or null; y: x's layout;
// mean_out, rstd_out: (N, G) float32 or null.
// Statistics: sum(x-K) and sum((x-K)^2) with K the group's first element, one pass; where K
// lies far from the mean, an exact second pass (from L2) recomputes the variance and corrects
// the mean.
template <typename T, bool CL, int GT, int VEC, int THREADS, int U, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) group_norm_fwd(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int C, int G, long long HW, int seg, int seg_len, int tcv, long long tiles, float eps)
{
    using namespace cuk;
    using namespace cuk::group_norm;
    static_assert(GT == 1 || (CL && (GT == 2 || GT == 4)), "tiles of several groups: channels-last");
    const Geometry geo = make_geometry(C, G, GT, HW, seg, seg_len, tcv);
    using Reduce = GroupReduce<THREADS, 2 * GT>;   // the block: 2 sums a group of the tile
    __shared__ typename Reduce::TempStorage scratch;
    const float inv_m = 1.f / static_cast<float>(geo.M);
    const int jl = lane_group<CL, GT, VEC>(geo);
    auto nothing = [](int, int) {};
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int c0;
        const long long base = tile_base<CL, GT>(geo, tile, c0);
        const T* xg = x + base;
        float kk[GT];
#pragma unroll
        for (int j = 0; j < GT; ++j) kk[j] = to_float(xg[j * geo.Cg]);  // each group's first element
        const float k = pick<GT>(kk, jl);
        float s0 = 0.f, s1 = 0.f;
        for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int) {
            Vec<T, VEC> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < count) v[u] = load_stream<T, VEC>(xg + off + u * stride);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u >= count) continue;
                float f[VEC];
                unpack(v[u], f);
                add_deviations(f, k, s0, s1);
            }
        }, nothing);
        float s[2 * GT];
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            s[2 * j] = j == jl ? s0 : 0.f;
            s[2 * j + 1] = j == jl ? s1 : 0.f;
        }
        Reduce::sum(s, scratch);
        float mean[GT], var[GT];
        bool exact = false;
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            const float m = s[2 * j] * inv_m;
            var[j] = fmaxf(s[2 * j + 1] * inv_m - m * m, 0.f);
            mean[j] = kk[j] + m;
            exact |= m * m > 16.f * var[j];
        }
        if (exact) {  // uniform over the block: every thread has the same sums
            // Sums of d = x - mean and d^2 about the one-pass mean: the variance, and the mean's
            // correction (the one-pass sum of x - K carries K's rounding: with K an outlier the
            // mean itself was a few ulps of K off).
            const float ml = pick<GT>(mean, jl);
            float q0 = 0.f, q1 = 0.f;
            for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (u >= count) continue;
                    float f[VEC];
                    unpack(load_vec<T, VEC>(xg + off + u * stride), f);
                    add_deviations(f, ml, q1, q0);
                }
            }, nothing);
            float q[2 * GT];
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                q[2 * j] = j == jl ? q0 : 0.f;
                q[2 * j + 1] = j == jl ? q1 : 0.f;
            }
            Reduce::sum(q, scratch);
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                const float dm = q[2 * j + 1] * inv_m;
                var[j] = fmaxf(q[2 * j] * inv_m - dm * dm, 0.f);
                mean[j] += dm;
            }
        }
        float rstd[GT];
#pragma unroll
        for (int j = 0; j < GT; ++j) rstd[j] = rsqrtf(var[j] + eps);
        if (threadIdx.x == 0) {
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                if (mean_out) mean_out[tile * GT + j] = mean[j];
                if (rstd_out) rstd_out[tile * GT + j] = rstd[j];
            }
        }
        // y = (x - mean) * a + c per channel, a = rstd * w, c = b. (torch's kernel evaluates
        // x * a + (b - mean * a), which cancels where |mean| >> std; the two agree otherwise.)
        const float ml = pick<GT>(mean, jl), rl = pick<GT>(rstd, jl);
        T* yg = y + base;
        for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int ch) {
            float a[CL ? VEC : 1], c[CL ? VEC : 1];
#pragma unroll
            for (int j = 0; j < (CL ? VEC : 1); ++j) {
                const int cc = min(c0 + ch + j, geo.C - 1);
                a[j] = w ? rl * to_float(w[cc]) : rl;
                c[j] = b ? to_float(b[cc]) : 0.f;
            }
            Vec<T, VEC> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < count) v[u] = load_vec<T, VEC>(xg + off + u * stride);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u >= count) continue;
                float f[VEC];
                unpack(v[u], f);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int jj = CL ? j : 0;
                    f[j] = fmaf(f[j] - ml, a[jj], c[jj]);
                }
                store_stream<T, VEC>(yg + off + u * stride, pack<T, VEC>(f));
            }
        }, nothing);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward, contiguous, with the whole group in shared memory: each block takes groups
// blockIdx.x, blockIdx.x + gridDim.x, ... (a grid of the blocks that fit at once). Vector i of
// a group is thread i % THREADS's (its k-th, k = i / THREADS), and a thread reads back only what
// it requested itself, so no block barrier guards the buffer. A group's vectors are requested
// by cp.async in STAGES commit groups; the sums are taken stage by stage as they land; the exact
// second pass (where needed) and the output read the group back from shared memory, and as the
// output of a stage is written its slots are requested for the block's next group. The loads of
// one group are so in flight while the previous one is written: an SM reads and writes at once.
// Needs HW % VEC == 0 and 16-byte aligned x, y. Arguments as group_norm_fwd's (groups: N*G).
template <typename T, int THREADS, int SMEM>
__global__ void __launch_bounds__(THREADS, 1) group_norm_fwd_staged(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int C, int G, long long HW, long long groups, float eps)
{
    using namespace cuk;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int STAGES = 4;
    constexpr int PER_THREAD = SMEM / 16 / THREADS;   // vectors a thread
    constexpr int PER_STAGE = PER_THREAD / STAGES;
    static_assert(PER_THREAD % STAGES == 0 && PER_STAGE >= 1, "SMEM / 16 / THREADS: a multiple of the stages");
    extern __shared__ __align__(16) unsigned char group_s[];
    using Reduce = GroupReduce<THREADS, 2>;
    __shared__ typename Reduce::TempStorage scratch;
    const int cg = C / G, hw = static_cast<int>(HW);
    const int vectors = cg * hw / VEC;
    const long long group_len = static_cast<long long>(cg) * hw;
    Vec<T, VEC>* const buf = reinterpret_cast<Vec<T, VEC>*>(group_s);
    const int tid = threadIdx.x;
    // this thread's vectors of stage s of `group` requested (none past the last group), one commit group
    auto request = [&](long long group, int s) {
        if (group < groups) {
            const T* xg = x + group * group_len;
#pragma unroll
            for (int k = s * PER_STAGE; k < (s + 1) * PER_STAGE; ++k) {
                const int i = tid + k * THREADS;
                if (i < vectors) cp_async_16(buf + i, xg + static_cast<long long>(i) * VEC, true);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES; ++s) request(blockIdx.x, s);
    const float inv_m = 1.f / static_cast<float>(group_len);
    for (long long group = blockIdx.x; group < groups; group += gridDim.x) {
        const T* xg = x + group * group_len;
        T* yg = y + group * group_len;
        const int c0 = static_cast<int>(group % G) * cg;
        const float kx = to_float(xg[0]);   // the group's first element (the shift of the one-pass sums)
        float s0 = 0.f, s1 = 0.f;
        auto stage_sums = [&](int s) {
#pragma unroll
            for (int k = s * PER_STAGE; k < (s + 1) * PER_STAGE; ++k) {
                const int i = tid + k * THREADS;
                if (i >= vectors) continue;
                float f[VEC];
                unpack(buf[i], f);
                group_norm::add_deviations(f, kx, s0, s1);
            }
        };
        // (each wait, then a compiler barrier: the stage's shared-memory reads stay after it)
        static_assert(STAGES == 4, "the waits below");
        cp_async_wait<3>();
        asm volatile("" ::: "memory");
        stage_sums(0);
        cp_async_wait<2>();
        asm volatile("" ::: "memory");
        stage_sums(1);
        cp_async_wait<1>();
        asm volatile("" ::: "memory");
        stage_sums(2);
        cp_async_wait<0>();
        asm volatile("" ::: "memory");
        stage_sums(3);
        float sums[2] = {s0, s1};
        Reduce::sum(sums, scratch);
        const float m = sums[0] * inv_m;
        float var = fmaxf(sums[1] * inv_m - m * m, 0.f);
        float mean = kx + m;
        if (m * m > 16.f * var) {   // (block-uniform) the exact second pass, from shared memory
            float q[2] = {0.f, 0.f};   // (as the two-read kernel's: the variance and the mean's correction)
#pragma unroll
            for (int k = 0; k < PER_THREAD; ++k) {
                const int i = tid + k * THREADS;
                if (i >= vectors) continue;
                float f[VEC];
                unpack(buf[i], f);
                group_norm::add_deviations(f, mean, q[1], q[0]);
            }
            Reduce::sum(q, scratch);
            const float dm = q[1] * inv_m;
            var = fmaxf(q[0] * inv_m - dm * dm, 0.f);
            mean += dm;
        }
        const float rstd = rsqrtf(var + eps);
        if (tid == 0) {
            if (mean_out) mean_out[group] = mean;
            if (rstd_out) rstd_out[group] = rstd;
        }
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
#pragma unroll
            for (int k = s * PER_STAGE; k < (s + 1) * PER_STAGE; ++k) {
                const int i = tid + k * THREADS;
                if (i >= vectors) continue;
                const int c = c0 + i * VEC / hw;   // (hw % VEC == 0: a vector has one channel)
                const float a = w ? rstd * to_float(w[c]) : rstd, cc = b ? to_float(b[c]) : 0.f;
                float f[VEC];
                unpack(buf[i], f);
#pragma unroll
                for (int j = 0; j < VEC; ++j) f[j] = fmaf(f[j] - mean, a, cc);
                store_stream<T, VEC>(yg + static_cast<long long>(i) * VEC, pack<T, VEC>(f));
            }
            // The stage's reads above stay before its new requests (a compiler barrier); on the
            // device each read's value is stored to y before the cp.async into its slot issues
            // (in-order issue, and the store waits for the read's data).
            asm volatile("" ::: "memory");
            request(group + gridDim.x, s);
        }
    }
    cp_async_wait<0>();   // (the last, empty, commit groups)
}

// ---------------------------------------------------------------------------------------------
// Backward. dy, x: the layout of CL; w: (C,) or null; mean, rstd: (N, G) float32;
// dx: x's layout; dw_part, db_part: (N, C) float32 partial rows, always written:
//   dw_part[n, c] = rstd * sum_hw dy * (x - mean),  db_part[n, c] = sum_hw dy.
// With xhat = (x - mean) * rstd, gamma = w (or 1) and M = Cg * HW:
//   dx = rstd * (gamma*dy - S1/M - xhat * S2/M),  S1 = sum_c gamma_c db_c,
//   S2 = sum_c gamma_c dw_c (the group's sums of dxhat and dxhat*xhat).
// The block reads back the per-channel sums it wrote (plain loads: written in this kernel).
template <typename T, bool CL, int GT, int VEC, int THREADS, int U, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) group_norm_bwd(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
    T* __restrict__ dx, float* dw_part, float* db_part,
    int C, int G, long long HW, int seg, int seg_len, int tcv, long long tiles)
{
    using namespace cuk;
    using namespace cuk::group_norm;
    static_assert(GT == 1 || (CL && (GT == 2 || GT == 4)), "tiles of several groups: channels-last");
    const Geometry geo = make_geometry(C, G, GT, HW, seg, seg_len, tcv);
    constexpr int W = THREADS / 32;
    constexpr int CW = CL ? 32 * VEC : 1;               // channels a chunk (CL)
    constexpr int SLOTS = CL ? W * CW : 256;            // per-warp sums (CL) or task sums
    __shared__ float red_s[SLOTS], red_b[SLOTS];
    using Reduce = GroupReduce<THREADS, 2 * GT>;   // the block: S1, S2 of each group of the tile
    __shared__ typename Reduce::TempStorage scratch;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float inv_m = 1.f / static_cast<float>(geo.M);
    const int jl = lane_group<CL, GT, VEC>(geo);
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int c0;
        const long long base = tile_base<CL, GT>(geo, tile, c0);
        const long long n = tile / (geo.G / GT);
        float mean[GT], rstd[GT];
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            mean[j] = mean_in[tile * GT + j];
            rstd[j] = rstd_in[tile * GT + j];
        }
        const float ml = pick<GT>(mean, jl), rl = pick<GT>(rstd, jl);
        const T* dyg = dy + base;
        const T* xg = x + base;
        float* dwp = dw_part + n * geo.C + c0;
        float* dbp = db_part + n * geo.C + c0;

        // Pass 1: per-channel sums.
        float as[CL ? VEC : 1], ab[CL ? VEC : 1];
#pragma unroll
        for (int j = 0; j < (CL ? VEC : 1); ++j) as[j] = ab[j] = 0.f;
        for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int) {
            for_each_pair<T, VEC, U>(dyg, xg, off, stride, count, [&](int, const float (&fd)[VEC], const float (&fx)[VEC]) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int jj = CL ? j : 0;
                    as[jj] += fd[j] * (fx[j] - ml);
                    ab[jj] += fd[j];
                }
            });
        }, [&](int ch, int task) {
            if constexpr (!CL) {
                // A task is done: its sums go to the channel (one segment) or to a task slot.
                butterfly<16, 1>(Sum{}, as[0], ab[0]);   // over the warp that did the task
                if (lane == 0) {
                    if (geo.seg == 1) {
                        dwp[ch] = rl * as[0];
                        dbp[ch] = ab[0];
                    } else {  // the host keeps Cg * seg <= SLOTS when seg > 1
                        red_s[task] = as[0];
                        red_b[task] = ab[0];
                    }
                }
                as[0] = ab[0] = 0.f;
            } else {
                // A chunk of columns is done: lanes with the same channels, then warps.
                butterfly_down_to<16>(geo.tcv, Sum{}, as, ab);   // (as[j], ab[j] in turn)
                if (lane < geo.tcv) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        red_s[warp * CW + lane * VEC + j] = as[j];
                        red_b[warp * CW + lane * VEC + j] = ab[j];
                    }
                }
                __syncthreads();
                const int cc = threadIdx.x;  // a channel of this chunk
                if (cc < geo.tcv * VEC && ch + cc < geo.Ct) {
                    float ts = 0.f, tb = 0.f;
#pragma unroll
                    for (int k = 0; k < W; ++k) {
                        ts += red_s[k * CW + cc];
                        tb += red_b[k * CW + cc];
                    }
                    dwp[ch + cc] = pick<GT>(rstd, (ch + cc) / geo.Cg) * ts;
                    dbp[ch + cc] = tb;
                }
                __syncthreads();
#pragma unroll
                for (int j = 0; j < VEC; ++j) as[j] = ab[j] = 0.f;
            }
        });
        if constexpr (!CL) {
            if (geo.seg > 1) {  // several segments a channel: add them in order
                __syncthreads();
                for (int c = threadIdx.x; c < geo.Cg; c += THREADS) {
                    float ts = 0.f, tb = 0.f;
                    for (int k = 0; k < geo.seg; ++k) {
                        ts += red_s[c * geo.seg + k];
                        tb += red_b[c * geo.seg + k];
                    }
                    dwp[c] = rl * ts;
                    dbp[c] = tb;
                }
            }
        }
        __syncthreads();  // the per-channel sums are visible to the whole block

        // S1, S2 of each group of the tile, over its channels, in a fixed order.
        float s[2 * GT];
#pragma unroll
        for (int j = 0; j < 2 * GT; ++j) s[j] = 0.f;
        for (int c = threadIdx.x; c < geo.Ct; c += THREADS) {
            const float gamma = w ? to_float(w[c0 + c]) : 1.f;
            const int jc = c / geo.Cg;
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                if (j == jc) {
                    s[2 * j] += gamma * dbp[c];
                    s[2 * j + 1] += gamma * dwp[c];
                }
            }
        }
        Reduce::sum(s, scratch);
        float bco[GT], cco[GT];   // dx = a[c]*dy + bco*(x - mean) + cco, per group
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            bco[j] = -rstd[j] * rstd[j] * s[2 * j + 1] * inv_m;
            cco[j] = -rstd[j] * s[2 * j] * inv_m;
        }
        // A group of one element: y = b whatever x, so dx is exactly 0 (as a LayerNorm row of
        // one); the form below would leave the rounding of rstd*w*dy against rstd*S1. The case
        // is block-uniform and costs nothing an element: the coefficients are zeroed.
        const bool single = inv_m == 1.f;   // (M == 1; inv_m is live here anyway, M is not)
        const float bl = single ? 0.f : pick<GT>(bco, jl), cl = single ? 0.f : pick<GT>(cco, jl);
        const float al = single ? 0.f : rl;

        // Pass 2: dx.
        T* dxg = dx + base;
        for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int ch) {
            float a[CL ? VEC : 1];
#pragma unroll
            for (int j = 0; j < (CL ? VEC : 1); ++j)
                a[j] = w ? al * to_float(w[min(c0 + ch + j, geo.C - 1)]) : al;
            for_each_pair<T, VEC, U>(dyg, xg, off, stride, count, [&](int u, float (&fd)[VEC], const float (&fx)[VEC]) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int jj = CL ? j : 0;
                    fd[j] = fmaf(fd[j], a[jj], fmaf(bl, fx[j] - ml, cl));
                }
                store_stream<T, VEC>(dxg + off + u * stride, pack<T, VEC>(fd));
            });
        }, [](int, int) {});
        __syncthreads();  // the next tile reuses scratch and the partial-row reads are done
    }
}
