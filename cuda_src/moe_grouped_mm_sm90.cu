// Grouped matrix products over expert groups on Hopper (sm_90a): TMA loads into a ring of
// shared-memory stages driven by a producer warpgroup, wgmma with both operands in shared memory,
// float32 accumulators, one rounding to the output's dtype. The three products of an MoE layer
// (moe_grouped_mm.cu has them on mma.sync too), PRODUCT:
//   0 forward:  out[rows of e] = a[rows of e] @ b[e]^T,  b (E, N, K), k contiguous (K-major B)
//   1 d a:      da[rows of e]  = dout[rows of e] @ b[e], b (E, K', N'), the output's columns
//               (N') contiguous: B read MN-major, as attention reads V
//   2 d b:      db[e] = dout[rows of e]^T @ a[rows of e]: both operands MN-major, summed over
//               the expert's rows (groups of k)
// A block computes 128 rows x BN columns of the output: two consumer warpgroups of 64 rows each,
// and a third warpgroup whose first thread issues the loads (64 of k a stage). Where BN does not
// divide the output's columns (a multiple of 64) the last column tile is partial: B's columns
// past the end read zeros (TMA) and are not stored.
//
// Groups of rows (0, 1): the grid is 1-D over (column tiles, an upper bound of the row tiles),
// walked in panels of PANEL column tiles: the blocks in flight share a few row tiles and a few
// column tiles of one expert's weight, so both stay in L2 (with an expert's whole weight swept
// per row tile, a 28672 x 4096 weight was read from memory once per row tile). A's map covers
// (rows, K): the box of 128 rows may run into the next group's rows (their results are not
// stored) or past the last row (TMA reads zeros there). B's map covers (E, ., .) with boxes
// inside one expert, so k past the end of b[e] reads zeros and never another expert's weights.
// The rows after offsets[E] are a last group written with zeros.
// Groups of k (2): one grid row an expert; the stage that holds the expert's last rows has the
// rows past them (the next expert's) zeroed in shared memory before the product reads them; an
// expert without rows gets zeros. Offsets out of order are recorded as a fault (kind 6) and
// clamped, as in moe_grouped_mm.cu.
#include "common/hopper.cuh"
#include "common/moe_groups.cuh"

namespace cuk {
namespace moe_mm90 {
constexpr int BM = 128, BK = 64, CONSUMERS = 2, THREADS = (CONSUMERS + 1) * 128;
constexpr int A_BYTES = BM * BK * 2;   // a stage's rows: 128 rows x 128 bytes
constexpr int BOX = 64 * 128;          // an MN-major operand: a box of 64 rows of k x 64 columns
constexpr int PANEL = 8;               // groups of rows: column tiles a panel of the grid's walk
}  // namespace moe_mm90
}  // namespace cuk

template <typename T, int PRODUCT, int BN, int STAGES, int SMEM>
__global__ void __launch_bounds__(cuk::moe_mm90::THREADS, 1) moe_grouped_mm_sm90(
    const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, T* __restrict__ c,
    const int* __restrict__ offsets, int m_size, int n_size, int k_size, int experts, int m_tiles, long long ldc,
    long long c_expert_stride, long long* __restrict__ fault)
{
    static_assert(BN == 128 || BN == 256, "BN");
    static_assert(PRODUCT >= 0 && PRODUCT <= 2, "PRODUCT");
    constexpr bool GROUP_K = PRODUCT == 2, B_KMAJOR = PRODUCT == 0;
    constexpr int B_BYTES = BN * cuk::moe_mm90::BK * 2;
    constexpr int STAGE_BYTES = cuk::moe_mm90::A_BYTES + B_BYTES;
    static_assert(STAGES * STAGE_BYTES + 1024 <= SMEM, "SMEM");
    static_assert(cuk::moe_mm90::CONSUMERS * 64 * BN * 2 <= STAGES * STAGE_BYTES, "the epilogue's staging");
#if CUK_SM90A
    using namespace cuk;
    using namespace cuk::moe_mm90;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* const ring = align_1024(smem_raw);   // [STAGES][A tile, B tile]
    __shared__ unsigned long long bar_full[STAGES], bar_free[STAGES];
    __shared__ int s_found[2];
    const int tid = threadIdx.x, warp = tid >> 5;

    // This block's tile: m_tile, n_tile of the output, and its expert
    const int n_tiles = (n_size + BN - 1) / BN;   // (the last one partial where BN does not divide n)
    int m_tile, n_tile;
    if (GROUP_K) {
        m_tile = blockIdx.x / n_tiles;
        n_tile = blockIdx.x - m_tile * n_tiles;
    } else {
        const int panel = blockIdx.x / (PANEL * m_tiles);
        const int r = blockIdx.x - panel * PANEL * m_tiles;
        const int width = min(PANEL, n_tiles - panel * PANEL);
        m_tile = r / width;
        n_tile = panel * PANEL + (r - m_tile * width);
    }
    if (!GROUP_K && warp == 0) {
        int found, tile;
        moe_groups::find_row_tile<BM>(offsets, experts, m_size, m_tile, fault, found, tile);
        if ((tid & 31) == 0) { s_found[0] = found; s_found[1] = tile; }
    }
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&bar_full[i], 1);
            mbarrier_init(&bar_free[i], CONSUMERS * 128);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    const int expert = GROUP_K ? static_cast<int>(blockIdx.y) : s_found[0];
    if (expert < 0) return;   // (past the last tile: the whole block, before any load)
    // GROUP_K: the expert's rows [lo, hi) are the sum's k; else the tile's rows end at hi
    int lo, hi;
    moe_groups::group_rows(offsets, expert, experts, GROUP_K ? k_size : m_size,
                           GROUP_K && tid == 0 ? fault : nullptr, lo, hi);
    const int m_base = GROUP_K ? m_tile * BM : lo + s_found[1] * BM, n_base = n_tile * BN;
    const int row_end = GROUP_K ? m_size : hi;
    const bool zero = !GROUP_K && expert == experts;   // (the rows after the last expert)
    const int k_tiles = zero ? 0 : GROUP_K ? (hi - lo + BK - 1) / BK : (k_size + BK - 1) / BK;

    auto load = [&](int i) {
        const int buf = i % STAGES, k0 = i * BK;
        unsigned char* const sa = ring + buf * STAGE_BYTES;
        unsigned char* const sb = sa + A_BYTES;
        mbarrier_arrive_expect_tx(&bar_full[buf], STAGE_BYTES);
        if constexpr (GROUP_K) {
#pragma unroll
            for (int j = 0; j < BM / 64; ++j) tma_load_2d(sa + j * BOX, &a_map, m_base + 64 * j, lo + k0, &bar_full[buf]);
#pragma unroll
            for (int j = 0; j < BN / 64; ++j) tma_load_2d(sb + j * BOX, &b_map, n_base + 64 * j, lo + k0, &bar_full[buf]);
        } else {
            tma_load_2d(sa, &a_map, k0, m_base, &bar_full[buf]);
            if constexpr (B_KMAJOR) {
                tma_load_3d(sb, &b_map, k0, n_base, expert, &bar_full[buf]);
            } else {
#pragma unroll
                for (int j = 0; j < BN / 64; ++j)
                    tma_load_3d(sb + j * BOX, &b_map, n_base + 64 * j, k0, expert, &bar_full[buf]);
            }
        }
    };
    if (!ring_loads<true, STAGES, CONSUMERS>(k_tiles, bar_free, load)) return;   // (the producer is done)

    const int wg = warpgroup_index();
    // GROUP_K: the first stage's products overwrite acc (scale_d 0) and an expert without rows
    // zeroes it after the loop: zeroed ahead of the loop beside the last stage's zeroing of
    // rows, ptxas serialized the wgmma (C7515)
    float acc[BN / 2];
    if constexpr (!GROUP_K) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    }
    for (int i = 0; i < k_tiles; ++i) {
        const int buf = i % STAGES;
        mbarrier_wait(&bar_full[buf], (i / STAGES) & 1);
        unsigned char* const sa = ring + buf * STAGE_BYTES;
        if (GROUP_K && hi - lo - i * BK < BK) {
            // the expert's last rows: the rows after them (the next expert's) zeroed in both tiles
            const int first = hi - lo - i * BK;
            zero_tile_rows(sa, sa + A_BYTES, BM / 64, BOX, first, BK, 2 + wg);
            if (BN == 256) zero_tile_rows(sa + A_BYTES + 2 * BOX, sa + A_BYTES + 3 * BOX, 1, BOX, first, BK, 2 + wg);
        }
        const unsigned long long a_desc = GROUP_K ? wgmma_desc_sw128_mn(sa + wg * BOX, BOX)
                                                  : wgmma_desc_sw128(sa + wg * 64 * 128);
        const unsigned long long b_desc = B_KMAJOR ? wgmma_desc_sw128(sa + A_BYTES)
                                                   : wgmma_desc_sw128_mn(sa + A_BYTES, BOX);
        wgmma_hold(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
            Wgmma<T, BN>::template ss<GROUP_K ? 1 : 0, B_KMAJOR ? 0 : 1>(
                acc, wgmma_desc_advance(a_desc, GROUP_K ? ks * 16 * 128 : ks * 32),
                wgmma_desc_advance(b_desc, B_KMAJOR ? ks * 32 : ks * 16 * 128), !GROUP_K || i > 0 || ks > 0);
        wgmma_commit();
        // the product of the stage before is done: its buffer goes back to the producer
        wgmma_wait<1>();
        wgmma_hold(acc);
        if (i > 0) mbarrier_arrive(&bar_free[(i - 1) % STAGES]);
    }
    wgmma_wait<0>();
    wgmma_hold(acc);
    if (GROUP_K && k_tiles == 0) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    }

    // The epilogue stages each warpgroup's 64 x BN tile in the ring (every load has been read:
    // both warpgroups' products are done at the barrier) and stores its rows.
    named_barrier_sync(1, CONSUMERS * 128);
    const int row0 = m_base + wg * 64;
    const int nrows = max(0, min(64, row_end - row0));
    T* const out = c + (GROUP_K ? static_cast<long long>(expert) * c_expert_stride : 0ll) +
                   static_cast<long long>(row0) * ldc + n_base;
    store_tile_staged<T, BN, BOX>(acc, 1.f, 1.f, ring + wg * (64 * BN * 2), out, ldc, nrows, 2 + wg,
                                  min(BN, n_size - n_base));
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}
