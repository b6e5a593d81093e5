// Hopper (sm_90a) warpgroup matrix products (wgmma.mma_async) as inline PTX, with both operands
// from shared memory through matrix descriptors, or A from registers; the accumulators' layout,
// their staging and stores.
//
// Shared-memory layout the descriptors assume: a K-major tile of R rows x 64 16-bit elements
// (128 bytes a row), written by TMA with 128-byte swizzle, 1024-byte aligned: 8-row groups of
// 1024 bytes (the descriptor's stride byte offset); a k16 step inside the 64 columns advances
// the start address by 32 bytes (the swizzle is a function of the address bits, so the
// hardware finds the same 16-byte chunks TMA stored).
//
// Accumulators of m64nNk16 (float32, N/2 a thread; warp w of the warpgroup, g = lane / 4,
// t = lane % 4): d[4j + 0, 1] = (row 16w + g, columns 8j + 2t, +1), d[4j + 2, 3] = (row 16w + g + 8,
// the same columns), j = 0 .. N/8 - 1: mma.sync's C fragment repeated along N.
#pragma once
#include "sm90_tma.cuh"

namespace cuk {

// ---- wgmma ---------------------------------------------------------------------------------
// The float32 accumulators of one m64nNk16 product (N/2 a thread, the layout above) into C, a
// row-major 64 x N array (tests and checks; kernels write their own epilogues).
template <int N>
__device__ __forceinline__ void store_accumulators(const float (&d)[N / 2], float* c) {
    const int w = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int r = 16 * w + g;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int col = 8 * j + 2 * t;
        c[r * N + col] = d[4 * j];
        c[r * N + col + 1] = d[4 * j + 1];
        c[(r + 8) * N + col] = d[4 * j + 2];
        c[(r + 8) * N + col + 1] = d[4 * j + 3];
    }
}

// A warpgroup's 64 x D float32 accumulator tile (the layout above) as T, row g of each 16 scaled by
// s0 and row g + 8 by s1, into rows 0 .. 63 of `g` (those below `nrows`; row stride `stride`
// elements, rows 16-byte aligned), by way of shared memory. Stored straight from the
// accumulators, a warp instruction writes 8 rows x 16 bytes (half sectors, and D / 4 instructions
// a thread); staged, it writes whole rows, 16 bytes a thread (a quarter of the instructions,
// every sector full). `stage`: D / 64 pieces of 64 rows x 128 bytes, BOX bytes apart, 1024-byte
// aligned, that no other thread touches meanwhile (chunks XOR-swizzled by row: conflict-free);
// `bar`: a named barrier id for this warpgroup's 128 threads.
// (stage_tile alone: the tile packed into `stage`, fenced for the async proxy (a TMA store reads it
// next) and published to the warpgroup by its barrier.)
template <typename T, int D, int BOX>
__device__ __forceinline__ void stage_tile(const float (&acc)[D / 2], float s0, float s1, unsigned char* stage, int bar,
                                           bool for_tma = false) {
    static_assert(D % 64 == 0 && D <= 256, "D");
    const int tid = threadIdx.x % 128, warp = tid / 32, lg = (tid % 32) / 4, lt = tid % 4;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float s = r ? s1 : s0;
            const int row = 16 * warp + lg + 8 * r;   // (row & 7 == lg)
            *reinterpret_cast<unsigned int*>(stage + (j / 8) * BOX + row * 128 + (((j % 8) ^ lg) << 4) + 4 * lt) =
                pack2(acc[4 * j + 2 * r] * s, acc[4 * j + 2 * r + 1] * s, T{});
        }
    if (for_tma) fence_proxy_async();
    named_barrier_sync(bar, 128);
}
// RowOf: the row of `g` that accumulator row r (0 .. 63) goes to (as laid out, by default).
struct SameRow {
    __host__ __device__ constexpr int operator()(int r) const { return r; }
};
template <typename T, int D, int BOX, typename RowOf = SameRow>
__device__ __forceinline__ void store_tile_staged(const float (&acc)[D / 2], float s0, float s1, unsigned char* stage,
                                                  T* g, long long stride, int nrows, int bar, int ncols = D,
                                                  RowOf row_of = RowOf{}) {
    stage_tile<T, D, BOX>(acc, s0, s1, stage, bar);
    const int tid = threadIdx.x % 128;
    constexpr int CPR = D / 8, RSTEP = 128 / CPR;   // 16-byte chunks a row; rows a pass
    const int c = tid % CPR;
#pragma unroll
    for (int i = 0; i < 64 / RSTEP; ++i) {
        const int row = i * RSTEP + tid / CPR;
        const uint4 v = *reinterpret_cast<const uint4*>(stage + (c / 8) * BOX + row * 128 + (((c % 8) ^ (row & 7)) << 4));
        const int to = row_of(row);
        if (to < nrows && 8 * c < ncols) *reinterpret_cast<uint4*>(g + static_cast<long long>(to) * stride + 8 * c) = v;
    }
}

// The descriptor of a K-major, 128-byte-swizzled tile at `smem` (1024-byte aligned; a k16 step
// adds 32 bytes to the address): start >> 4 (bits 0-13), leading byte offset 1 (16 bytes,
// unused by swizzled K-major tiles; bits 16-29), stride byte offset 1024 >> 4 (bits 32-45),
// swizzle mode 1 = 128 bytes (bits 62-63).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* smem) {
    const unsigned long long addr = shared_address(smem);
    return ((addr & 0x3FFFFull) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
// The descriptor of a 128-byte-swizzled MN-major tile (B stored as K rows of N 16-bit values,
// 128 bytes of N a row): swizzle atoms of 8 K rows x 64 N values (1024 bytes); `mn_atom_bytes`
// apart along N (leading byte offset: the next box of 64 columns), 1024 bytes apart along K
// (stride byte offset: the next 8 rows). A k16 step advances the start by 16 rows (2048 bytes).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128_mn(const void* smem, unsigned int mn_atom_bytes) {
    const unsigned long long addr = shared_address(smem);
    return ((addr & 0x3FFFFull) >> 4) | ((static_cast<unsigned long long>(mn_atom_bytes >> 4) & 0x3FFF) << 16) |
           ((1024ull >> 4) << 32) | (1ull << 62);
}
// `desc` moved on by `bytes` (a multiple of 16) in shared memory: only the start address field
// (bits 0-13, 16-byte units) changes, and it never carries out of the low word (shared addresses
// are below 2^18). A base descriptor made once and moved on a k16 step at a time costs one add a
// wgmma; made from the address each time it costs a mask, a shift and an or in ordinary registers
// and two moves to uniform ones, in the chain ahead of every wgmma.
__device__ __forceinline__ unsigned long long wgmma_desc_advance(unsigned long long desc, unsigned int bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | static_cast<unsigned int>(static_cast<unsigned int>(desc) + (bytes >> 4));
}
// This thread's warpgroup, as a value the compiler knows is the same across the warp (a
// shuffle from lane 0), so that addresses and descriptors made from it stay in uniform registers.
__device__ __forceinline__ int warpgroup_index() {
    return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}
__device__ __forceinline__ void wgmma_fence() {
#if CUK_SM90A
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if CUK_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
#if CUK_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory");
#endif
}
// The compiler's view of registers wgmma reads or writes, pinned where this is called: before
// wgmma_fence (ordinary writes to accumulators or A fragments may not sink past the fence, as
// the fence must come between them and the wgmma) and after wgmma_wait (reads may not rise
// above it).
template <int R>
__device__ __forceinline__ void wgmma_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// Keeps the instructions that `v` depends on ahead of the next wgmma_wait: ptxas hoists a wait
// above any arithmetic (waiting early is always safe) but not above a shared-memory store, so
// `v` is stored to this thread's slot of `sink` (never read). The intra-warpgroup overlap needs
// it: without it the wait for P V lands before the softmax's exponentials.
__device__ __forceinline__ void keep_before_wait(unsigned int* sink, unsigned int v) {
    asm volatile("st.shared.u32 [%0], %1;" :: "r"(shared_address(sink + threadIdx.x)), "r"(v) : "memory");
}
// Every word of `a` folded into one (exclusive or): a keep_before_wait value that keeps all of
// them ahead of the wait.
template <int R, int C>
__device__ __forceinline__ unsigned int fold_bits(const unsigned int (&a)[R][C]) {
    unsigned int v = 0;
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) v ^= a[i][j];
    return v;
}
template <int R, int C>
__device__ __forceinline__ void copy_fragments(const unsigned int (&from)[R][C], unsigned int (&to)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) to[i][j] = from[i][j];
}
// Accumulators zeroed and fenced: the start of a batch of wgmma that begins a new product.
template <int R>
__device__ __forceinline__ void wgmma_zero_and_fence(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) d[i] = 0.f;
    wgmma_hold(d);
    wgmma_fence();
}
template <int R, int C>
__device__ __forceinline__ void wgmma_hold(unsigned int (&a)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) asm volatile("" : "+r"(a[i][j]) :: "memory");
}

// D (64 x N, float32) += A (64 x 16) * B (N x 16)^T. ss: both K-major in shared memory
// (descriptors). rs<TB>: A from registers (a warp's 16 rows as mma.sync's m16k16 A fragment,
// 4 registers of two 16-bit values: (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)), B from
// shared memory, K-major (TB = 0) or MN-major (TB = 1: B stored K rows of N, as V is). ss<TA, TB>:
// TA = 1 reads A MN-major (stored K rows of 64 M values: a transposed tile, as dS^T for dQ = dS K;
// its descriptor is wgmma_desc_sw128_mn's). scale_d = 0 overwrites D. T: cuk::bf16 or cuk::half.
template <typename T, int N> struct Wgmma;
// The specializations below come from one definition, CUK_WGMMA(T, PTX type, N): the PTX of an
// m64nNk16 product spells out its N/2 accumulator registers, so their lists (CUK_WGMMA_REGS_*,
// "%0, ..., %R-1"; CUK_WGMMA_D_*, the operands d[0] .. d[R-1]) and the operand numbers after them
// are written once for each register count R = N / 2.
#define CUK_WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
    "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CUK_WGMMA_REGS_16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define CUK_WGMMA_D_16 CUK_WGMMA_D8(0), CUK_WGMMA_D8(8)
#define CUK_WGMMA_SS_OPERANDS_16 "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
#define CUK_WGMMA_SS_PREDICATE_16 "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
#define CUK_WGMMA_RS_OPERANDS_16 "}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
#define CUK_WGMMA_RS_PREDICATE_16 "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
#define CUK_WGMMA_REGS_24 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "," "%16, %17, %18, %19, %20, %21, %22, %23"
#define CUK_WGMMA_D_24 CUK_WGMMA_D8(0), CUK_WGMMA_D8(8), CUK_WGMMA_D8(16)
#define CUK_WGMMA_SS_OPERANDS_24 "}, %24, %25, p, 1, 1, %27, %28;\n}\n"
#define CUK_WGMMA_SS_PREDICATE_24 "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
#define CUK_WGMMA_RS_OPERANDS_24 "}, {%24, %25, %26, %27}, %28, p, 1, 1, %30;\n}\n"
#define CUK_WGMMA_RS_PREDICATE_24 "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
#define CUK_WGMMA_REGS_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUK_WGMMA_D_32 CUK_WGMMA_D8(0), CUK_WGMMA_D8(8), CUK_WGMMA_D8(16), CUK_WGMMA_D8(24)
#define CUK_WGMMA_SS_OPERANDS_32 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
#define CUK_WGMMA_SS_PREDICATE_32 "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
#define CUK_WGMMA_RS_OPERANDS_32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
#define CUK_WGMMA_RS_PREDICATE_32 "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
#define CUK_WGMMA_REGS_40 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "," "%32, %33, %34, %35, %36, %37, %38, %39"
#define CUK_WGMMA_D_40 CUK_WGMMA_D8(0), CUK_WGMMA_D8(8), CUK_WGMMA_D8(16), CUK_WGMMA_D8(24), CUK_WGMMA_D8(32)
#define CUK_WGMMA_SS_OPERANDS_40 "}, %40, %41, p, 1, 1, %43, %44;\n}\n"
#define CUK_WGMMA_SS_PREDICATE_40 "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
#define CUK_WGMMA_RS_OPERANDS_40 "}, {%40, %41, %42, %43}, %44, p, 1, 1, %46;\n}\n"
#define CUK_WGMMA_RS_PREDICATE_40 "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
#define CUK_WGMMA_REGS_64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "," "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
    "," "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUK_WGMMA_D_64 CUK_WGMMA_D8(0), CUK_WGMMA_D8(8), CUK_WGMMA_D8(16), CUK_WGMMA_D8(24), \
    CUK_WGMMA_D8(32), CUK_WGMMA_D8(40), CUK_WGMMA_D8(48), CUK_WGMMA_D8(56)
#define CUK_WGMMA_SS_OPERANDS_64 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
#define CUK_WGMMA_SS_PREDICATE_64 "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
#define CUK_WGMMA_RS_OPERANDS_64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
#define CUK_WGMMA_RS_PREDICATE_64 "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
#define CUK_WGMMA_REGS_128 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "," "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "," "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
    "," "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
    "," "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
    "," "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
    "," "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
    "," "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CUK_WGMMA_D_128 CUK_WGMMA_D8(0), CUK_WGMMA_D8(8), CUK_WGMMA_D8(16), CUK_WGMMA_D8(24), \
    CUK_WGMMA_D8(32), CUK_WGMMA_D8(40), CUK_WGMMA_D8(48), CUK_WGMMA_D8(56), \
    CUK_WGMMA_D8(64), CUK_WGMMA_D8(72), CUK_WGMMA_D8(80), CUK_WGMMA_D8(88), \
    CUK_WGMMA_D8(96), CUK_WGMMA_D8(104), CUK_WGMMA_D8(112), CUK_WGMMA_D8(120)
#define CUK_WGMMA_SS_OPERANDS_128 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
#define CUK_WGMMA_SS_PREDICATE_128 "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
#define CUK_WGMMA_RS_OPERANDS_128 "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
#define CUK_WGMMA_RS_PREDICATE_128 "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
#if CUK_SM90A
#define CUK_SM90A_ONLY(...) __VA_ARGS__
#else
#define CUK_SM90A_ONLY(...)
#endif
#define CUK_WGMMA(T, TYPES, N, R)                                                                          \
template <> struct Wgmma<T, N> {                                                                           \
    template <int TA = 0, int TB = 0>                                                                      \
    __device__ __forceinline__ static void ss(float (&d)[R], unsigned long long a, unsigned long long b,   \
                                              int scale_d) {                                               \
        CUK_SM90A_ONLY(asm volatile(                                                                       \
            CUK_WGMMA_SS_PREDICATE_##R "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPES " {"         \
            CUK_WGMMA_REGS_##R CUK_WGMMA_SS_OPERANDS_##R                                                   \
            : CUK_WGMMA_D_##R                                                                              \
            : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));)                                            \
    }                                                                                                      \
    template <int TB>                                                                                      \
    __device__ __forceinline__ static void rs(float (&d)[R], const unsigned int (&a)[4], unsigned long long b, \
                                              int scale_d) {                                               \
        CUK_SM90A_ONLY(asm volatile(                                                                       \
            CUK_WGMMA_RS_PREDICATE_##R "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPES " {"         \
            CUK_WGMMA_REGS_##R CUK_WGMMA_RS_OPERANDS_##R                                                   \
            : CUK_WGMMA_D_##R                                                                              \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB));)                 \
    }                                                                                                      \
};
CUK_WGMMA(bf16, "bf16.bf16", 32, 16)
CUK_WGMMA(half, "f16.f16", 32, 16)
CUK_WGMMA(bf16, "bf16.bf16", 48, 24)
CUK_WGMMA(half, "f16.f16", 48, 24)
CUK_WGMMA(bf16, "bf16.bf16", 80, 40)
CUK_WGMMA(half, "f16.f16", 80, 40)
CUK_WGMMA(bf16, "bf16.bf16", 64, 32)
CUK_WGMMA(half, "f16.f16", 64, 32)
CUK_WGMMA(bf16, "bf16.bf16", 128, 64)
CUK_WGMMA(half, "f16.f16", 128, 64)
CUK_WGMMA(bf16, "bf16.bf16", 256, 128)
CUK_WGMMA(half, "f16.f16", 256, 128)

// ---- products with A from the accumulators of an earlier one -------------------------------
// The float32 accumulators of a 64 x 16K product (the layout above) as K16 A fragments of rs
// (k16 step kk: columns 16kk .. 16kk + 15), rounded to T: P from S, dS from dP.
template <typename T, int K16>
__device__ __forceinline__ void accumulators_to_a(const float (&d)[8 * K16], unsigned int (&a)[K16][4]) {
#pragma unroll
    for (int kk = 0; kk < K16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[kk][i] = pack2(d[8 * kk + 2 * i], d[8 * kk + 2 * i + 1], T{});
}

// acc (64 x N) += A (64 x 16 K16, fragments in registers) * B, B read MN-major from `b_tile`
// (16 K16 rows of N, boxes of 64 columns `box_bytes` apart, as TMA stores V, dO or Q): one
// commit group. The fragments and accumulators are pinned before the fence (ordinary writes
// to them may not sink past it).
template <typename T, int N, int K16>
__device__ __forceinline__ void wgmma_rs_mn(float (&acc)[N / 2], unsigned int (&a)[K16][4], const unsigned char* b_tile,
                                            unsigned int box_bytes) {
    wgmma_hold(a);
    wgmma_hold(acc);
    wgmma_fence();
    const unsigned long long b = wgmma_desc_sw128_mn(b_tile, box_bytes);
#pragma unroll
    for (int kk = 0; kk < K16; ++kk) Wgmma<T, N>::template rs<1>(acc, a[kk], wgmma_desc_advance(b, kk * 16 * 128), 1);
    wgmma_commit();
}
}  // namespace cuk
