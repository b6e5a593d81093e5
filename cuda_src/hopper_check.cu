// A self-check of the Hopper primitives of common/hopper.cuh, run by the tests before any
// kernel relies on them: one warpgroup computes C (64 x N, float32) = A (64 x 64·KB) ·
// B (N x 64·KB)^T, both operands brought into shared memory by TMA (128-byte swizzle, one box
// of 64 columns at a time, completing on one mbarrier) and multiplied by wgmma from shared-memory
// descriptors, a k16 step at a time. Built for sm_90a alone.
#include "common/hopper.cuh"

// SMEM: the dynamic shared memory the launch gives (checked against the tiles' size, with the
// 1024 bytes of slack that align them).
template <typename T, int N, int KB, int SMEM>
__global__ void __launch_bounds__(128, 1) hopper_tile_product(
    const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, float* __restrict__ c)
{
    constexpr int A_BYTES = 64 * 128, B_BYTES = N * 128;   // a box: rows x 64 16-bit columns
    static_assert(SMEM == KB * (A_BYTES + B_BYTES) + 1024, "SMEM: the tiles and their alignment slack");
    static_assert(N == 64 || N == 128 || N == 256, "N");
#if CUK_SM90A
    using namespace cuk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);
    unsigned char* a_tiles = smem;
    unsigned char* b_tiles = smem + KB * A_BYTES;
    __shared__ unsigned long long bar;
    mbarrier_init_block(&bar);
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&bar, KB * (A_BYTES + B_BYTES));
        for (int kb = 0; kb < KB; ++kb) {
            tma_load_2d(a_tiles + kb * A_BYTES, &a_map, kb * 64, 0, &bar);
            tma_load_2d(b_tiles + kb * B_BYTES, &b_map, kb * 64, 0, &bar);
        }
    }
    mbarrier_wait(&bar, 0);
    float d[N / 2];
    wgmma_zero_and_fence(d);
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            Wgmma<T, N>::ss(d, wgmma_desc_sw128(a_tiles + kb * A_BYTES + ks * 32),
                            wgmma_desc_sw128(b_tiles + kb * B_BYTES + ks * 32), 1);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(d);
    store_accumulators<N>(d, c);
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}

// C (64 x D, float32) = P (64 x KV) · V (KV x D), attention's O += P·V: P from registers (wgmma's
// A fragment, read here from global memory), V brought by TMA in its stored layout (KV rows of
// D, a box of 64 columns at a time) and read by wgmma MN-major (transposed B).
template <typename T, int D, int KV, int SMEM>
__global__ void __launch_bounds__(128, 1) hopper_tile_pv(
    const T* __restrict__ p, const __grid_constant__ CUtensorMap v_map, float* __restrict__ c)
{
    constexpr int BOX = KV * 128;   // KV rows x 64 16-bit columns
    static_assert(SMEM == (D / 64) * BOX + 1024, "SMEM: the boxes and their alignment slack");
    static_assert(D == 64 || D == 128 || D == 256, "D");
    static_assert(KV % 16 == 0 && KV <= 256, "KV");
#if CUK_SM90A
    using namespace cuk;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* v_tiles = align_1024(smem_raw);
    __shared__ unsigned long long bar;
    mbarrier_init_block(&bar);
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&bar, (D / 64) * BOX);
        for (int b = 0; b < D / 64; ++b) tma_load_2d(v_tiles + b * BOX, &v_map, b * 64, 0, &bar);
    }
    // P's A fragments, every k16 step's, before the fence (registers written by ordinary
    // instructions and then read by wgmma need the fence between)
    const int w = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int r = 16 * w + g;
    unsigned int a[KV / 16][4];
    const unsigned short* pb = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int s = 0; s < KV / 16; ++s) {
        const int c0 = 16 * s + 2 * t;
        auto pair = [&](int row, int col) {
            return static_cast<unsigned int>(pb[row * KV + col]) | (static_cast<unsigned int>(pb[row * KV + col + 1]) << 16);
        };
        a[s][0] = pair(r, c0);
        a[s][1] = pair(r + 8, c0);
        a[s][2] = pair(r, c0 + 8);
        a[s][3] = pair(r + 8, c0 + 8);
    }
    mbarrier_wait(&bar, 0);
    float d[D / 2];
    wgmma_hold(a);
    wgmma_zero_and_fence(d);
#pragma unroll
    for (int s = 0; s < KV / 16; ++s) {
        Wgmma<T, D>::template rs<1>(d, a[s], wgmma_desc_sw128_mn(v_tiles + s * 16 * 128, BOX), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(d);
    store_accumulators<D>(d, c);
#elif defined(__CUDA_ARCH__)
    __trap();   // (built without sm_90a's features: fail loudly, never return an unwritten output)
#endif
}
