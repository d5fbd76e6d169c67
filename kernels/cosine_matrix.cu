// The gate's cosine matrix: c[i][j] = a_i . b_j / (|a_i| |b_j|) for probe vectors a [n, d] and a
// fingerprint b [m, d] (f32), 0 where either norm is 0 (as the hub's CPU `cosine`). One block
// per (i, j); blockDim.x must be a power of two (the launcher uses 256). The three sums run in
// f32 per thread and are reduced in shared memory.
#include "fantom.cuh"

extern "C" __global__ void cosine_matrix_f32(const float* a, const float* b, unsigned int n,
                                             unsigned int m, unsigned int d, float* c) {
    FANTOM_DYNAMIC_SMEM(float, sums);  // 3 * blockDim.x
    float* s_dot = sums;
    float* s_aa = sums + blockDim.x;
    float* s_bb = sums + 2 * blockDim.x;
    const unsigned int i = blockIdx.x / m;
    const unsigned int j = blockIdx.x % m;
    if (i >= n) return;
    const float* x = a + (size_t)i * d;
    const float* y = b + (size_t)j * d;
    float dot = 0.0f, aa = 0.0f, bb = 0.0f;
    for (unsigned int k = threadIdx.x; k < d; k += blockDim.x) {
        const float u = x[k], v = y[k];
        dot += u * v;
        aa += u * u;
        bb += v * v;
    }
    s_dot[threadIdx.x] = dot;
    s_aa[threadIdx.x] = aa;
    s_bb[threadIdx.x] = bb;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            s_dot[threadIdx.x] += s_dot[threadIdx.x + s];
            s_aa[threadIdx.x] += s_aa[threadIdx.x + s];
            s_bb[threadIdx.x] += s_bb[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const float na = s_aa[0], nb = s_bb[0];
        c[(size_t)i * m + j] = (na == 0.0f || nb == 0.0f) ? 0.0f : s_dot[0] / (sqrtf(na) * sqrtf(nb));
    }
}
