// LayerNorm and RMSNorm over the last axis, forward and backward.
//
// Two kernel shapes per direction:
//  * norm_fwd / norm_bwd keep a whole row in registers: a group of G threads owns one row,
//    thread `lane` owns vectors i*G + lane (i < NV) of VEC elements, so every sweep i is one
//    coalesced access of the group. Rows are read once and written once: the byte floor.
//  * norm_fwd_loop / norm_bwd_loop stream a row of any width through a block in chunks,
//    re-reading it (mostly from L2) once per pass. They take the rows too wide for registers.
// All arithmetic is float32; inputs and outputs are T (float, cuk::half, cuk::bf16).
//
// Weight gradients are deterministic: each row group accumulates dweight/dbias for the rows
// it visits (a fixed set, given the grid) in float32 and writes one partial row; then
// sum_partial_rows (cuda_src/partial_sum.cu) sums the partial rows in a fixed order. No floating-point atomics.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/reduce.cuh"

// The weight a column applies: w, or w + offset in float32 (OFFSET: an instance of its own, so
// that the plain norms keep their code: a runtime 0 added cost 1-2% of the backward).
template <bool OFFSET>
__device__ __forceinline__ float weight_value(float w, float offset) {
    return OFFSET ? w + offset : w;
}

// a * b; ROUNDED: rounded on its own (__fmul_rn), never fused into an FMA with what follows.
template <bool ROUNDED>
__device__ __forceinline__ float times(float a, float b) {
    return ROUNDED ? __fmul_rn(a, b) : a * b;
}

// Casting modes (CAST, RMSNorm's, as Liger's casting_mode; float inputs are unaffected):
//   0 "gemma": float32 throughout, y rounded once (torch.nn.functional.rms_norm);
//   1 "llama": xhat = x * rstd rounded to T before the weight (Hugging Face's LlamaRMSNorm:
//     weight * hidden.to(dtype)); the backward rounds dy * weight to T as autograd would;
//   2 "none":  as "llama" with rstd rounded to T too (the norm computed in the input dtype).
// A value the casting modes round to T (xhat; dy * weight in the backward), or itself.
template <typename T, int CAST>
__device__ __forceinline__ float cast_round(float v) {
    if constexpr (CAST != 0) return cuk::round_to<T>(v);
    return v;
}

// An fp8 output vector of y * scale, y folded into the running amax `am` (max |y|).
template <typename TO, int VEC>
__device__ __forceinline__ cuk::Vec<TO, VEC> fp8_out(float (&o)[VEC], float scale, cuk::AmaxBits& am) {
    using namespace cuk;
    static_assert(VEC % 2 == 0 || VEC == 1, "odd vector");
    if constexpr (VEC == 1) {
        am.add2(o[0], o[0]);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; j += 2) am.add2(o[j], o[j + 1]);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] *= scale;
    return pack<TO, VEC>(o);
}

// The forward's output: rows row0 .. row0 + R - 1 of a row group (norm_fwd's xv, mean, rstd),
// HW / HB: with a weight / a bias (compile-time: the form of each element's arithmetic).
template <bool HW, bool HB, int VEC, int NV, int G, int R, bool OFFSET, int CAST, typename T, typename TO>
__device__ __forceinline__ void norm_fwd_write(const cuk::Vec<T, VEC> (&xv)[R][NV], const float (&mean)[R],
                                               const float (&rstd)[R], const T* __restrict__ w,
                                               const T* __restrict__ b, float w_offset, TO* __restrict__ y,
                                               long long row0, long long rows, int cols, int lane, float scale,
                                               cuk::AmaxBits& am) {
    using namespace cuk;
    constexpr bool FP8 = is_fp8<TO>::value;
    TO* yr[R];   // (this lane's first vector of each row: a vector i is i * G * VEC further)
#pragma unroll
    for (int r = 0; r < R; ++r) yr[r] = y + (row0 + r) * cols + lane * VEC;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int col = (i * G + lane) * VEC;
        if (col < cols) {
            // Whole vectors through unpack / pack: element by element, the compiler kept each
            // 16-bit value in a register of its own and spent 2-3 instructions a conversion.
            float wf[VEC], bf[VEC];
            if constexpr (HW) {
                unpack(load_vec<T, VEC>(w + col), wf);
#pragma unroll
                for (int j = 0; j < VEC; ++j) wf[j] = weight_value<OFFSET>(wf[j], w_offset);
            }
            if constexpr (HB) unpack(load_vec<T, VEC>(b + col), bf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (row0 + r < rows) {
                    float o[VEC];
                    unpack(xv[r][i], o);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        float v = cast_round<T, CAST>((o[j] - mean[r]) * rstd[r]);
                        if constexpr (HW) v *= wf[j];
                        if constexpr (HB) v += bf[j];
                        o[j] = v;
                    }
                    if constexpr (FP8) store_stream<TO, VEC>(yr[r] + i * G * VEC, fp8_out<TO, VEC>(o, scale, am));
                    else store_stream<TO, VEC>(yr[r] + i * G * VEC, pack<TO, VEC>(o));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward, row in registers.
//   x, res: input rows (res may be null) with their row strides (elements);
//   w, b:   weight and bias (each may be null; b ignored for RMS); OFFSET: the weight applied
//           is w + w_offset (Gemma's RMSNorm (1 + w), zero-centred gamma);
//   y:      output rows, contiguous, of TO: T, or fp8 (cuk::fp8e4m3 / fp8e5m2) of y * *y_scale,
//           with max |y| merged into *y_amax (when not null; zeroed before the launch);
//   h: x + res rounded to T (written when res is given);
//   mean_out / rstd_out: float32 per row (each may be null); CAST: the casting mode (above).
// With a residual, the norm is taken of h rounded to T, exactly as an unfused add then norm.
// Each group handles R rows at a time: all their loads are issued before the first use, and
// one group reduction serves all R rows (more bytes in flight, fewer barriers per row).
// The forward's register budget: below sm_89 the fp8 output is converted in integer code, which
// spills at the 64 registers of the fp8 table's 16 blocks an SM; two blocks fewer fit it.
__host__ __device__ constexpr int fwd_min_blocks(int minb, bool fp8)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    return fp8 && minb > 12 ? minb - 2 : minb;
#else
    return minb;
#endif
}

template <typename T, bool RMS, int VEC, int NV, int G, int THREADS, int R, int MINB, bool OFFSET, int CAST,
          typename TO>
__global__ void __launch_bounds__(THREADS, fwd_min_blocks(MINB, cuk::is_fp8<TO>::value)) norm_fwd(
    const T* __restrict__ x, long long x_stride,
    const T* __restrict__ res, long long res_stride,
    const T* __restrict__ w, const T* __restrict__ b,
    TO* __restrict__ y, T* __restrict__ h,
    float* __restrict__ mean_out, float* __restrict__ rstd_out,
    long long rows, int cols, float eps, float w_offset,
    const float* __restrict__ y_scale, float* __restrict__ y_amax)
{
    using namespace cuk;
    static_assert(THREADS % G == 0 && (G <= 32 || G == THREADS), "bad row group");
    constexpr bool FP8 = is_fp8<TO>::value;
    float scale = 1.f;
    if constexpr (FP8) scale = *y_scale;
    AmaxBits am;
    constexpr int RPB = THREADS / G * R;  // rows per block and iteration
    using Reduce = GroupReduce<G, 2 * R>;   // R or 2R sums a row group
    __shared__ typename Reduce::TempStorage scratch;
    const int lane = threadIdx.x % G;
    const int group = threadIdx.x / G;
    const float inv_cols = 1.f / static_cast<float>(cols);

    // The loop bound is uniform over the block: every thread takes part in the reductions.
    for (long long base = static_cast<long long>(blockIdx.x) * RPB; base < rows;
         base += static_cast<long long>(gridDim.x) * RPB) {
        const long long row0 = base + group * R;
        Vec<T, VEC> xv[R][NV];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long row = row0 + r;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int col = (i * G + lane) * VEC;
                if (row < rows && col < cols) xv[r][i] = load_stream<T, VEC>(x + row * x_stride + col);
            }
        }
        if (res) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const long long row = row0 + r;
#pragma unroll
                for (int i = 0; i < NV; ++i) {
                    const int col = (i * G + lane) * VEC;
                    if (row < rows && col < cols) {
                        float f[VEC], g[VEC];
                        unpack(xv[r][i], f);
                        unpack(load_stream<T, VEC>(res + row * res_stride + col), g);
#pragma unroll
                        for (int j = 0; j < VEC; ++j) f[j] += g[j];
                        xv[r][i] = pack<T, VEC>(f);
                        store_stream<T, VEC>(h + row * cols + col, xv[r][i]);
                    }
                }
            }
        }
        // One reduction a row. RMS: sum(x^2). LayerNorm: sum(x-K) and sum((x-K)^2) with the
        // shift K = the row's first element (of h when the residual is fused), so that the
        // variance E[(x-K)^2] - E[x-K]^2 loses nothing to a mean far from zero. Where K itself
        // lies far from the mean (an outlier in column 0), a second, exact pass follows.
        float mean[R], rstd[R], s[2 * R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long row = row0 + r;
            float k = 0.f;
            if (!RMS && row < rows) {
                k = to_float(x[row * x_stride]);
                if (res) k = to_float(from_float<T>(k + to_float(res[row * res_stride])));
            }
            mean[r] = k;
            s[2 * r] = s[2 * r + 1] = 0.f;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int col = (i * G + lane) * VEC;
                if (row < rows && col < cols) {
                    float f[VEC];
                    unpack(xv[r][i], f);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float d = f[j] - k;
                        s[2 * r] += d;
                        s[2 * r + 1] += d * d;
                    }
                }
            }
        }
        if (RMS) {
            float ss[R];
#pragma unroll
            for (int r = 0; r < R; ++r) ss[r] = s[2 * r + 1];
            Reduce::sum(ss, scratch);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                mean[r] = 0.f;
                rstd[r] = rsqrtf(ss[r] * inv_cols + eps);
                if (CAST == 2) rstd[r] = round_to<T>(rstd[r]);
            }
        } else {
            Reduce::sum(s, scratch);
            bool exact = false;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float m = s[2 * r] * inv_cols;
                const float var = fmaxf(s[2 * r + 1] * inv_cols - m * m, 0.f);
                mean[r] += m;
                rstd[r] = rsqrtf(var + eps);
                // The cancellation costs about log2((K-mean)^2/var) bits of the variance.
                exact |= m * m > 16.f * var;
            }
            // Every thread of a group holds the same sums (a butterfly adds the same pairs in
            // every lane, and addition commutes), so `exact` is uniform over a group already;
            // a warp of several groups takes the pass together (its reduction's shuffles).
            if (G >= 32 ? exact : __any_sync(0xffffffffu, exact)) {
                float q[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    q[r] = 0.f;
#pragma unroll
                    for (int i = 0; i < NV; ++i) {
                        const int col = (i * G + lane) * VEC;
                        if (row0 + r < rows && col < cols) {
                            float f[VEC];
                            unpack(xv[r][i], f);
#pragma unroll
                            for (int j = 0; j < VEC; ++j) {
                                const float d = f[j] - mean[r];
                                q[r] += d * d;
                            }
                        }
                    }
                }
                Reduce::sum(q, scratch);
#pragma unroll
                for (int r = 0; r < R; ++r) rstd[r] = rsqrtf(q[r] * inv_cols + eps);
            }
        }
        // (whether there is a weight and a bias: a branch a row group, not a predicate an element,
        // so that y = xhat w + b is one FFMA)
        const bool has_b = !RMS && b;
#define CUK_NORM_WRITE(HW, HB) \
    norm_fwd_write<HW, HB, VEC, NV, G, R, OFFSET, CAST>(xv, mean, rstd, w, b, w_offset, y, row0, rows, cols, lane, scale, am)
        if (w) {
            if (has_b) CUK_NORM_WRITE(true, true);
            else CUK_NORM_WRITE(true, false);
        } else {
            if (has_b) CUK_NORM_WRITE(false, true);
            else CUK_NORM_WRITE(false, false);
        }
#undef CUK_NORM_WRITE
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (row0 + r < rows) {
                    if (mean_out) mean_out[row0 + r] = mean[r];
                    if (rstd_out) rstd_out[row0 + r] = rstd[r];
                }
            }
        }
    }
    if constexpr (FP8) {
        if (y_amax) warp_amax(am.bits(), y_amax);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward, row in registers.
//   dy, x: upstream gradient and the forward's input (h when the residual add was fused);
//   mean (LayerNorm only), rstd: the forward's float32 statistics;
//   dres: gradient arriving at h from the residual stream (may be null), added to dx;
//   dx: contiguous output;
//   dw_part, db_part: [gridDim.x * THREADS / G, cols] float32 partial sums (each may be null).
// As in the forward, a group handles R rows at a time with one reduction for all of them.
template <typename T, bool RMS, int VEC, int NV, int G, int THREADS, int R, int MINB, bool OFFSET, int CAST>
__global__ void __launch_bounds__(THREADS, MINB) norm_bwd(
    const T* __restrict__ dy, long long dy_stride,
    const T* __restrict__ x, long long x_stride,
    const T* __restrict__ w,
    const float* __restrict__ mean, const float* __restrict__ rstd,
    const T* __restrict__ dres, long long dres_stride,
    T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part,
    long long rows, int cols, float w_offset)
{
    using namespace cuk;
    static_assert(THREADS % G == 0 && (G <= 32 || G == THREADS), "bad row group");
    constexpr int RPB = THREADS / G * R;
    using Reduce = GroupReduce<G, 2 * R>;   // two sums a row
    __shared__ typename Reduce::TempStorage scratch;
    const int lane = threadIdx.x % G;
    const int group = threadIdx.x / G;
    const float inv_cols = 1.f / static_cast<float>(cols);

    float dwa[NV][VEC], dba[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) dwa[i][j] = dba[i][j] = 0.f;
    }

    for (long long base = static_cast<long long>(blockIdx.x) * RPB; base < rows;
         base += static_cast<long long>(gridDim.x) * RPB) {
        const long long row0 = base + group * R;
        Vec<T, VEC> xv[R][NV], gv[R][NV];
        float mu[R], rs[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long row = row0 + r;
            mu[r] = (!RMS && row < rows) ? mean[row] : 0.f;
            rs[r] = row < rows ? rstd[row] : 0.f;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int col = (i * G + lane) * VEC;
                if (row < rows && col < cols) {
                    xv[r][i] = load_stream<T, VEC>(x + row * x_stride + col);
                    gv[r][i] = load_stream<T, VEC>(dy + row * dy_stride + col);
                }
            }
        }
        float s[2 * R];  // per row: sum(g), sum(g * xhat) with g = dy * w
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[2 * r] = s[2 * r + 1] = 0.f;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int col = (i * G + lane) * VEC;
                if (row0 + r < rows && col < cols) {
                    // (elements read from their 32-bit words: see norm_fwd)
                    Vec<T, VEC> wv = {};
                    if (w) wv = load_vec<T, VEC>(w + col);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float d = element(gv[r][i], j);
                        const float xh = (element(xv[r][i], j) - mu[r]) * rs[r];
                        const float g = w ? cast_round<T, CAST>(d * weight_value<OFFSET>(element(wv, j), w_offset)) : d;
                        s[2 * r] += g;
                        s[2 * r + 1] += g * xh;
                        dwa[i][j] += d * cast_round<T, CAST>(xh);
                        if (!RMS) dba[i][j] += d;
                    }
                }
            }
        }
        Reduce::sum(s, scratch);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int col = (i * G + lane) * VEC;
            if (col < cols) {
                Vec<T, VEC> wv = {};
                if (w) wv = load_vec<T, VEC>(w + col);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const long long row = row0 + r;
                    if (row < rows) {
                        // rstd * (g - mean(g) - xhat * mean(g * xhat)). RMS: rstd * g + xhat * kc.
                        // LayerNorm: rstd * ((g - mean(g)) + (x - mean) * kc), the difference first:
                        // a row of one element (g == mean(g), x == mean) then gives exactly 0, as
                        // PyTorch; rstd * g + (-rstd * mean(g)) left the rounding of rstd * g. For
                        // that, g = dy * w is rounded on its own (__fmul_rn): fused into g - mean(g)
                        // as an FMA, the product's rounding error would remain. No more operations
                        // an element than the two-FMA form.
                        const float ma = s[2 * r] * inv_cols;
                        const float kc = -rs[r] * (s[2 * r + 1] * inv_cols);
                        Vec<T, VEC> rv = {};
                        if (dres) rv = load_stream<T, VEC>(dres + row * dres_stride + col);
                        float o[VEC];
#pragma unroll
                        for (int j = 0; j < VEC; ++j) {
                            const float d = element(gv[r][i], j);
                            const float xm = element(xv[r][i], j) - mu[r];
                            const float xh = xm * rs[r];
                            const float g = w ? cast_round<T, CAST>(times<!RMS>(
                                                    d, weight_value<OFFSET>(element(wv, j), w_offset))) : d;
                            float v = RMS ? fmaf(rs[r], g, xh * kc) : rs[r] * fmaf(xm, kc, g - ma);
                            if (dres) v += element(rv, j);
                            o[j] = v;
                        }
                        store_stream<T, VEC>(dx + row * cols + col, pack<T, VEC>(o));
                    }
                }
            }
        }
    }

    const long long part = static_cast<long long>(blockIdx.x) * (THREADS / G) + group;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int col = (i * G + lane) * VEC;
        if (col < cols) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                if (dw_part) dw_part[part * cols + col + j] = dwa[i][j];
                if (!RMS && db_part) db_part[part * cols + col + j] = dba[i][j];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward for rows of any width: one block a row, the row streamed in chunks of THREADS*VEC.
// Same arguments as norm_fwd. With a residual, pass 1 writes h and later passes re-read it.
template <typename T, bool RMS, int VEC, int THREADS, bool OFFSET, int CAST, typename TO>
__global__ void __launch_bounds__(THREADS, 1) norm_fwd_loop(
    const T* __restrict__ x, long long x_stride,
    const T* __restrict__ res, long long res_stride,
    const T* __restrict__ w, const T* __restrict__ b,
    TO* y, T* h,
    float* __restrict__ mean_out, float* __restrict__ rstd_out,
    long long rows, int cols, float eps, float w_offset,
    const float* __restrict__ y_scale, float* __restrict__ y_amax)
{
    using namespace cuk;
    constexpr bool FP8 = is_fp8<TO>::value;
    float scale = 1.f;
    if constexpr (FP8) scale = *y_scale;
    AmaxBits am;
    using Reduce = GroupReduce<THREADS, 1>;
    __shared__ typename Reduce::TempStorage scratch;
    __shared__ float first;   // LayerNorm: the row's first element (of h), from thread 0
    constexpr int CHUNK = THREADS * VEC;
    const float inv_cols = 1.f / static_cast<float>(cols);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        // Later passes read h (written by this thread in pass 1) or x: a plain, coherent load.
        const T* src = res ? static_cast<const T*>(h + row * cols) : x + row * x_stride;
        float s[1] = {0.f};
        for (int col = threadIdx.x * VEC; col < cols; col += CHUNK) {
            Vec<T, VEC> v = load_vec<T, VEC>(x + row * x_stride + col);
            if (res) {
                const Vec<T, VEC> rv = load_vec<T, VEC>(res + row * res_stride + col);
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    v.v[j] = from_float<T>(to_float(v.v[j]) + to_float(rv.v[j]));
                store_vec<T, VEC>(h + row * cols + col, v);
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float f = to_float(v.v[j]);
                s[0] += RMS ? f * f : f;
            }
        }
        if (!RMS && threadIdx.x == 0) first = to_float(src[0]);   // (a line this thread just read)
        Reduce::sum(s, scratch);   // (its barriers publish `first`)
        float mean = 0.f, rstd;
        if (RMS) {
            rstd = rsqrtf(s[0] * inv_cols + eps);
            if (CAST == 2) rstd = round_to<T>(rstd);
        } else {
            mean = s[0] * inv_cols;
            const unsigned int kb = __float_as_uint(first);
            unsigned int other = 0u;   // the bits in which elements differ from the first
            float q[1] = {0.f};
            for (int col = threadIdx.x * VEC; col < cols; col += CHUNK) {
                const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(src + col);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float f = to_float(v.v[j]);
                    const float d = f - mean;
                    q[0] += d * d;
                    other |= __float_as_uint(f) ^ kb;
                }
            }
            Reduce::sum(q, scratch);
            rstd = rsqrtf(q[0] * inv_cols + eps);
            // A row of equal elements: its mean and variance exactly (sum(x) / D rounds), as
            // norm_fwd's shifted sums give them, so x_hat = 0 and y = b. Other rows keep these
            // statistics: shifting this kernel's sums by the first element instead was slower
            // on wide rows (docs/notes-norm.md). (kb, not `first`: thread 0 may be writing the
            // next row's once past the barrier.)
            if (!__syncthreads_or(other != 0u)) {
                mean = __uint_as_float(kb);
                rstd = rsqrtf(eps);
            }
        }
        for (int col = threadIdx.x * VEC; col < cols; col += CHUNK) {
            const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(src + col);
            Vec<T, VEC> wv = {}, bv = {};
            Vec<TO, VEC> out;
            if (w) wv = load_vec<T, VEC>(w + col);
            if (!RMS && b) bv = load_vec<T, VEC>(b + col);
            float o[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float f = cast_round<T, CAST>((to_float(v.v[j]) - mean) * rstd);
                if (w) f *= weight_value<OFFSET>(to_float(wv.v[j]), w_offset);
                if (!RMS && b) f += to_float(bv.v[j]);
                if constexpr (FP8) o[j] = f;
                else out.v[j] = from_float<TO>(f);
            }
            if constexpr (FP8) out = fp8_out<TO, VEC>(o, scale, am);
            store_vec<TO, VEC>(y + row * cols + col, out);
        }
        if (threadIdx.x == 0) {
            if (mean_out) mean_out[row] = mean;
            if (rstd_out) rstd_out[row] = rstd;
        }
    }
    if constexpr (FP8) {
        if (y_amax) warp_amax(am.bits(), y_amax);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward for rows of any width: one block a row; the block's partial weight-gradient row
// (dw_part[blockIdx.x], db_part[blockIdx.x]) is accumulated in global memory. Each thread
// always touches the same columns, so the read-modify-writes need no synchronisation.
template <typename T, bool RMS, int VEC, int THREADS, bool OFFSET, int CAST>
__global__ void __launch_bounds__(THREADS, 1) norm_bwd_loop(
    const T* __restrict__ dy, long long dy_stride,
    const T* __restrict__ x, long long x_stride,
    const T* __restrict__ w,
    const float* __restrict__ mean, const float* __restrict__ rstd,
    const T* __restrict__ dres, long long dres_stride,
    T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part,
    long long rows, int cols, float w_offset)
{
    using namespace cuk;
    using Reduce = GroupReduce<THREADS, 2>;
    __shared__ typename Reduce::TempStorage scratch;
    constexpr int CHUNK = THREADS * VEC;
    const float inv_cols = 1.f / static_cast<float>(cols);
    float* dwp = dw_part ? dw_part + static_cast<long long>(blockIdx.x) * cols : nullptr;
    float* dbp = db_part ? db_part + static_cast<long long>(blockIdx.x) * cols : nullptr;
    for (int col = threadIdx.x * VEC; col < cols; col += CHUNK) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (dwp) dwp[col + j] = 0.f;
            if (dbp) dbp[col + j] = 0.f;
        }
    }
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float mu = RMS ? 0.f : mean[row];
        const float rs = rstd[row];
        const T* xr = x + row * x_stride;
        const T* dyr = dy + row * dy_stride;
        float s[2] = {0.f, 0.f};
        for (int col = threadIdx.x * VEC; col < cols; col += CHUNK) {
            const Vec<T, VEC> xv = load_vec<T, VEC>(xr + col);
            const Vec<T, VEC> dv = load_vec<T, VEC>(dyr + col);
            Vec<T, VEC> wv = {};
            if (w) wv = load_vec<T, VEC>(w + col);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float d = to_float(dv.v[j]);
                const float g = w ? cast_round<T, CAST>(d * weight_value<OFFSET>(to_float(wv.v[j]), w_offset)) : d;
                s[0] += g;
                s[1] += g * (to_float(xv.v[j]) - mu) * rs;
            }
        }
        Reduce::sum(s, scratch);
        const float a = RMS ? 0.f : s[0] * inv_cols;
        const float c = s[1] * inv_cols;
        for (int col = threadIdx.x * VEC; col < cols; col += CHUNK) {
            const Vec<T, VEC> xv = load_vec<T, VEC>(xr + col);
            const Vec<T, VEC> dv = load_vec<T, VEC>(dyr + col);
            Vec<T, VEC> wv = {}, rv = {}, out;
            if (w) wv = load_vec<T, VEC>(w + col);
            if (dres) rv = load_vec<T, VEC>(dres + row * dres_stride + col);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float d = to_float(dv.v[j]);
                const float xh = (to_float(xv.v[j]) - mu) * rs;
                const float g = w ? cast_round<T, CAST>(d * weight_value<OFFSET>(to_float(wv.v[j]), w_offset)) : d;
                float v = rs * (g - a - xh * c);
                if (dres) v += to_float(rv.v[j]);
                out.v[j] = from_float<T>(v);
                if (dwp) dwp[col + j] += d * cast_round<T, CAST>(xh);
                if (!RMS && dbp) dbp[col + j] += d;
            }
            store_vec<T, VEC>(dx + row * cols + col, out);
        }
    }
}
