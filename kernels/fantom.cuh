// What our kernels share: the half types' conversions, the tensor-core and async-copy primitives
// (mma.sync, ldmatrix, cp.async) and warp reductions.
//
// On the device each primitive is one PTX instruction. Built with FANTOM_EMU (the CPU
// emulation of the CUDA execution model in kernels/emu/, which CI runs), each is the same
// operation written out per lane, with the fragment layouts of the PTX ISA, so the kernels'
// indexing, tiling, masking and online softmax are checked on a machine without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifdef FANTOM_EMU
#define FANTOM_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(fantom_emu::dynamic_smem())
#else
#define FANTOM_DYNAMIC_SMEM(T, name) \
    extern __shared__ __align__(16) unsigned char fantom_smem_[]; \
    T* name = reinterpret_cast<T*>(fantom_smem_)
#endif

namespace fantom {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// Two floats rounded to T and packed in 32 bits, the first in the low half (the element at the
// lower address, as mma fragments and memory hold pairs).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float warp_max4(float v) {
    // Over the four lanes of a quad (lanes 4g .. 4g+3), which share a row of an mma fragment.
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float warp_sum4(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#ifndef FANTOM_EMU

// d = a·b + c for one warp: a 16×16 (row-major fragment, 4 registers of two T), b 16×8
// (column-major, 2 registers), c and d 16×8 f32 (4 floats).
template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]);

#define FANTOM_MMA_16816(T, PTX)                                                               \
    template <>                                                                                \
    __device__ __forceinline__ void mma_16816<T>(float d[4], const uint32_t a[4],               \
                                                 const uint32_t b[2]) {                         \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "              \
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));       \
    }
FANTOM_MMA_16816(__nv_bfloat16, "bf16")
FANTOM_MMA_16816(__half, "f16")

// Four 8×8 matrices of 16-bit elements from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8 (16 contiguous bytes); register i gets matrix i's elements
// (row lane/4, columns 2·(lane%4) and +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// As ldmatrix_x4, transposed: register i gets matrix i's rows 2·(lane%4) and +1 at column lane/4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes global → shared without passing through registers; zero-filled when !valid (the
// source is then not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#else  // FANTOM_EMU: the same operations per lane (kernels/emu/cuda_emu.h)

template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    fantom_emu::mma_16816<T>(d, a, b);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
    fantom_emu::ldmatrix_x4(r, row, false);
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    fantom_emu::ldmatrix_x4(r, row, true);
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    fantom_emu::copy_16(smem, gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}

#endif

}  // namespace fantom
