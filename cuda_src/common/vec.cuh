// Aligned vectors of N elements, so that a thread moves up to 16 bytes with one instruction.
#pragma once

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
