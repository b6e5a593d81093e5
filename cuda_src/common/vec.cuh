// Aligned vectors of N elements, so that a thread moves up to 16 bytes with one instruction.
#pragma once
#include "dtype.cuh"

namespace cuk {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, N>& v) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// A 16-byte vector to global memory with one st.global.v4 whatever the compiler makes of the
// vector's elements: it was seen to split one of a thread's several vector stores into 16- and
// 32-bit pieces (cross_entropy's first vector: 17% of its sectors excessive in Nsight Compute).
template <typename T, int N>
__device__ __forceinline__ void store_vec_global(T* p, const Vec<T, N>& v) {
    if constexpr (sizeof(Vec<T, N>) == 16) {
        const unsigned int* w = reinterpret_cast<const unsigned int*>(&v);
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
    } else {
        *reinterpret_cast<Vec<T, N>*>(p) = v;
    }
}

// Row data, read or written once per kernel. (The evict-first .cs hint was measured here
// and lost 2-6%: docs/notes-norm.md.)
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_stream(const T* __restrict__ p) {
    return load_vec<T, N>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_stream(T* __restrict__ p, const Vec<T, N>& v) {
    store_vec<T, N>(p, v);
}

// Whole vectors to and from float32, two 16-bit elements per 32-bit register: converting
// element by element can leave each 16-bit value in a register of its own (seen to double
// the registers of the GroupNorm kernels and make them spill).
template <typename T, int N>
__device__ __forceinline__ void unpack(const Vec<T, N>& v, float (&f)[N]) {
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
        const unsigned int* w = reinterpret_cast<const unsigned int*>(&v);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) unpack2(w[i], f[2 * i], f[2 * i + 1], T{});
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = to_float(v.v[i]);
    }
}

// Element j of a vector as float32, read from its 32-bit word as unpack does (one instruction
// for bfloat16), for loops that convert one element at a time to keep fewer values live.
template <typename T, int N>
__device__ __forceinline__ float element(const Vec<T, N>& v, int j) {
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
        return half_of_word(reinterpret_cast<const unsigned int*>(&v)[j / 2], j & 1, T{});
    } else {
        return to_float(v.v[j]);
    }
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> pack(const float (&f)[N]) {
    Vec<T, N> v;
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
        unsigned int* w = reinterpret_cast<unsigned int*>(&v);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) w[i] = pack2(f[2 * i], f[2 * i + 1], T{});
    } else if constexpr (is_fp8<T>::value && N % 2 == 0) {
        unsigned short* w = reinterpret_cast<unsigned short*>(&v);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) w[i] = static_cast<unsigned short>(pack_fp8x2<T>(f[2 * i], f[2 * i + 1]));
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v.v[i] = from_float<T>(f[i]);
    }
    return v;
}

}  // namespace cuk
