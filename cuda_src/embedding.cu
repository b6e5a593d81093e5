// Embedding lookup (forward) and the dense, deterministic weight gradient (backward).
//
// Forward: one block a token at a time (persistent grid), or a warp a token for narrow rows;
// rows move in 16-byte vectors. An index outside [0, V) writes a zero row and records a fault.
//
// Backward (see cukern/embedding.py):
//  1. embedding_bwd_keys: key = (index << 32) | position for each token; tokens that give no
//     gradient (padding, out of range: the latter recorded as faults) get index V, so that
//     after the sort they come last and equal indices are adjacent, in position order.
//     Touched rows are flagged.
//  2. embedding_bwd_sort_pass, one a digit: the keys sorted.
//  3. embedding_bwd_chunks: sums the rows of C sorted entries a unit in float32, run by run,
//     and zeroes the untouched rows of a slice of the table beside them.
//  4. embedding_bwd_combine: the chunk where a crossing run starts adds the following chunks'
//     slot-0 partials in chunk order and writes the row. Long runs (a token repeated
//     thousands of times) are thus split over many blocks, and summed in a fixed order.
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/fault.cuh"

template <typename T, typename IdxT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) embedding_fwd(
    const IdxT* __restrict__ indices, long long ntok,
    const T* __restrict__ weight, long long V, int D,
    T* __restrict__ out, long long* fault)
{
    using namespace cuk;
    for (long long t = blockIdx.x; t < ntok; t += gridDim.x) {
        const long long i = static_cast<long long>(indices[t]);
        const bool ok = i >= 0 && i < V;
        if (!ok && threadIdx.x == 0) record_fault(fault, i, V);
        const T* src = weight + (ok ? i : 0) * D;
        T* dst = out + t * D;
#pragma unroll 4
        for (int col = threadIdx.x * VEC; col < D; col += THREADS * VEC) {
            Vec<T, VEC> v = {};
            if (ok) v = load_vec<T, VEC>(src + col);
            store_vec<T, VEC>(dst + col, v);
        }
    }
}

// Forward for narrow rows (the front's choice, up to WARP_ROW_BYTES): a warp a token, so a
// block of THREADS copies THREADS/32 rows at once instead of leaving most of its threads
// idle. Measured 1.7x (D = 1024) to 3x (D = 64) faster than a block a token, bf16 on an
// H200; a block a token stays ahead from 4096 on (docs/notes-embedding.md).
template <typename T, typename IdxT, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS) embedding_fwd_warp(
    const IdxT* __restrict__ indices, long long ntok,
    const T* __restrict__ weight, long long V, int D,
    T* __restrict__ out, long long* fault)
{
    using namespace cuk;
    const int lane = threadIdx.x % 32;
    const long long nwarps = static_cast<long long>(gridDim.x) * (THREADS / 32);
    for (long long t = static_cast<long long>(blockIdx.x) * (THREADS / 32) + threadIdx.x / 32; t < ntok;
         t += nwarps) {
        const long long i = static_cast<long long>(indices[t]);
        const bool ok = i >= 0 && i < V;
        if (!ok && lane == 0) record_fault(fault, i, V);
        const T* src = weight + (ok ? i : 0) * D;
        T* dst = out + t * D;
        // All U loads are issued before the first store (written out, not left to an unroll
        // pragma: with `#pragma unroll 4` over load-store pairs this kernel ran 4x slower
        // as soon as a lane had more than one vector a row).
        constexpr int U = 4;
        for (int col0 = lane * VEC; col0 < D; col0 += 32 * VEC * U) {
            Vec<T, VEC> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int col = col0 + u * 32 * VEC;
                v[u] = Vec<T, VEC>{};
                if (ok && col < D) v[u] = load_vec<T, VEC>(src + col);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int col = col0 + u * 32 * VEC;
                if (col < D) store_vec<T, VEC>(dst + col, v[u]);
            }
        }
    }
}

// ---- the keys and their sort --------------------------------------------------------------
// The keys are sorted by index only (bits 32 and up), stably: tokens start in position order,
// so equal indices end up in position order, as a sort of the whole keys would leave them. The
// sort is least-significant digit first, BITS a pass over the bits V needs (two passes up to
// V = 2^18 - 1 at 9 bits): a pass is one launch, a scatter by the digit counts a tile, which
// counts the next pass's digits as it writes (the keys kernel counts the first pass's). The
// framework's sort of the 64-bit keys took 98 us for 65536 tokens on an H200.

template <int BITS>
__device__ __forceinline__ unsigned sort_digit(long long key, int shift) {
    return static_cast<unsigned>(static_cast<unsigned long long>(key) >> (32 + shift)) & ((1u << BITS) - 1);
}

// counts[slot] += 1 for each lane in `active`, one atomic for each distinct slot.
__device__ __forceinline__ void count_once_a_slot(unsigned* counts, unsigned slot, unsigned active) {
    const unsigned peers = __match_any_sync(active, slot);
    const unsigned lt = (1u << (threadIdx.x & 31)) - 1;
    if ((peers & lt) == 0) atomicAdd(counts + slot, static_cast<unsigned>(__popc(peers)));
}

// key = (index << 32) | position, padding and out-of-range tokens (the latter recorded as
// faults) given index V so that they sort last; touched rows flagged (every writer stores the
// same value); the first pass's digit counts a tile of TILE keys, digit-major ([R][ntiles]).
// padding < 0: none (the front normalizes a negative padding_idx to V + padding_idx).
template <typename IdxT, int BITS, int TILE>
__global__ void __launch_bounds__(256) embedding_bwd_keys(
    const IdxT* __restrict__ indices, long long ntok, long long V, long long padding,
    long long* __restrict__ keys, int* __restrict__ touched, int* __restrict__ counts, long long ntiles,
    long long* fault)
{
    using namespace cuk;
    unsigned* ucounts = reinterpret_cast<unsigned*>(counts);
    // (the loop's test is the warp's first token: its lanes go round together, for the ballot)
    for (long long t = blockIdx.x * 256LL + threadIdx.x; t - (threadIdx.x & 31) < ntok; t += gridDim.x * 256LL) {
        const bool ok = t < ntok;
        const unsigned active = __ballot_sync(0xffffffffu, ok);
        if (!ok) continue;
        long long i = static_cast<long long>(indices[t]);
        if (i < 0 || i >= V) {
            record_fault(fault, i, V);
            i = V;
        } else if (i == padding) {
            i = V;
        } else {
            touched[i] = 1;
        }
        const long long key = (i << 32) | t;
        keys[t] = key;
        count_once_a_slot(ucounts, static_cast<unsigned>(sort_digit<BITS>(key, 0) * ntiles + t / TILE), active);
    }
}

// One pass: block `tile` moves its TILE keys (src[tile * TILE ...]) to their places by digit,
// stably. counts: this pass's digit counts a tile ([R][ntiles]), from which each block works
// out its own first places (the keys of smaller digits, and of its digit in earlier tiles: a
// scan in a launch of its own, or in the last block of the kernel before, cost about 10 us);
// next: the next pass's counts (digits at next_shift, by the tile each key lands in), or null
// after the last pass.
// Warp w ranks its 32 * ITEMS keys 32 at a time: a key's rank among the warp's keys of its
// digit is the count of that digit so far (whist) plus its equal-digit lanes below it.
template <int BITS, int WARPS, int ITEMS>
__global__ void __launch_bounds__(WARPS * 32, 1) embedding_bwd_sort_pass(
    const long long* __restrict__ src, long long* __restrict__ dst, long long n, int shift,
    const int* __restrict__ counts, long long ntiles, int* __restrict__ next, int next_shift)
{
    constexpr int R = 1 << BITS, THREADS = WARPS * 32, TILE = THREADS * ITEMS, DPT = R / THREADS;
    static_assert(R % THREADS == 0, "each thread takes R / THREADS digits");
    __shared__ unsigned whist[WARPS][R];
    __shared__ unsigned first[R];   // the tile's first place for each digit
    __shared__ unsigned warp_sums[WARPS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const unsigned lt = (1u << lane) - 1;
    const long long tile = blockIdx.x;
    for (int i = threadIdx.x; i < WARPS * R; i += THREADS) (&whist[0][0])[i] = 0;

    // digits threadIdx.x * DPT ...: their keys in all tiles and in the tiles before this one
    unsigned total[DPT], before[DPT], sum = 0;
#pragma unroll
    for (int q = 0; q < DPT; ++q) {
        const int* c = counts + (threadIdx.x * DPT + q) * ntiles;
        unsigned all = 0, pre = 0;
#pragma unroll 4
        for (long long t = 0; t < ntiles; ++t) {
            if (t == tile) pre = all;
            all += static_cast<unsigned>(c[t]);
        }
        total[q] = all;
        before[q] = pre;
        sum += all;
    }
    unsigned incl = sum;   // the threads' sums scanned: in the warp, then of the warps
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
        const unsigned x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    if (lane == 31) warp_sums[w] = incl;
    __syncthreads();
    if (w == 0) {
        unsigned x = lane < WARPS ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane < WARPS) warp_sums[lane] = x;
    }
    __syncthreads();
    {
        unsigned run = incl - sum + (w > 0 ? warp_sums[w - 1] : 0);
#pragma unroll
        for (int q = 0; q < DPT; ++q) {
            first[threadIdx.x * DPT + q] = run + before[q];
            run += total[q];
        }
    }
    const long long base = tile * TILE + static_cast<long long>(w) * 32 * ITEMS;
    long long key[ITEMS];
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const long long e = base + r * 32 + lane;
        key[r] = e < n ? src[e] : 0;
    }
    __syncthreads();
    unsigned rank[ITEMS];
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const bool ok = base + r * 32 + lane < n;
        const unsigned d = ok ? sort_digit<BITS>(key[r], shift) : R;   // R: no key
        const unsigned peers = __match_any_sync(0xffffffffu, d);
        const unsigned before = ok ? whist[w][d] : 0;
        rank[r] = before + __popc(peers & lt);
        __syncwarp();
        if (ok && (peers & lt) == 0) whist[w][d] = before + __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    for (int d = threadIdx.x; d < R; d += THREADS) {   // the warps' first places, digit by digit
        unsigned run = first[d];
#pragma unroll
        for (int v = 0; v < WARPS; ++v) {
            const unsigned c = whist[v][d];
            whist[v][d] = run;
            run += c;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const bool ok = base + r * 32 + lane < n;
        const unsigned active = __ballot_sync(0xffffffffu, ok);
        if (!ok) continue;
        const unsigned dest = whist[w][sort_digit<BITS>(key[r], shift)] + rank[r];
        dst[dest] = key[r];
        if (next != nullptr)
            count_once_a_slot(reinterpret_cast<unsigned*>(next),
                              sort_digit<BITS>(key[r], next_shift) * static_cast<unsigned>(ntiles) + dest / TILE, active);
    }
}

// Unit u of the sums, block (x, y) taking units x, x + gridDim.x, ... over column tile y:
//  - chunk u of C sorted entries (units past the last chunk have none): summed in float32 run
//    by run (a run = equal indices). A run entirely inside the chunk is written to dweight; a
//    run that crosses a chunk boundary leaves a float32 partial row (slot 0: the chunk's first
//    run, slot 1: its last) for the combine kernel.
//  - table rows [u * zrows, u * zrows + zrows) that no token touched: written as zeros, zper
//    rows after each entry, so that the row reads (latency-bound, one entry after another)
//    and the stores of zeros share the memory system (the two as separate launches ran one
//    after the other). dweight is written once: V*D elements, no zero fill first.
// The keys of a chunk and the flags of its rows come to shared memory first, so that an
// entry's row can be requested one entry ahead, with no key load in the way.
// part: [nchunks][2][D] float32; pidx: [nchunks][2] (run index or -1); pcnt: [nchunks][2];
// owners: 2 * chunk + slot for each chunk where a crossing run starts, in no particular order
// (each is combined on its own, so the order changes no result); nowners: their count.
// MINB (blocks an SM for ptxas's register budget): 1024 / (THREADS * NV) keeps the 16-bit
// instances at 64 registers, two 512-thread blocks an SM, with no spills.
template <typename T, int VEC, int NV, int THREADS, int CMAX, int ZMAX, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) embedding_bwd_chunks(
    const long long* __restrict__ keys, long long n, int C, long long nchunks, long long nunits, int tiles,
    int zrows, int zper, const int* __restrict__ touched, const T* __restrict__ grad, long long V, int D,
    int scale_by_freq, T* __restrict__ dweight, float* __restrict__ part, long long* __restrict__ pidx,
    int* __restrict__ pcnt, int* __restrict__ owners, int* __restrict__ nowners)
{
    using namespace cuk;
    __shared__ long long skey[CMAX];   // C <= CMAX
    __shared__ unsigned char szero[ZMAX];   // 1: row r0 + i is to be zeroed
    const long long items = nunits * tiles;

    // work item = unit * tiles + column tile, taken in turn by a persistent grid
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long u = item / tiles;
        const int col0 = static_cast<int>(item % tiles) * THREADS * NV * VEC;
        const bool lead = item % tiles == 0 && threadIdx.x == 0;
        const long long e0 = u * C;
        const int m = u < nchunks ? static_cast<int>(n - e0 < C ? n - e0 : C) : 0;
        const long long r0 = u * zrows;
        const int nz = r0 < V ? static_cast<int>(V - r0 < zrows ? V - r0 : zrows) : 0;
        const long long prev = m && e0 > 0 ? (keys[e0 - 1] >> 32) : -1;
        const long long next = m && e0 + m < n ? (keys[e0 + m] >> 32) : -1;
        __syncthreads();   // the previous unit is done with skey and szero
        for (int i = threadIdx.x; i < m; i += THREADS) skey[i] = keys[e0 + i];
        for (int i = threadIdx.x; i < nz; i += THREADS) szero[i] = touched[r0 + i] == 0;
        if (lead && m) {
            pidx[2 * u] = pidx[2 * u + 1] = -1;
        }
        __syncthreads();

        int zi = 0;   // the next of the unit's rows to look at for zeroing
        auto zero_rows = [&](int count) {
            for (int z = 0; z < count; ++z) {
                while (zi < nz && !szero[zi]) ++zi;
                if (zi >= nz) return;
                T* row = dweight + (r0 + zi) * D;
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
                    if (col < D) store_vec<T, VEC>(row + col, Vec<T, VEC>{});
                }
                ++zi;
            }
        };
        // entries with an index < V: padding and out-of-range tokens were given V, sorted last
        auto valid = [&](int i) { return i < m && (skey[i] >> 32) < V; };
        auto load_row = [&](int i, Vec<T, VEC>(&dst)[NV]) {
            const T* g = grad + (skey[i] & 0xffffffffLL) * D;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
                dst[k] = col < D ? load_vec<T, VEC>(g + col) : Vec<T, VEC>{};
            }
        };

        float acc[NV][VEC];
        long long cur = -1;
        int cnt = 0;
        bool first = true;
        auto flush = [&](bool spans_out) {
            const bool spans_in = first && prev == cur;
            if (!spans_in && !spans_out) {
                const float s = scale_by_freq ? 1.f / static_cast<float>(cnt) : 1.f;
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
                    if (col < D) {
                        Vec<T, VEC> o;
#pragma unroll
                        for (int j = 0; j < VEC; ++j) o.v[j] = from_float<T>(acc[k][j] * s);
                        store_vec<T, VEC>(dweight + cur * D + col, o);
                    }
                }
            } else {
                const int slot = first ? 0 : 1;
                float* p = part + (2 * u + slot) * static_cast<long long>(D);
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = col0 + (k * THREADS + threadIdx.x) * VEC;
                    if (col < D) {
#pragma unroll
                        for (int j = 0; j < VEC; ++j) p[col + j] = acc[k][j];
                    }
                }
                if (lead) {
                    pidx[2 * u + slot] = cur;
                    pcnt[2 * u + slot] = cnt;
                    if (!spans_in && spans_out) owners[atomicAdd(nowners, 1)] = static_cast<int>(2 * u + slot);
                }
            }
        };

        // entry i + 1's row requested before entry i's is added (two ahead measured the same)
        Vec<T, VEC> v[2][NV];
        if (valid(0)) load_row(0, v[0]);
        for (int i = 0; valid(i); ++i) {
            if (valid(i + 1)) load_row(i + 1, v[1]);
            zero_rows(zper);
            const long long idx = skey[i] >> 32;
            if (idx != cur) {
                if (cur >= 0) {
                    flush(false);
                    first = false;
                }
                cur = idx;
                cnt = 0;
#pragma unroll
                for (int k = 0; k < NV; ++k)
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[k][j] = 0.f;
            }
#pragma unroll
            for (int k = 0; k < NV; ++k)
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[k][j] += element(v[0][k], j);
            ++cnt;
#pragma unroll
            for (int k = 0; k < NV; ++k) v[0][k] = v[1][k];
        }
        if (cur >= 0) flush(next == cur);
        zero_rows(nz);
    }
}

// The crossing runs: work item w is owner w / tiles (a chunk where such a run starts) and
// column tile w % tiles of THREADS * CV columns, CV a thread. The run's last chunk is looked
// for among the next B chunks' first runs (one round of loads; most runs end there), else by
// a binary search of the sorted keys (the same loads for every thread of the block). The
// partials of its chunks are then read B at a time with no load waiting on another: a token
// repeated thousands of times spans hundreds of chunks.
template <typename T, int THREADS, int CV>
__global__ void __launch_bounds__(THREADS, 1) embedding_bwd_combine(
    const long long* __restrict__ keys, long long n, int C, long long nchunks, const float* __restrict__ part,
    const long long* __restrict__ pidx, const int* __restrict__ pcnt, const int* __restrict__ owners,
    const int* __restrict__ nowners, int D, int scale_by_freq, T* __restrict__ dweight)
{
    using namespace cuk;
    constexpr int B = 16;
    const int tiles = (D + THREADS * CV - 1) / (THREADS * CV);
    const long long items = static_cast<long long>(*nowners) * tiles;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        const int owner = owners[w / tiles];
        const long long b = owner / 2;
        const int slot = owner % 2;
        const long long idx = pidx[2 * b + slot];
        long long last = b;   // the chunk of the run's last entry
        {
            long long id[B];
#pragma unroll
            for (int j = 0; j < B; ++j) id[j] = b + 1 + j < nchunks ? pidx[2 * (b + 1 + j)] : -1;
            bool go = true;
#pragma unroll
            for (int j = 0; j < B; ++j) {
                go = go && id[j] == idx;
                if (go) last = b + 1 + j;
            }
            if (go) {   // past those: search the keys from there
                long long lo = last * C, hi = n;   // keys[lo] is of the run
                while (hi - lo > 1) {
                    const long long mid = lo + (hi - lo) / 2;
                    if ((keys[mid] >> 32) == idx) lo = mid; else hi = mid;
                }
                last = lo / C;
            }
        }
        const int col = static_cast<int>(w % tiles) * THREADS * CV + threadIdx.x * CV;
        if (col >= D) continue;
        float acc[CV];
        {
            const Vec<float, CV> p = load_vec<float, CV>(part + (2 * b + slot) * static_cast<long long>(D) + col);
#pragma unroll
            for (int j = 0; j < CV; ++j) acc[j] = p.v[j];
        }
        long long cnt = pcnt[2 * b + slot];
        for (long long c0 = b + 1; c0 <= last; c0 += B) {
            Vec<float, CV> p[B];
            int q[B];
#pragma unroll
            for (int j = 0; j < B; ++j) {
                const bool in = c0 + j <= last;
                p[j] = in ? load_vec<float, CV>(part + (2 * (c0 + j)) * static_cast<long long>(D) + col)
                          : Vec<float, CV>{};
                q[j] = in ? pcnt[2 * (c0 + j)] : 0;
            }
#pragma unroll
            for (int j = 0; j < B; ++j) {
                if (c0 + j <= last) {
#pragma unroll
                    for (int k = 0; k < CV; ++k) acc[k] += p[j].v[k];
                    cnt += q[j];
                }
            }
        }
        const float s = scale_by_freq ? 1.f / static_cast<float>(cnt) : 1.f;
        Vec<T, CV> o;
#pragma unroll
        for (int j = 0; j < CV; ++j) o.v[j] = from_float<T>(acc[j] * s);
        store_vec<T, CV>(dweight + idx * D + col, o);
    }
}
