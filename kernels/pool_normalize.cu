// Fused pooling + Matryoshka truncation + L2 normalisation: token states to one unit vector per
// row in one pass, where candle needs an index_select / index_add, a division, a copy to the
// host and a host loop.
//
// hidden:  [tokens, h] row-major, f32 or bf16 (packed rows: row r is tokens
//          starts[r] .. starts[r] + lengths[r])
// mode:    0 = first token (CLS), 1 = last token, 2 = mean over the row's tokens
// dims:    output width (<= h): the first `dims` features (Matryoshka truncation)
// out:     [rows, dims] f32; with `normalize`, each row scaled to unit L2 norm (floor 1e-12, as
//          torch.nn.functional.normalize)
//
// One block per row; blockDim.x must be a power of two (the launcher uses 256).
#include "fantom.cuh"

__device__ __forceinline__ float load_f(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, size_t i) {
    return __bfloat162float(p[i]);
}

template <typename T>
__device__ void pool_normalize(const T* hidden, const unsigned int* starts,
                               const unsigned int* lengths, unsigned int h, unsigned int dims,
                               unsigned int mode, unsigned int normalize, float* out) {
    FANTOM_DYNAMIC_SMEM(float, partial);
    const unsigned int row = blockIdx.x;
    const unsigned int start = starts[row];
    const unsigned int len = lengths[row];
    float* o = out + (size_t)row * dims;
    float sq = 0.0f;
    for (unsigned int d = threadIdx.x; d < dims; d += blockDim.x) {
        float v = 0.0f;
        if (len > 0) {
            if (mode == 2) {
                float s = 0.0f;
                for (unsigned int t = 0; t < len; ++t) {
                    s += load_f(hidden, (size_t)(start + t) * h + d);
                }
                v = s / (float)len;
            } else {
                const unsigned int t = (mode == 0) ? start : start + len - 1;
                v = load_f(hidden, (size_t)t * h + d);
            }
        }
        o[d] = v;
        sq += v * v;
    }
    partial[threadIdx.x] = sq;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (normalize) {
        const float scale = 1.0f / fmaxf(sqrtf(partial[0]), 1e-12f);
        for (unsigned int d = threadIdx.x; d < dims; d += blockDim.x) o[d] *= scale;
    }
}

extern "C" __global__ void pool_normalize_f32(const float* hidden, const unsigned int* starts,
                                              const unsigned int* lengths, unsigned int h,
                                              unsigned int dims, unsigned int mode,
                                              unsigned int normalize, float* out) {
    pool_normalize(hidden, starts, lengths, h, dims, mode, normalize, out);
}

extern "C" __global__ void pool_normalize_bf16(const __nv_bfloat16* hidden,
                                               const unsigned int* starts,
                                               const unsigned int* lengths, unsigned int h,
                                               unsigned int dims, unsigned int mode,
                                               unsigned int normalize, float* out) {
    pool_normalize(hidden, starts, lengths, h, dims, mode, normalize, out);
}
