// Fused attention backward on tensor cores, deterministic by construction (no atomics):
//  1. attention_bwd_dot: Dsum[b, h, i] = sum_d dO * O (float32), the softmax correction.
//  2. attention_bwd_dkdv: a block per key tile of one (batch, kv head) — FlashAttention-2's
//     split — walks every query tile of every query head that shares the kv head, in a fixed
//     order, recomputing P = exp(S - lse) and accumulating in registers
//        dV += P^T dO,   dS = P * (dO V^T - Dsum),   dK += dS^T Q * scale.
//     GQA's sum over the query heads of a group is this loop: no expanded buffers.
//  3. attention_bwd_dq: a block per query tile (as the forward) walks the key tiles:
//        dQ += dS K * scale,
//     recomputing S and dP. dQ thus costs two more matrix products than FlashAttention-2's
//     atomic accumulation, and every gradient has the same bits on every run.
// Layouts as the forward: q, dq, out, dout (B, Sq, H, D); k, v, dk, dv (B, Sk, Hkv, D), each
// with element strides for batch, sequence and head and unit stride over D; lse and Dsum
// (B, H, Sq) float32 (lse natural-log, +inf for a query that sees no key).
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "common/mma.cuh"
#include "common/attn_tile.cuh"

// One thread a row (b, i, h).
template <typename T, int D>
__global__ void __launch_bounds__(256) attention_bwd_dot(
    const T* __restrict__ dout, const T* __restrict__ out,
    long long d_sb, long long d_ss, long long d_sh, long long o_sb, long long o_ss, long long o_sh,
    float* __restrict__ dsum, int B, int Sq, int H)
{
    const long long rows = static_cast<long long>(B) * Sq * H;
    for (long long r = blockIdx.x * 256LL + threadIdx.x; r < rows; r += gridDim.x * 256LL) {
        const int h = static_cast<int>(r % H);
        const long long bi = r / H;
        const int i = static_cast<int>(bi % Sq), b = static_cast<int>(bi / Sq);
        const T* dp = dout + b * d_sb + i * d_ss + h * d_sh;
        const T* op = out + b * o_sb + i * o_ss + h * o_sh;
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < D; c += 8) {
            float fd[8], fo[8];
            unpack(load_vec<T, 8>(dp + c), fd);
            unpack(load_vec<T, 8>(op + c), fo);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc = fmaf(fd[j], fo[j], acc);
        }
        dsum[(static_cast<long long>(b) * H + h) * Sq + i] = acc;
    }
}

// dK, dV. Block (key tile n_block, b * Hkv + hk); WARPS warps of 16 keys: BN = 16 * WARPS.
template <typename T, int D, int WARPS, int BM, bool CAUSAL>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_bwd_dkdv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
    T* __restrict__ dk, T* __restrict__ dv,
    long long q_sb, long long q_ss, long long q_sh,
    long long k_sb, long long k_ss, long long k_sh,
    long long v_sb, long long v_ss, long long v_sh,
    long long d_sb, long long d_ss, long long d_sh,
    long long dk_sb, long long dk_ss, long long dk_sh,
    long long dv_sb, long long dv_ss, long long dv_sh,
    int H, int Hkv, int Sq, int Sk, float scale, float scale_log2)
{
    using namespace attn;
    constexpr int BN = WARPS * 16;
    constexpr int THREADS = WARPS * 32;
    constexpr int ROW = row_elems(D);   // shared-memory row (D padded to 64 elements)
    constexpr int ROW_BYTES = ROW * static_cast<int>(sizeof(T));
    constexpr int NQ = BM / 8;     // query n-tiles a query tile
    constexpr int DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);     // [BN][ROW]
    T* sV = sK + BN * ROW;                          // [BN][ROW]
    T* sQ = sV + BN * ROW;                          // [2][BM][ROW]
    T* sdO = sQ + 2 * BM * ROW;                     // [2][BM][ROW]
    float* sL = reinterpret_cast<float*>(sdO + 2 * BM * ROW);   // [2][BM] lse * log2(e)
    float* sD = sL + 2 * BM;                                   // [2][BM] Dsum

    const int n_block = blockIdx.x;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
    const int rep = H / Hkv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = n_block * BN;
    const int diag = Sk - Sq;
    const unsigned int offA = a_offset(lane, ROW_BYTES), offB = b_offset(lane, ROW_BYTES);
    const unsigned int sKa = smem_addr(sK), sVa = smem_addr(sV), sQa = smem_addr(sQ), sdOa = smem_addr(sdO);

    // Query tiles that see a key of this tile: causal, query i sees key j iff j <= i + diag.
    const int m_first = CAUSAL ? max(0, (n0 - diag) / BM) : 0;
    const int m_tiles = (Sq + BM - 1) / BM;
    const int per_head = max(0, m_tiles - m_first);
    const int steps = per_head * rep;

    load_tile<T, BN, D, ROW, THREADS>(sK, k + b * k_sb + hk * k_sh, k_ss, n0, Sk);
    load_tile<T, BN, D, ROW, THREADS>(sV, v + b * v_sb + hk * v_sh, v_ss, n0, Sk);
    auto issue = [&](int step, int buf) {
        const int h = hk * rep + step / per_head;
        const int m0 = (m_first + step % per_head) * BM;
        load_tile<T, BM, D, ROW, THREADS>(sQ + buf * BM * ROW, q + b * q_sb + h * q_sh, q_ss, m0, Sq);
        load_tile<T, BM, D, ROW, THREADS>(sdO + buf * BM * ROW, dout + b * d_sb + h * d_sh, d_ss, m0, Sq);
    };
    if (steps > 0) issue(0, 0);
    cp_async_commit();

    float dkacc[DT][4], dvacc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dkacc[i][e] = dvacc[i][e] = 0.f;

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        const int h = hk * rep + step / per_head;
        const int m0 = (m_first + step % per_head) * BM;
        if (step + 1 < steps) issue(step + 1, buf ^ 1);
        cp_async_commit();
        {   // this tile's lse (in log2 units) and Dsum
            const long long rowbase = (static_cast<long long>(b) * H + h) * Sq;
            for (int i = threadIdx.x; i < BM; i += THREADS) {
                const bool ok = m0 + i < Sq;
                sL[buf * BM + i] = ok ? lse[rowbase + m0 + i] * 1.4426950408889634f : 0.f;
                sD[buf * BM + i] = ok ? dsum[rowbase + m0 + i] : 0.f;
            }
        }
        cp_async_wait<1>();
        __syncthreads();
        const unsigned int qb = sQa + buf * BM * ROW_BYTES, db = sdOa + buf * BM * ROW_BYTES;
        const float* lrow = sL + buf * BM;
        const float* drow = sD + buf * BM;

        // S^T = K Q^T (this warp's 16 keys x BM queries), and dP^T = V dO^T.
        float st[NQ][4], dpt[NQ][4];
#pragma unroll
        for (int j = 0; j < NQ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned int ak[4], av[4];
            ldmatrix_x4(ak, sKa + warp * 16 * ROW_BYTES + (offA ^ (kk << 5)));
            ldmatrix_x4(av, sVa + warp * 16 * ROW_BYTES + (offA ^ (kk << 5)));
#pragma unroll
            for (int nt = 0; nt < BM / 16; ++nt) {
                unsigned int rq[4], rd[4];
                ldmatrix_x4(rq, qb + nt * 16 * ROW_BYTES + (offB ^ (kk << 5)));
                ldmatrix_x4(rd, db + nt * 16 * ROW_BYTES + (offB ^ (kk << 5)));
                mma_16816<T>(st[2 * nt], ak, rq[0], rq[1]);
                mma_16816<T>(st[2 * nt + 1], ak, rq[2], rq[3]);
                mma_16816<T>(dpt[2 * nt], av, rd[0], rd[1]);
                mma_16816<T>(dpt[2 * nt + 1], av, rd[2], rd[3]);
            }
        }

        // P^T = exp(S*scale - lse) with masks; dS^T = P^T * (dP^T - Dsum).
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = j * 8 + 2 * t + (e & 1);             // query within the tile
                const int key = n0 + warp * 16 + g + (e >> 1) * 8;
                float p = fast_exp2(fmaf(st[j][e], scale_log2, -lrow[qi]));
                if (m0 + qi >= Sq || (CAUSAL && key > m0 + qi + diag)) p = 0.f;
                st[j][e] = p;
                dpt[j][e] = p * (dpt[j][e] - drow[qi]);
            }
        }

        // dV += P^T dO and dK += dS^T Q: the query tile is the k dimension.
#pragma unroll
        for (int kq = 0; kq < BM / 16; ++kq) {
            const unsigned int ap[4] = {
                pack_pair(st[2 * kq][0], st[2 * kq][1], T{}), pack_pair(st[2 * kq][2], st[2 * kq][3], T{}),
                pack_pair(st[2 * kq + 1][0], st[2 * kq + 1][1], T{}), pack_pair(st[2 * kq + 1][2], st[2 * kq + 1][3], T{})};
            const unsigned int as[4] = {
                pack_pair(dpt[2 * kq][0], dpt[2 * kq][1], T{}), pack_pair(dpt[2 * kq][2], dpt[2 * kq][3], T{}),
                pack_pair(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1], T{}), pack_pair(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3], T{})};
#pragma unroll
            for (int dt = 0; dt < D / 16; ++dt) {
                unsigned int rd[4], rq[4];
                ldmatrix_x4_trans(rd, db + kq * 16 * ROW_BYTES + (offA ^ (dt << 5)));
                ldmatrix_x4_trans(rq, qb + kq * 16 * ROW_BYTES + (offA ^ (dt << 5)));
                mma_16816<T>(dvacc[2 * dt], ap, rd[0], rd[1]);
                mma_16816<T>(dvacc[2 * dt + 1], ap, rd[2], rd[3]);
                mma_16816<T>(dkacc[2 * dt], as, rq[0], rq[1]);
                mma_16816<T>(dkacc[2 * dt + 1], as, rq[2], rq[3]);
            }
        }
        __syncthreads();  // the next step's loads overwrite the buffers read here
    }

    // Write this warp's 16 keys (zeros when no query sees them).
    T* dkg = dk + b * dk_sb + hk * dk_sh;
    T* dvg = dv + b * dv_sb + hk * dv_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = n0 + warp * 16 + g + r * 8;
        if (key < Sk) {
#pragma unroll
            for (int i = 0; i < DT; ++i) {
                *reinterpret_cast<unsigned int*>(dkg + key * dk_ss + i * 8 + 2 * t) =
                    pack_pair(dkacc[i][2 * r] * scale, dkacc[i][2 * r + 1] * scale, T{});
                *reinterpret_cast<unsigned int*>(dvg + key * dv_ss + i * 8 + 2 * t) =
                    pack_pair(dvacc[i][2 * r], dvacc[i][2 * r + 1], T{});
            }
        }
    }
}

// dQ. Block (query tile m_block, b * H + h); WARPS warps of 16 queries: BM = 16 * WARPS.
template <typename T, int D, int WARPS, int BN, bool CAUSAL>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_bwd_dq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
    T* __restrict__ dq,
    long long q_sb, long long q_ss, long long q_sh,
    long long k_sb, long long k_ss, long long k_sh,
    long long v_sb, long long v_ss, long long v_sh,
    long long d_sb, long long d_ss, long long d_sh,
    long long dq_sb, long long dq_ss, long long dq_sh,
    int H, int Hkv, int Sq, int Sk, float scale, float scale_log2)
{
    using namespace attn;
    constexpr int BM = WARPS * 16;
    constexpr int THREADS = WARPS * 32;
    constexpr int ROW = row_elems(D);   // shared-memory row (D padded to 64 elements)
    constexpr int ROW_BYTES = ROW * static_cast<int>(sizeof(T));
    constexpr int NT = BN / 8;
    constexpr int DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);   // [BM][ROW]
    T* sdO = sQ + BM * ROW;                       // [BM][ROW]
    T* sK = sdO + BM * ROW;                       // [2][BN][ROW]
    T* sV = sK + 2 * BN * ROW;                    // [2][BN][ROW]

    const int m_block = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const int hk = h / (H / Hkv);
    const T* kg = k + b * k_sb + hk * k_sh;
    const T* vg = v + b * v_sb + hk * v_sh;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int m0 = m_block * BM;
    const int diag = Sk - Sq;
    const unsigned int offA = a_offset(lane, ROW_BYTES), offB = b_offset(lane, ROW_BYTES);
    const unsigned int sQa = smem_addr(sQ), sdOa = smem_addr(sdO), sKa = smem_addr(sK), sVa = smem_addr(sV);

    int n_blocks = (Sk + BN - 1) / BN;
    if (CAUSAL) {
        const int last_key = min(Sk - 1, m0 + BM - 1 + diag);
        n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / BN + 1);
    }
    load_tile<T, BM, D, ROW, THREADS>(sQ, q + b * q_sb + h * q_sh, q_ss, m0, Sq);
    load_tile<T, BM, D, ROW, THREADS>(sdO, dout + b * d_sb + h * d_sh, d_ss, m0, Sq);
    if (n_blocks > 0) {
        load_tile<T, BN, D, ROW, THREADS>(sK, kg, k_ss, 0, Sk);
        load_tile<T, BN, D, ROW, THREADS>(sV, vg, v_ss, 0, Sk);
    }
    cp_async_commit();

    // This thread's two rows: lse (log2 units) and Dsum.
    float lrow[2], drow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + g + r * 8;
        const long long idx = (static_cast<long long>(b) * H + h) * Sq + row;
        lrow[r] = row < Sq ? lse[idx] * 1.4426950408889634f : 0.f;
        drow[r] = row < Sq ? dsum[idx] : 0.f;
    }

    float dqacc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) dqacc[i][0] = dqacc[i][1] = dqacc[i][2] = dqacc[i][3] = 0.f;

    for (int nb = 0; nb < n_blocks; ++nb) {
        const int buf = nb & 1;
        if (nb + 1 < n_blocks) {
            load_tile<T, BN, D, ROW, THREADS>(sK + (buf ^ 1) * BN * ROW, kg, k_ss, (nb + 1) * BN, Sk);
            load_tile<T, BN, D, ROW, THREADS>(sV + (buf ^ 1) * BN * ROW, vg, v_ss, (nb + 1) * BN, Sk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned int kb = sKa + buf * BN * ROW_BYTES, vb = sVa + buf * BN * ROW_BYTES;

        // S = Q K^T and dP = dO V^T for this warp's 16 queries.
        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned int aq[4], ad[4];
            ldmatrix_x4(aq, sQa + warp * 16 * ROW_BYTES + (offA ^ (kk << 5)));
            ldmatrix_x4(ad, sdOa + warp * 16 * ROW_BYTES + (offA ^ (kk << 5)));
#pragma unroll
            for (int nt = 0; nt < BN / 16; ++nt) {
                unsigned int rk[4], rv[4];
                ldmatrix_x4(rk, kb + nt * 16 * ROW_BYTES + (offB ^ (kk << 5)));
                ldmatrix_x4(rv, vb + nt * 16 * ROW_BYTES + (offB ^ (kk << 5)));
                mma_16816<T>(s[2 * nt], aq, rk[0], rk[1]);
                mma_16816<T>(s[2 * nt + 1], aq, rk[2], rk[3]);
                mma_16816<T>(dp[2 * nt], ad, rv[0], rv[1]);
                mma_16816<T>(dp[2 * nt + 1], ad, rv[2], rv[3]);
            }
        }

        // dS = P * (dP - Dsum), P = exp(S*scale - lse), masked.
        const int n0 = nb * BN;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const int key = n0 + j * 8 + 2 * t + (e & 1);
                const int row = m0 + warp * 16 + g + r * 8;
                float p = fast_exp2(fmaf(s[j][e], scale_log2, -lrow[r]));
                if (key >= Sk || row >= Sq || (CAUSAL && key > row + diag)) p = 0.f;
                s[j][e] = p * (dp[j][e] - drow[r]);
            }
        }

        // dQ += dS K: the key tile is the k dimension.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned int a[4] = {
                pack_pair(s[2 * kk][0], s[2 * kk][1], T{}), pack_pair(s[2 * kk][2], s[2 * kk][3], T{}),
                pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], T{}), pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], T{})};
#pragma unroll
            for (int dt = 0; dt < D / 16; ++dt) {
                unsigned int r[4];
                ldmatrix_x4_trans(r, kb + kk * 16 * ROW_BYTES + (offA ^ (dt << 5)));
                mma_16816<T>(dqacc[2 * dt], a, r[0], r[1]);
                mma_16816<T>(dqacc[2 * dt + 1], a, r[2], r[3]);
            }
        }
        __syncthreads();
    }

    T* dqg = dq + b * dq_sb + h * dq_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + g + r * 8;
        if (row < Sq) {
#pragma unroll
            for (int i = 0; i < DT; ++i)
                *reinterpret_cast<unsigned int*>(dqg + static_cast<long long>(row) * dq_ss + i * 8 + 2 * t) =
                    pack_pair(dqacc[i][2 * r] * scale, dqacc[i][2 * r + 1] * scale, T{});
        }
    }
}
