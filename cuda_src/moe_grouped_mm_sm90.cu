// Grouped matrix products over expert groups of rows on Hopper (sm_90a): TMA loads into a ring
// of shared-memory stages driven by a producer warpgroup, wgmma with both operands in shared
// memory, float32 accumulators, one rounding to the output's dtype. The two products whose
// groups are groups of rows (moe_grouped_mm.cu has all three on mma.sync):
//   forward (B_KMAJOR):  out[rows of e] = a[rows of e] @ b[e]^T,  b (E, N, K), k contiguous
//   d a     (!B_KMAJOR): da[rows of e]  = dout[rows of e] @ b[e], b (E, K', N'), the output's
//                        columns (N') contiguous: read MN-major, as attention reads V
// A block computes 128 rows x BN columns: two consumer warpgroups of 64 rows each, and a third
// warpgroup whose first thread issues the loads (64 columns of k a stage). The grid is (column
// tiles, an upper bound of the row tiles): blocks next to each other in launch order share a tile
// of rows and sweep one expert's weight, which stays in L2 while its row tiles pass.
//
// A's map covers (rows, K): the box of 128 rows may run into the next group's rows (their results
// are not stored) or past the last row (TMA reads zeros there). B's map covers (E, ., .) with
// boxes inside one expert, so k past the end of b[e] reads zeros and never another expert's
// weights. The rows after offsets[E] are a last group written with zeros. Offsets out of order
// are recorded as a fault (kind 6) and clamped, as in moe_grouped_mm.cu.
#include "common/hopper.cuh"
#include "common/moe_groups.cuh"

namespace cuk {
namespace moe_mm90 {
constexpr int BM = 128, BK = 64, CONSUMERS = 2, THREADS = (CONSUMERS + 1) * 128;
constexpr int A_BYTES = BM * BK * 2;   // a stage's rows: 128 rows x 128 bytes
constexpr int BOX = 64 * 128;          // B MN-major: a box of 64 rows of k x 64 columns
}  // namespace moe_mm90
}  // namespace cuk

template <typename T, bool B_KMAJOR, int BN, int STAGES, int SMEM>
__global__ void __launch_bounds__(cuk::moe_mm90::THREADS, 1) moe_grouped_mm_sm90(
    const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, T* __restrict__ c,
    const int* __restrict__ offsets, int m_size, int n_size, int k_size, int experts, long long ldc,
    long long* __restrict__ fault)
{
    static_assert(BN == 128 || BN == 256, "BN");
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

    if (warp == 0) {
        int found, tile;
        moe_groups::find_row_tile<BM>(offsets, experts, m_size, blockIdx.y, fault, found, tile);
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
    const int expert = s_found[0];
    if (expert < 0) return;   // (past the last tile: the whole block, before any load)
    int lo, hi;
    moe_groups::group_rows(offsets, expert, experts, m_size, nullptr, lo, hi);
    const int m_base = lo + s_found[1] * BM, n_base = blockIdx.x * BN;
    const bool zero = expert == experts;   // (the rows after the last expert)
    const int k_tiles = zero ? 0 : (k_size + BK - 1) / BK;

    auto load = [&](int i) {
        const int buf = i % STAGES, k0 = i * BK;
        unsigned char* const sa = ring + buf * STAGE_BYTES;
        unsigned char* const sb = sa + A_BYTES;
        mbarrier_arrive_expect_tx(&bar_full[buf], STAGE_BYTES);
        tma_load_2d(sa, &a_map, k0, m_base, &bar_full[buf]);
        if constexpr (B_KMAJOR) {
            tma_load_3d(sb, &b_map, k0, n_base, expert, &bar_full[buf]);
        } else {
#pragma unroll
            for (int j = 0; j < BN / 64; ++j) tma_load_3d(sb + j * BOX, &b_map, n_base + 64 * j, k0, expert, &bar_full[buf]);
        }
    };
    if (!ring_loads<true, STAGES, CONSUMERS>(k_tiles, bar_free, load)) return;   // (the producer is done)

    const int wg = warpgroup_index();
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    for (int i = 0; i < k_tiles; ++i) {
        const int buf = i % STAGES;
        mbarrier_wait(&bar_full[buf], (i / STAGES) & 1);
        unsigned char* const sa = ring + buf * STAGE_BYTES;
        const unsigned long long a_desc = wgmma_desc_sw128(sa + wg * 64 * 128);
        const unsigned long long b_desc = B_KMAJOR ? wgmma_desc_sw128(sa + A_BYTES)
                                                   : wgmma_desc_sw128_mn(sa + A_BYTES, BOX);
        wgmma_hold(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
            Wgmma<T, BN>::template ss<0, B_KMAJOR ? 0 : 1>(
                acc, wgmma_desc_advance(a_desc, ks * 32), wgmma_desc_advance(b_desc, B_KMAJOR ? ks * 32 : ks * 16 * 128), 1);
        wgmma_commit();
        // the product of the stage before is done: its buffer goes back to the producer
        wgmma_wait<1>();
        wgmma_hold(acc);
        if (i > 0) mbarrier_arrive(&bar_free[(i - 1) % STAGES]);
    }
    wgmma_wait<0>();
    wgmma_hold(acc);

    // The epilogue stages each warpgroup's 64 x BN tile in the ring (every load has been read:
    // both warpgroups' products are done at the barrier) and stores its rows of the group.
    named_barrier_sync(1, CONSUMERS * 128);
    const int row0 = m_base + wg * 64;
    const int nrows = max(0, min(64, hi - row0));
    store_tile_staged<T, BN, BOX>(acc, 1.f, 1.f, ring + wg * (64 * BN * 2), c + static_cast<long long>(row0) * ldc + n_base,
                                  ldc, nrows, 2 + wg);
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}
