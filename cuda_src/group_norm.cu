// GroupNorm over (N, C, *spatial), forward and backward, on two memory layouts:
//  * CL = false: contiguous (N, C, HW). A group (n, g) is one contiguous run of Cg*HW
//    elements: Cg channel rows of HW.
//  * CL = true:  channels-last, stored as (N, HW, C). A group is HW rows of Cg contiguous
//    channels, C apart.
// (HW is the product of the spatial sizes; Cg = C / G.)
//
// One block normalizes one group at a time (a grid-stride loop over the N*G groups). It
// reads the group twice: once for the statistics, once to write the output. The host caps
// the grid so that the groups in flight fit in L2 (docs/notes-group-norm.md), so the second
// read is served by L2 and DRAM sees the byte floor: x read once, y written once.
//
// Traversal: vectors of VEC elements along the unit-stride axis.
//  * CL = false: the group's Cg*SEG tasks (a channel row cut into SEG segments) are dealt to
//    warps in turn; a warp's lanes stride over the vectors of a task, so every task has one
//    channel, and the backward's per-channel sums are warp shuffles.
//  * CL = true: a warp covers 32/TCV rows x TCV vectors (TCV = the group's vectors a row,
//    rounded up to a power of two, at most 32; wider groups go in chunks of 32 vectors). A
//    lane always holds the same channels, and lanes holding the same channels reduce with
//    shuffles, then warps through shared memory, in a fixed order.
// All arithmetic is float32; every reduction has a fixed order, so results are bitwise
// reproducible and the weight gradients need no atomics: the backward writes per-sample
// partial rows (N, C) that sum_partial_rows (partial_sum.cu) adds up over N.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/reduce.cuh"

namespace gn {

struct Geometry {
    int C, Cg, G;
    long long HW;
    long long M;            // elements in a group: Cg * HW
    int seg, seg_len;       // CL = false: segments a channel row, vectors a segment
    int tcv;                // CL = true: lanes a row (power of two <= 32)
};

__device__ __forceinline__ Geometry make_geometry(int C, int G, long long HW, int seg, int seg_len,
                                                 int tcv) {
    Geometry g;
    g.C = C;
    g.G = G;
    g.Cg = C / G;
    g.HW = HW;
    g.M = static_cast<long long>(g.Cg) * HW;
    g.seg = seg;
    g.seg_len = seg_len;
    g.tcv = tcv;
    return g;
}

template <bool CL>
__device__ __forceinline__ long long group_base(const Geometry& g, long long group) {
    const long long n = group / g.G, k = group % g.G;
    return CL ? n * g.HW * g.C + k * g.Cg : (n * g.C + k * g.Cg) * g.HW;
}

// Calls f(off, stride, count, channel) for batches of vectors of one warp task: the batch's
// vectors are at off + u * stride (u < count <= U; count may be 0), in elements from the
// group's base, all with the same first channel (CL = false: the task's channel; CL = true:
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
        const int cgv = g.Cg / VEC;
        const int rw = 32 / g.tcv;                 // rows a warp covers per step
        const int cv = lane % g.tcv, rs = lane / g.tcv;
        const long long step = static_cast<long long>(W) * rw;
        for (int chunk = 0; chunk < cgv; chunk += g.tcv) {
            const int vcol = chunk + cv;
            const bool col_ok = vcol < cgv;
            for (long long r = static_cast<long long>(warp) * rw + rs; r < g.HW; r += step * U) {
                const int count = col_ok ? static_cast<int>(min(static_cast<long long>(U), (g.HW - r + step - 1) / step)) : 0;
                f(r * g.C + static_cast<long long>(vcol) * VEC, step * g.C, count, vcol * VEC);
            }
            unit_end(chunk * VEC, chunk * VEC);
        }
    }
}

}  // namespace gn

// ---------------------------------------------------------------------------------------------
// Forward. x: (N, C, HW) or (N, HW, C) per CL; w, b: (C,) or null; y: x's layout;
// mean_out, rstd_out: (N, G) float32 or null.
// Statistics: sum(x-K) and sum((x-K)^2) with K the group's first element, one pass; where K
// lies far from the mean, an exact second pass (from L2) recomputes the variance.
template <typename T, bool CL, int VEC, int THREADS, int U, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) group_norm_fwd(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int C, int G, long long HW, int seg, int seg_len, int tcv, long long groups, float eps)
{
    const gn::Geometry geo = gn::make_geometry(C, G, HW, seg, seg_len, tcv);
    __shared__ float scratch[2 * (THREADS / 32)];
    const float inv_m = 1.f / static_cast<float>(geo.M);
    auto nothing = [](int, int) {};
    for (long long grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const long long base = gn::group_base<CL>(geo, grp);
        const T* xg = x + base;
        const float k = to_float(xg[0]);
        float s[2] = {0.f, 0.f};
        gn::for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int) {
            Vec<T, VEC> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < count) v[u] = load_stream<T, VEC>(xg + off + u * stride);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u >= count) continue;
                float f[VEC];
                unpack(v[u], f);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float d = f[j] - k;
                    s[0] += d;
                    s[1] += d * d;
                }
            }
        }, nothing);
        group_sum<THREADS, 2>(s, scratch);
        const float m = s[0] * inv_m;
        float var = fmaxf(s[1] * inv_m - m * m, 0.f);
        const float mean = k + m;
        if (m * m > 16.f * var) {  // uniform over the block: every thread has the same sums
            float q[1] = {0.f};
            gn::for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (u >= count) continue;
                    float f[VEC];
                    unpack(load_vec<T, VEC>(xg + off + u * stride), f);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float d = f[j] - mean;
                        q[0] += d * d;
                    }
                }
            }, nothing);
            group_sum<THREADS, 1>(q, scratch);
            var = q[0] * inv_m;
        }
        const float rstd = rsqrtf(var + eps);
        if (threadIdx.x == 0) {
            if (mean_out) mean_out[grp] = mean;
            if (rstd_out) rstd_out[grp] = rstd;
        }
        // y = (x - mean) * a + c per channel, a = rstd * w, c = b. (torch's kernel evaluates
        // x * a + (b - mean * a), which cancels where |mean| >> std; the two agree otherwise.)
        const int c0 = static_cast<int>(grp % geo.G) * geo.Cg;
        T* yg = y + base;
        gn::for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int ch) {
            float a[CL ? VEC : 1], c[CL ? VEC : 1];
#pragma unroll
            for (int j = 0; j < (CL ? VEC : 1); ++j) {
                const int cc = c0 + ch + j;
                a[j] = w ? rstd * to_float(w[min(cc, geo.C - 1)]) : rstd;
                c[j] = b ? to_float(b[min(cc, geo.C - 1)]) : 0.f;
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
                    f[j] = fmaf(f[j] - mean, a[jj], c[jj]);
                }
                store_stream<T, VEC>(yg + off + u * stride, pack<T, VEC>(f));
            }
        }, nothing);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward. dy, x: the layout of CL; w: (C,) or null; mean, rstd: (N, G) float32;
// dx: x's layout; dw_part, db_part: (N, C) float32 partial rows, always written:
//   dw_part[n, c] = rstd * sum_hw dy * (x - mean),  db_part[n, c] = sum_hw dy.
// With xhat = (x - mean) * rstd, gamma = w (or 1) and M = Cg * HW:
//   dx = rstd * (gamma*dy - S1/M - xhat * S2/M),  S1 = sum_c gamma_c db_c,
//   S2 = sum_c gamma_c dw_c (the group's sums of dxhat and dxhat*xhat).
// The block reads back the per-channel sums it wrote (plain loads: written in this kernel).
template <typename T, bool CL, int VEC, int THREADS, int U, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) group_norm_bwd(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
    T* __restrict__ dx, float* dw_part, float* db_part,
    int C, int G, long long HW, int seg, int seg_len, int tcv, long long groups)
{
    const gn::Geometry geo = gn::make_geometry(C, G, HW, seg, seg_len, tcv);
    constexpr int W = THREADS / 32;
    constexpr int CW = CL ? 32 * VEC : 1;               // channels a chunk (CL)
    constexpr int SLOTS = CL ? W * CW : 256;            // per-warp sums (CL) or task sums
    __shared__ float red_s[SLOTS], red_b[SLOTS];
    __shared__ float scratch[2 * W];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float inv_m = 1.f / static_cast<float>(geo.M);
    for (long long grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const long long base = gn::group_base<CL>(geo, grp);
        const long long n = grp / geo.G;
        const int c0 = static_cast<int>(grp % geo.G) * geo.Cg;
        const float mean = mean_in[grp], rstd = rstd_in[grp];
        const T* dyg = dy + base;
        const T* xg = x + base;
        float* dwp = dw_part + n * geo.C + c0;
        float* dbp = db_part + n * geo.C + c0;

        // Pass 1: per-channel sums.
        float as[CL ? VEC : 1], ab[CL ? VEC : 1];
#pragma unroll
        for (int j = 0; j < (CL ? VEC : 1); ++j) as[j] = ab[j] = 0.f;
        gn::for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int) {
            Vec<T, VEC> dv[U], xv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u < count) {
                    dv[u] = load_stream<T, VEC>(dyg + off + u * stride);
                    xv[u] = load_stream<T, VEC>(xg + off + u * stride);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u >= count) continue;
                float fd[VEC], fx[VEC];
                unpack(dv[u], fd);
                unpack(xv[u], fx);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int jj = CL ? j : 0;
                    as[jj] += fd[j] * (fx[j] - mean);
                    ab[jj] += fd[j];
                }
            }
        }, [&](int ch, int task) {
            if constexpr (!CL) {
                // A task is done: its sums go to the channel (one segment) or to a task slot.
#pragma unroll
                for (int off = 16; off > 0; off /= 2) {
                    as[0] += __shfl_xor_sync(0xffffffffu, as[0], off);
                    ab[0] += __shfl_xor_sync(0xffffffffu, ab[0], off);
                }
                if (lane == 0) {
                    if (geo.seg == 1) {
                        dwp[ch] = rstd * as[0];
                        dbp[ch] = ab[0];
                    } else {  // the host keeps Cg * seg <= SLOTS when seg > 1
                        red_s[task] = as[0];
                        red_b[task] = ab[0];
                    }
                }
                as[0] = ab[0] = 0.f;
            } else {
                // A chunk of columns is done: lanes with the same channels, then warps.
                for (int off = 16; off >= geo.tcv; off /= 2) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        as[j] += __shfl_xor_sync(0xffffffffu, as[j], off);
                        ab[j] += __shfl_xor_sync(0xffffffffu, ab[j], off);
                    }
                }
                if (lane < geo.tcv) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        red_s[warp * CW + lane * VEC + j] = as[j];
                        red_b[warp * CW + lane * VEC + j] = ab[j];
                    }
                }
                __syncthreads();
                const int cc = threadIdx.x;  // a channel of this chunk
                if (cc < geo.tcv * VEC && ch + cc < geo.Cg) {
                    float ts = 0.f, tb = 0.f;
#pragma unroll
                    for (int k = 0; k < W; ++k) {
                        ts += red_s[k * CW + cc];
                        tb += red_b[k * CW + cc];
                    }
                    dwp[ch + cc] = rstd * ts;
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
                    dwp[c] = rstd * ts;
                    dbp[c] = tb;
                }
            }
        }
        __syncthreads();  // the per-channel sums are visible to the whole block

        // S1, S2 over the group's channels, in a fixed order.
        float s[2] = {0.f, 0.f};
        for (int c = threadIdx.x; c < geo.Cg; c += THREADS) {
            const float gamma = w ? to_float(w[c0 + c]) : 1.f;
            s[0] += gamma * dbp[c];
            s[1] += gamma * dwp[c];
        }
        group_sum<THREADS, 2>(s, scratch);
        const float bcoef = -rstd * rstd * s[1] * inv_m;
        const float ccoef = -rstd * s[0] * inv_m;   // dx = a[c]*dy + bcoef*(x - mean) + ccoef

        // Pass 2: dx.
        T* dxg = dx + base;
        gn::for_each_vec<CL, VEC, THREADS, U>(geo, [&](long long off, long long stride, int count, int ch) {
            float a[CL ? VEC : 1];
#pragma unroll
            for (int j = 0; j < (CL ? VEC : 1); ++j)
                a[j] = w ? rstd * to_float(w[min(c0 + ch + j, geo.C - 1)]) : rstd;
            Vec<T, VEC> dv[U], xv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u < count) {
                    dv[u] = load_vec<T, VEC>(dyg + off + u * stride);
                    xv[u] = load_vec<T, VEC>(xg + off + u * stride);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u >= count) continue;
                float fd[VEC], fx[VEC];
                unpack(dv[u], fd);
                unpack(xv[u], fx);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int jj = CL ? j : 0;
                    fd[j] = fmaf(fd[j], a[jj], fmaf(bcoef, fx[j] - mean, ccoef));
                }
                store_stream<T, VEC>(dxg + off + u * stride, pack<T, VEC>(fd));
            }
        }, [](int, int) {});
        __syncthreads();  // the next group reuses scratch and the partial-row reads are done
    }
}
