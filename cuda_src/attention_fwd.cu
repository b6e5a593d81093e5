// Fused attention forward (FlashAttention-2 work split) on tensor cores: mma.sync m16n8k16
// with float32 accumulators, ldmatrix from XOR-swizzled shared memory, cp.async double
// buffering of the key/value tiles, online softmax in float32 with exp2.
//
// One block computes BM = 16 * WARPS query rows of one (batch, head) against all keys: each
// warp owns 16 rows, keeps its Q fragments and its O accumulator (16 x D) in registers, and
// walks the key/value tiles of BN keys that the block stages in shared memory.
// Grouped-query attention: query head h reads key/value head h / (H / Hkv), no copies.
// Causal masking is aligned to the bottom right (query i sees keys j <= i + Sk - Sq, as
// FlashAttention >= 2.1); a row that sees no key gets zeros and lse = +inf.
//
// Layout: q (B, Sq, H, D), k and v (B, Sk, Hkv, D), out (B, Sq, H, D), each with element
// strides for batch, sequence and head and a unit stride over D; lse (B, H, Sq) float32.
// Sequence offsets and per-(batch, head) bounds are the only places that know the layout,
// so variable-length batches (cu_seqlens) and sliding windows change the prologue only.
#include "common/dtype.cuh"
#include "common/mma.cuh"

namespace attn {

// -inf without <cuda/std/limits> (no include paths under NVRTC).
#define ATTN_NEG_INF (-__int_as_float(0x7f800000))

// Element offset of (r, c) in a ROWS x D tile whose 16-byte chunks are XOR-permuted by row,
// so that ldmatrix's 8 row addresses of one column fall in 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
    return r * D + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

// cp.async of a ROWS x D tile: rows row0 .. row0+ROWS-1 of a (rows x D) matrix with the given
// row stride; rows at or past `nrows` are zero-filled.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* g, long long row_stride, int row0, int nrows) {
    constexpr int CPR = D / 8;  // 16-byte chunks a row
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * CPR; i += THREADS) {
        const int r = i / CPR, c = (i % CPR) * 8;
        const bool ok = row0 + r < nrows;
        cp_async_16(smem + swz<D>(r, c), ok ? g + static_cast<long long>(row0 + r) * row_stride + c : g, ok);
    }
}

__device__ __forceinline__ unsigned int pack_pair(float lo, float hi, cuk_bf16) { return pack2(lo, hi, cuk_bf16{}); }
__device__ __forceinline__ unsigned int pack_pair(float lo, float hi, cuk_half) { return pack2(lo, hi, cuk_half{}); }

}  // namespace attn

template <typename T, int D, int WARPS, int BN, bool CAUSAL>
__global__ void __launch_bounds__(WARPS * 32) attention_fwd(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_ss, long long q_sh,
    long long k_sb, long long k_ss, long long k_sh,
    long long v_sb, long long v_ss, long long v_sh,
    long long o_sb, long long o_ss, long long o_sh,
    int H, int Hkv, int Sq, int Sk, float scale_log2)
{
    using namespace attn;
    constexpr int BM = WARPS * 16;
    constexpr int THREADS = WARPS * 32;
    static_assert(D % 16 == 0 && BN % 16 == 0, "tile shapes");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BM * D;        // [2][BN][D]
    T* sV = sK + 2 * BN * D;    // [2][BN][D]

    // Causal blocks have different amounts of work: the longest (last) are started first.
    const int m_block = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int hk = h / (H / Hkv);
    const T* qg = q + b * q_sb + h * q_sh;
    const T* kg = k + b * k_sb + hk * k_sh;
    const T* vg = v + b * v_sb + hk * v_sh;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int m0 = m_block * BM;
    const int diag = Sk - Sq;   // query i sees keys j <= i + diag (causal)

    int n_blocks = (Sk + BN - 1) / BN;
    if (CAUSAL) {
        const int last_key = min(Sk - 1, m0 + BM - 1 + diag);
        n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / BN + 1);
    }

    load_tile<T, BM, D, THREADS>(sQ, qg, q_ss, m0, Sq);
    if (n_blocks > 0) {
        load_tile<T, BN, D, THREADS>(sK, kg, k_ss, 0, Sk);
        load_tile<T, BN, D, THREADS>(sV, vg, v_ss, 0, Sk);
    }
    cp_async_commit();

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float row_max[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, row_sum[2] = {0.f, 0.f};
    unsigned int qf[D / 16][4];

    for (int nb = 0; nb < n_blocks; ++nb) {
        const int buf = nb & 1;
        if (nb + 1 < n_blocks) {
            load_tile<T, BN, D, THREADS>(sK + (buf ^ 1) * BN * D, kg, k_ss, (nb + 1) * BN, Sk);
            load_tile<T, BN, D, THREADS>(sV + (buf ^ 1) * BN * D, vg, v_ss, (nb + 1) * BN, Sk);
        }
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just issued: Q and this block's K, V
        __syncthreads();
        if (nb == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(qf[kk], sQ + swz<D>(warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8, kk * 16 + (lane / 16) * 8));
        }

        // S = Q K^T for this warp's 16 rows and BN keys.
        float s[BN / 8][4];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        const T* sKb = sK + buf * BN * D;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < BN / 16; ++nt) {
                unsigned int r[4];
                ldmatrix_x4(r, sKb + swz<D>(nt * 16 + (lane % 8) + (lane / 16) * 8, kk * 16 + ((lane / 8) % 2) * 8));
                mma_16816<T>(s[2 * nt], qf[kk], r[0], r[1]);
                mma_16816<T>(s[2 * nt + 1], qf[kk], r[2], r[3]);
            }
        }

        // Scale into the log2 domain; mask keys past the end and, causal, past the diagonal.
        const int n0 = nb * BN;
        const bool edge = n0 + BN > Sk || (CAUSAL && n0 + BN - 1 > m0 + diag);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[j][e] * scale_log2;
                if (edge) {
                    const int key = n0 + j * 8 + 2 * t + (e & 1);
                    const int row = m0 + warp * 16 + g + (e >> 1) * 8;
                    if (key >= Sk || (CAUSAL && key > row + diag)) x = ATTN_NEG_INF;
                }
                s[j][e] = x;
            }
        }

        // Online softmax: rows g (e = 0, 1) and g + 8 (e = 2, 3); a row lives in a quad.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = ATTN_NEG_INF;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float new_max = fmaxf(row_max[r], mx);
            const float m_use = new_max == ATTN_NEG_INF ? 0.f : new_max;   // a row with no key yet
            const float alpha = exp2f(row_max[r] - m_use);
            row_max[r] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                s[j][2 * r] = exp2f(s[j][2 * r] - m_use);
                s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - m_use);
                sum += s[j][2 * r] + s[j][2 * r + 1];
            }
            row_sum[r] = row_sum[r] * alpha + sum;   // this thread's columns; the quad adds up at the end
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[i][2 * r] *= alpha;
                o[i][2 * r + 1] *= alpha;
            }
        }

        // O += P V: P from the S accumulators (C layout = A layout in pairs of n-tiles).
        const T* sVb = sV + buf * BN * D;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned int a[4] = {
                pack_pair(s[2 * kk][0], s[2 * kk][1], T{}), pack_pair(s[2 * kk][2], s[2 * kk][3], T{}),
                pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], T{}), pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], T{})};
#pragma unroll
            for (int dt = 0; dt < D / 16; ++dt) {
                unsigned int r[4];
                ldmatrix_x4_trans(r, sVb + swz<D>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dt * 16 + (lane / 16) * 8));
                mma_16816<T>(o[2 * dt], a, r[0], r[1]);
                mma_16816<T>(o[2 * dt + 1], a, r[2], r[3]);
            }
        }
        __syncthreads();  // the next iteration's loads overwrite the buffer read here
    }

    // Normalize, write O and the log-sum-exp.
    T* og = out + b * o_sb + h * o_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int row = m0 + warp * 16 + g + r * 8;
        if (row < Sq) {
            T* orow = og + static_cast<long long>(row) * o_ss;
#pragma unroll
            for (int i = 0; i < D / 8; ++i)
                *reinterpret_cast<unsigned int*>(orow + i * 8 + 2 * t) =
                    pack_pair(o[i][2 * r] * inv, o[i][2 * r + 1] * inv, T{});
            if (lse && t == 0)
                lse[(static_cast<long long>(b) * H + h) * Sq + row] =
                    sum > 0.f ? (row_max[r] + log2f(sum)) * 0.6931471805599453f : __int_as_float(0x7f800000);
        }
    }
}
