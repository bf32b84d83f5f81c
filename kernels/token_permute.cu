// Token movement around Hecate's ragged all-to-all, as CUDA kernels loaded at run time by
// ds_hecate/comm/gpu/kernels.py (cupy.RawModule, NVRTC; compiled once per process and device, then cached).
// Header-free, so it also builds with `nvcc -ptx -arch=sm_80|sm_90` (tests/test_kernels.py). Contracts in pure
// torch: ds_hecate/comm/gpu/reference.py.
//
//   expert_histogram          counts[e] = number of i with idx[i] == e, for 0 <= e < E; counts[E] = number of
//                             indices >= E (out of range; the runtime's health check); negative = dropped slot.
//   permute_rows_u<B>         out[r, :] = x[index[r], :] for rows of B-byte units (dtype-agnostic copy): token rows
//                             into send order (by destination, expert, slot).
//   unpermute_combine_<t>_v<V> weighted un-permute with the top-k combine:
//                             out[t, h] = sum_{j<k} w(j, t) * y[pos[j*S + t], h], in fp32, j ascending, where
//                             w = gates[j*S + t] (fp32) and a slot with pos < 0 (dropped) contributes 0;
//                             the result is cast to y's dtype (DeepSpeed's _sparse_decode arithmetic).
//
// bf16 is handled as raw bits (unsigned short) with round-to-nearest-even conversion, as torch does.

#define HECATE_THREADS 256

typedef unsigned short bf16_t;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(((unsigned int)v) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

template <typename T, int V> struct __align__(sizeof(T) * V) Vec { T v[V]; };

// ---- expert-count histogram ----------------------------------------------------------------------------------
// Per-block histogram in shared memory (num_experts + 1 bins, dynamic shared memory of (E + 1) * 4 bytes), then one
// 64-bit atomic per bin and block. Launch: block = HECATE_THREADS, grid = min(ceil(n / threads), a few per SM).
extern "C" __global__ void __launch_bounds__(HECATE_THREADS)
expert_histogram(const long long* __restrict__ idx, long long n, int num_experts,
                 unsigned long long* __restrict__ counts) {
    extern __shared__ unsigned int local[];
    for (int b = threadIdx.x; b <= num_experts; b += blockDim.x) local[b] = 0u;
    __syncthreads();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long e = idx[i];
        if (e >= 0) atomicAdd(&local[e < num_experts ? e : num_experts], 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b <= num_experts; b += blockDim.x)
        if (local[b]) atomicAdd(&counts[b], (unsigned long long)local[b]);
}

// ---- row permutation (gather) -----------------------------------------------------------------------------------
// Rows are row_units units of type U (16, 8, 4, 2 or 1 bytes: the host picks the widest unit that divides the row
// size and the pointers' alignment). Block = (bx, by) with bx * by = HECATE_THREADS: threadIdx.x strides along a
// row, threadIdx.y picks one of by rows; blocks stride over rows.
template <typename U>
__device__ __forceinline__ void permute_rows(const U* __restrict__ x, U* __restrict__ out,
                                             const long long* __restrict__ index, long long rows,
                                             long long row_units) {
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (long long)gridDim.x * blockDim.y) {
        const U* src = x + index[r] * row_units;
        U* dst = out + r * row_units;
        for (long long u = threadIdx.x; u < row_units; u += blockDim.x) dst[u] = src[u];
    }
}

#define HECATE_PERMUTE(BYTES, U)                                                                            \
    extern "C" __global__ void __launch_bounds__(HECATE_THREADS)                                           \
    permute_rows_u##BYTES(const U* __restrict__ x, U* __restrict__ out, const long long* __restrict__ index, \
                          long long rows, long long row_units) {                                            \
        permute_rows<U>(x, out, index, rows, row_units);                                                    \
    }

HECATE_PERMUTE(16, uint4)
HECATE_PERMUTE(8, uint2)
HECATE_PERMUTE(4, unsigned int)
HECATE_PERMUTE(2, unsigned short)
HECATE_PERMUTE(1, unsigned char)

// ---- weighted un-permute with top-k combine ----------------------------------------------------------------------
// Same block layout as permute_rows: threadIdx.x strides along the hidden dimension in vectors of V elements,
// threadIdx.y picks a token. V = 4 (16-byte loads for fp32, 8-byte for bf16) when hidden % 4 == 0 and y / out are
// aligned; V = 1 otherwise.
template <typename T, int V>
__device__ __forceinline__ void unpermute_combine(const T* __restrict__ y, const long long* __restrict__ pos,
                                                  const float* __restrict__ gates, T* __restrict__ out,
                                                  long long num_tokens, int k, long long hidden) {
    const long long hvec = hidden / V;
    for (long long t = (long long)blockIdx.x * blockDim.y + threadIdx.y; t < num_tokens;
         t += (long long)gridDim.x * blockDim.y) {
        for (long long h = threadIdx.x; h < hvec; h += blockDim.x) {
            float acc[V];
#pragma unroll
            for (int q = 0; q < V; ++q) acc[q] = 0.0f;
            for (int j = 0; j < k; ++j) {
                const long long p = pos[(long long)j * num_tokens + t];
                const float w = gates[(long long)j * num_tokens + t];
                // Product, then sum, each rounded (no FMA contraction): the same arithmetic as the torch path.
                if (p >= 0) {
                    const Vec<T, V> v = reinterpret_cast<const Vec<T, V>*>(y + p * hidden)[h];
#pragma unroll
                    for (int q = 0; q < V; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(to_float(v.v[q]), w));
                } else {
#pragma unroll
                    for (int q = 0; q < V; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(0.0f, w));
                }
            }
            Vec<T, V> o;
#pragma unroll
            for (int q = 0; q < V; ++q) o.v[q] = from_float<T>(acc[q]);
            reinterpret_cast<Vec<T, V>*>(out + t * hidden)[h] = o;
        }
    }
}

#define HECATE_COMBINE(NAME, T, V)                                                                          \
    extern "C" __global__ void __launch_bounds__(HECATE_THREADS)                                           \
    unpermute_combine_##NAME##_v##V(const T* __restrict__ y, const long long* __restrict__ pos,            \
                                    const float* __restrict__ gates, T* __restrict__ out,                  \
                                    long long num_tokens, int k, long long hidden) {                        \
        unpermute_combine<T, V>(y, pos, gates, out, num_tokens, k, hidden);                                 \
    }

HECATE_COMBINE(f32, float, 1)
HECATE_COMBINE(f32, float, 4)
HECATE_COMBINE(bf16, bf16_t, 1)
HECATE_COMBINE(bf16, bf16_t, 4)
