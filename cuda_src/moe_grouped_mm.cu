// Grouped matrix products over expert groups on tensor cores (mma.sync m16n8k16, sm_80 and
// later), float32 accumulators, one rounding to the output's dtype.
//
// One template computes C(m, n) = sum_k A(m, k) B(n, k) for the three products of an MoE layer:
//   forward   (A_KC, B_KC, groups of rows):  out[rows of e] = a[rows of e] @ b[e]^T
//   d a       (A_KC, !B_KC, groups of rows): da[rows of e]  = dout[rows of e] @ b[e]
//   d b       (!A_KC, !B_KC, groups of k):   db[e]          = dout[rows of e]^T @ a[rows of e]
// A_KC: A(m, k) = A[m * lda + k] (k contiguous), else A[k * lda + m]; the same for B with n.
// Tiles are BM x BN x BK, 8 warps of 64 x 32, a STAGES-deep cp.async pipeline, 16-byte chunks in
// shared memory XOR-swizzled by row so that ldmatrix (plain or transposed) meets no bank conflict.
//
// Groups of rows: expert e's rows are offsets[e]:offsets[e + 1] (moe_permute's offsets, on the
// device: no host synchronization). The grid covers an upper bound of the row tiles (rows / BM +
// experts + 1); a block finds its expert by a warp's scan of the tile counts, and blocks past the
// last tile return. The rows after offsets[E] (moe_permute's pairs with a bad expert id) are a
// last group written with zeros, so every output row is written. Groups of k: one grid row an
// expert; an expert without rows gets a zero gradient. Offsets out of order or outside [0, rows]
// are recorded as a fault (kind 6, cukern/_faults.py) and clamped: no access leaves the arrays.
#include "common/dtype.cuh"
#include "common/fault.cuh"
#include "common/mma.cuh"
#include "common/moe_groups.cuh"

namespace cuk {
namespace moe_mm {

constexpr int BM = 128, BN = 128, BK = 32, STAGES = 3, THREADS = 256;

// Element offset of (r, c) in a tile of rows of COLS elements (32 or 128), its 16-byte chunks
// XORed by the row: the 8 rows an ldmatrix reads at one chunk fall in 8 different bank groups.
template <int COLS>
__device__ __forceinline__ int swz(int r, int c) {
    constexpr int CHUNKS = COLS / 8;
    const int x = CHUNKS == 4 ? ((r >> 1) & 3) : (r & 7);
    return r * COLS + ((((c >> 3) ^ x)) << 3) + (c & 7);
}

// One stage of a tile: rows [outer, outer + OUTER) of memory, each INNER contiguous elements
// from `inner`; chunks past outer_end or inner_end are zero-filled and read nothing.
template <typename T, int OUTER, int INNER>
__device__ __forceinline__ void load_tile(T* __restrict__ s, const T* __restrict__ g, long long ld, int outer,
                                          int outer_end, int inner, int inner_end, int tid) {
    constexpr int CHUNKS = OUTER * INNER / 8;
#pragma unroll
    for (int q = tid; q < CHUNKS; q += THREADS) {
        const int r = q / (INNER / 8), c = (q % (INNER / 8)) * 8;
        const bool valid = outer + r < outer_end && inner + c < inner_end;
        const T* src = valid ? g + static_cast<long long>(outer + r) * ld + inner + c : g;
        cp_async_16(s + swz<INNER>(r, c), src, valid);
    }
}

}  // namespace moe_mm
}  // namespace cuk

template <typename T, bool A_KC, bool B_KC, bool GROUP_K>
__global__ void __launch_bounds__(cuk::moe_mm::THREADS) moe_grouped_mm(
    const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, const int* __restrict__ offsets,
    int m_size, int n_size, int k_size, int experts, long long lda, long long ldb, long long ldc,
    long long b_expert_stride, long long c_expert_stride, long long* __restrict__ fault)
{
    using namespace cuk;
    using namespace cuk::moe_mm;
    using moe_groups::group_rows;
    __shared__ __align__(128) T sa[STAGES][BM * BK];
    __shared__ __align__(128) T sb[STAGES][BN * BK];
    int* s_found = reinterpret_cast<int*>(&sa[0][0]);   // (before the first load: 48 KiB is the static limit)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // This block's expert and its range of m (groups of rows) or k (groups of k).
    int expert, m_base, m_end, k_begin, k_end;
    bool zero = false;   // (the rows after the last expert: written with zeros)
    if (GROUP_K) {
        expert = blockIdx.y;
        m_base = (blockIdx.x % ((m_size + BM - 1) / BM)) * BM;
        m_end = m_size;
        group_rows(offsets, expert, experts, k_size, tid == 0 ? fault : nullptr, k_begin, k_end);
    } else {
        if (warp == 0) {
            int found, tile;
            moe_groups::find_row_tile<BM>(offsets, experts, m_size, blockIdx.x, fault, found, tile);
            if (lane == 0) { s_found[0] = found; s_found[1] = tile; }
        }
        __syncthreads();
        expert = s_found[0];
        const int tile = s_found[1];
        __syncthreads();   // (read by every thread before the loads overwrite it)
        if (expert < 0) return;   // (past the last tile)
        int lo, hi;
        group_rows(offsets, expert, experts, m_size, nullptr, lo, hi);
        m_base = lo + tile * BM;
        m_end = hi;
        k_begin = 0;
        k_end = k_size;
        zero = expert == experts;
    }
    const int n_base = (GROUP_K ? blockIdx.x / ((m_size + BM - 1) / BM) : blockIdx.y) * BN;
    if (GROUP_K) c += static_cast<long long>(expert) * c_expert_stride;
    else if (!zero) b += static_cast<long long>(expert) * b_expert_stride;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

    const int k_tiles = zero ? 0 : (k_end - k_begin + BK - 1) / BK;
    auto load = [&](int stage, int kt) {
        const int k0 = k_begin + kt * BK;
        if (A_KC) load_tile<T, BM, BK>(sa[stage], a, lda, m_base, m_end, k0, k_end, tid);
        else load_tile<T, BK, BM>(sa[stage], a, lda, k0, k_end, m_base, m_end, tid);
        if (B_KC) load_tile<T, BN, BK>(sb[stage], b, ldb, n_base, n_size, k0, k_end, tid);
        else load_tile<T, BK, BN>(sb[stage], b, ldb, k0, k_end, n_base, n_size, tid);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) load(s, s);
        cp_async_commit();
    }
    const int warp_m = (warp >> 2) * 64, warp_n = (warp & 3) * 32;
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < k_tiles) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_async_commit();
        const T* ta = sa[kt % STAGES];
        const T* tb = sb[kt % STAGES];
#pragma unroll
        for (int k0 = 0; k0 < BK; k0 += 16) {
            unsigned int fa[4][4], fb[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m0 = warp_m + i * 16;
                if (A_KC) ldmatrix_x4(fa[i], ta + swz<BK>(m0 + (lane & 15), k0 + (lane >> 4) * 8));
                else ldmatrix_x4_trans(fa[i], ta + swz<BM>(k0 + (lane & 7) + (lane >> 4) * 8,
                                                           m0 + ((lane >> 3) & 1) * 8));
            }
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                const int n0 = warp_n + jj * 16;
                unsigned int r[4];
                if (B_KC) ldmatrix_x4(r, tb + swz<BK>(n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
                else ldmatrix_x4_trans(r, tb + swz<BN>(k0 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                       n0 + (lane >> 4) * 8));
                fb[2 * jj][0] = r[0];
                fb[2 * jj][1] = r[1];
                fb[2 * jj + 1][0] = r[2];
                fb[2 * jj + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_16816<T>(acc[i][j], fa[i], fb[j][0], fb[j][1]);
        }
    }
    cp_async_wait<0>();

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n_base + warp_n + j * 8 + 2 * t;
            if (n >= n_size) continue;   // (n_size is a multiple of 8: n + 1 is in range too)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m_base + warp_m + i * 16 + g + 8 * h;
                if (m >= m_end) continue;
                T* out = c + static_cast<long long>(m) * ldc + n;
                out[0] = from_float<T>(acc[i][j][2 * h]);
                out[1] = from_float<T>(acc[i][j][2 * h + 1]);
            }
        }
    }
}
