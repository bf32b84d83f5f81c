// Data movement of Hecate's sparse collectives, as CUDA kernels loaded at run time by ds_hecate/comm/gpu/kernels.py
// (cupy.RawModule, NVRTC; compiled once per process and device, then cached). No header is included, so the same
// file also builds with `nvcc -ptx -arch=sm_80|sm_90` (checked by tests/test_kernels.py).
//
// The contract of each kernel is written out in pure torch in ds_hecate/comm/gpu/reference.py; tests/gpu/ compares
// the two on the same inputs.
//
//   pack_<in>_<out>_v<V>      SparseAllGather / SparseReduceScatter send side: chunk c of the contiguous send
//                             buffer = convert(srcs[c]); srcs is a device table of pointers (expert masters or
//                             gradients live in separate tensors).
//   unpack_<in>_<out>_v<V>    receive side: dsts[c] = convert(chunk c of the receive buffer) (materialized weights
//                             or moved expert chunks as separate tensors).
//   reduce_<base>_<recv>_v<V> SparseReduceScatter on the owner: out[j] = float(base[j]) + sum of the received
//                             chunks listed for j (CSR: chunk_idx[seg_ptr[j] .. seg_ptr[j+1]]), added one after the
//                             other in fp32 in list order (own copy first, then by source rank): bit-for-bit the
//                             torch path's summation order.
//   accumulate_<recv>_v<V>    the same sum in place, into one fp32 [n, numel] accumulator (DeviceOps.accumulate):
//                             target row rows[j] += the received chunks chunk_idx[seg_ptr[j] .. seg_ptr[j+1]),
//                             added one after the other in fp32 in list order (receive order). The rows are
//                             distinct, so no element is written by two blocks of different j: no atomics, and the
//                             order is fixed (deterministic) however often an expert was replicated.
//
// Types: f32 = float, bf16 = bfloat16 handled as its 16 raw bits (unsigned short), converted with round to nearest
// even like torch. V is the number of elements one thread moves per access: V > 1 variants use 16-byte vector
// loads (ld.global.v4) and are chosen by the host only when every pointer is 16-byte aligned and numel % V == 0;
// V = 1 variants handle everything else. Memory-bound kernels: the >= 70% of device bandwidth target on large
// chunks relies on the vector loads and on enough blocks per chunk (grid.x) to fill the device.
//
// Launch: blockDim.x = HECATE_THREADS, grid = (blocks per chunk, chunks); threads stride over a chunk's vectors.

#define HECATE_THREADS 256

typedef unsigned short bf16_t;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(((unsigned int)v) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0u;  // NaN: torch's canonical quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                              // round to nearest, ties to even
    return (bf16_t)(u >> 16);
}

template <typename In, typename Out> __device__ __forceinline__ Out convert(In v) { return from_float<Out>(to_float(v)); }
template <> __device__ __forceinline__ float convert<float, float>(float v) { return v; }
template <> __device__ __forceinline__ bf16_t convert<bf16_t, bf16_t>(bf16_t v) { return v; }

// V elements of T moved as one aligned access (16 bytes for the V > 1 variants on the input side).
template <typename T, int V> struct __align__(sizeof(T) * V) Vec { T v[V]; };

// dst[i] = convert(src[i]) for i < numel, V elements per thread access, grid-strided over blockIdx.x.
template <typename In, typename Out, int V>
__device__ __forceinline__ void copy_chunk(const In* __restrict__ src, Out* __restrict__ dst, long long numel) {
    const long long nvec = numel / V;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const Vec<In, V>* s = reinterpret_cast<const Vec<In, V>*>(src);
    Vec<Out, V>* d = reinterpret_cast<Vec<Out, V>*>(dst);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const Vec<In, V> a = s[i];
        Vec<Out, V> b;
#pragma unroll
        for (int k = 0; k < V; ++k) b.v[k] = convert<In, Out>(a.v[k]);
        d[i] = b;
    }
    // Tail (only reached by V = 1 callers or when numel % V != 0, which the host avoids for V > 1).
    for (long long i = nvec * V + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride)
        dst[i] = convert<In, Out>(src[i]);
}

#define HECATE_PACK(NAME, IN, OUT, V)                                                                       \
    extern "C" __global__ void __launch_bounds__(HECATE_THREADS)                                           \
    pack_##NAME##_v##V(const IN* const* __restrict__ srcs, OUT* __restrict__ dst, long long numel) {       \
        const long long c = blockIdx.y;                                                                     \
        copy_chunk<IN, OUT, V>(srcs[c], dst + c * numel, numel);                                            \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(HECATE_THREADS)                                           \
    unpack_##NAME##_v##V(const IN* __restrict__ src, OUT* const* __restrict__ dsts, long long numel) {     \
        const long long c = blockIdx.y;                                                                     \
        copy_chunk<IN, OUT, V>(src + c * numel, dsts[c], numel);                                            \
    }

// Names: <input dtype>_<output dtype>. Vector widths give 16-byte loads on the input side.
HECATE_PACK(f32_f32, float, float, 1)
HECATE_PACK(f32_f32, float, float, 4)
HECATE_PACK(f32_bf16, float, bf16_t, 1)
HECATE_PACK(f32_bf16, float, bf16_t, 4)
HECATE_PACK(bf16_bf16, bf16_t, bf16_t, 1)
HECATE_PACK(bf16_bf16, bf16_t, bf16_t, 8)
HECATE_PACK(bf16_f32, bf16_t, float, 1)
HECATE_PACK(bf16_f32, bf16_t, float, 8)

// out[j] = float(bases[j]) + recv chunks chunk_idx[seg_ptr[j]..seg_ptr[j+1]) in order; grid = (blocks, outputs).
// out may alias bases[j] only when Base is float (element-wise, read before write).
template <typename Base, typename Recv, int V>
__device__ __forceinline__ void reduce_chunk(float* __restrict__ out, const Base* __restrict__ base,
                                             const Recv* __restrict__ recv, const long long* __restrict__ chunk_idx,
                                             long long first, long long last, long long numel) {
    const long long nvec = numel / V;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const Vec<Base, V> b = reinterpret_cast<const Vec<Base, V>*>(base)[i];
        float acc[V];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = to_float(b.v[k]);
        for (long long s = first; s < last; ++s) {
            const Vec<Recv, V> r = reinterpret_cast<const Vec<Recv, V>*>(recv + chunk_idx[s] * numel)[i];
#pragma unroll
            for (int k = 0; k < V; ++k) acc[k] += to_float(r.v[k]);
        }
        Vec<float, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = acc[k];
        reinterpret_cast<Vec<float, V>*>(out)[i] = o;
    }
    for (long long i = nvec * V + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
        float acc = to_float(base[i]);
        for (long long s = first; s < last; ++s) acc += to_float(recv[chunk_idx[s] * numel + i]);
        out[i] = acc;
    }
}

#define HECATE_REDUCE(NAME, BASE, RECV, V)                                                                  \
    extern "C" __global__ void __launch_bounds__(HECATE_THREADS)                                           \
    reduce_##NAME##_v##V(float* const* __restrict__ outs, const BASE* const* __restrict__ bases,           \
                         const RECV* __restrict__ recv, const long long* __restrict__ seg_ptr,             \
                         const long long* __restrict__ chunk_idx, long long numel) {                       \
        const long long j = blockIdx.y;                                                                     \
        reduce_chunk<BASE, RECV, V>(outs[j], bases[j], recv, chunk_idx, seg_ptr[j], seg_ptr[j + 1], numel); \
    }

// Names: <own gradient dtype>_<wire dtype>; the output (owner's total) is always fp32.
HECATE_REDUCE(f32_f32, float, float, 1)
HECATE_REDUCE(f32_f32, float, float, 4)
HECATE_REDUCE(f32_bf16, float, bf16_t, 1)
HECATE_REDUCE(f32_bf16, float, bf16_t, 4)
HECATE_REDUCE(bf16_f32, bf16_t, float, 1)
HECATE_REDUCE(bf16_f32, bf16_t, float, 4)
HECATE_REDUCE(bf16_bf16, bf16_t, bf16_t, 1)
HECATE_REDUCE(bf16_bf16, bf16_t, bf16_t, 4)

// target + rows[j] * numel += recv chunks chunk_idx[seg_ptr[j]..seg_ptr[j+1]) in order; grid = (blocks, rows).
// The accumulator row is read once and written once per element; recv never aliases it.
template <typename Recv, int V>
__device__ __forceinline__ void accumulate_row(float* __restrict__ dst, const Recv* __restrict__ recv,
                                               const long long* __restrict__ chunk_idx, long long first,
                                               long long last, long long numel) {
    const long long nvec = numel / V;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        Vec<float, V> acc = reinterpret_cast<const Vec<float, V>*>(dst)[i];
        for (long long s = first; s < last; ++s) {
            const Vec<Recv, V> r = reinterpret_cast<const Vec<Recv, V>*>(recv + chunk_idx[s] * numel)[i];
#pragma unroll
            for (int k = 0; k < V; ++k) acc.v[k] += to_float(r.v[k]);
        }
        reinterpret_cast<Vec<float, V>*>(dst)[i] = acc;
    }
    for (long long i = nvec * V + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
        float acc = dst[i];
        for (long long s = first; s < last; ++s) acc += to_float(recv[chunk_idx[s] * numel + i]);
        dst[i] = acc;
    }
}

#define HECATE_ACCUMULATE(NAME, RECV, V)                                                                    \
    extern "C" __global__ void __launch_bounds__(HECATE_THREADS)                                           \
    accumulate_##NAME##_v##V(float* __restrict__ target, const long long* __restrict__ rows,               \
                             const RECV* __restrict__ recv, const long long* __restrict__ seg_ptr,         \
                             const long long* __restrict__ chunk_idx, long long numel) {                   \
        const long long j = blockIdx.y;                                                                     \
        accumulate_row<RECV, V>(target + rows[j] * numel, recv, chunk_idx, seg_ptr[j], seg_ptr[j + 1],      \
                                numel);                                                                     \
    }

// Names: <wire dtype>; the accumulator is always fp32.
HECATE_ACCUMULATE(f32, float, 1)
HECATE_ACCUMULATE(f32, float, 4)
HECATE_ACCUMULATE(bf16, bf16_t, 1)
HECATE_ACCUMULATE(bf16, bf16_t, 4)
