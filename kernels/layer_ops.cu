// The elementwise and row steps of a Qwen3 layer, each one pass where candle needs several
// (and a contiguous copy before each): the per-head RMSNorm of Q and K with RoPE, in place on
// the fused QKV rows; the residual add with the next RMSNorm; SwiGLU on the fused gate/up rows.
// Arithmetic is f32 throughout; results are rounded to T once. T is float, bf16 or half.
//
// Host side: src/inference/layer_ops.rs (each kernel's CPU twin and launch).
#include "fantom.cuh"

// Q and K heads of the fused QKV rows, in place: x ← RoPE(RMSNorm(x) · w), one warp per
// (token, head); Q heads are columns h·D, K heads (q_heads + j)·D.
struct QkNormRopeParams {
    void* qkv;                      // [tokens, stride]
    const unsigned int* positions;  // [tokens]
    const void* q_weight;           // [D]
    const void* k_weight;           // [D]
    const float* inv_freq;          // [D / 2]: θ^(−2i/D)
    unsigned int tokens;
    unsigned int stride;
    unsigned int q_heads;
    unsigned int kv_heads;
    unsigned int head_dim;
    float eps;
};

// x + delta and RMSNorm(x + delta) · w, one block per token. mode 0: out is T [2, tokens, width]
// (the sum, then the normed sum); mode 1: out is f32 [tokens, width] (the normed sum); mode 2:
// out is T [tokens, width] (the normed sum). Without delta the sum is x.
struct AddRmsNormParams {
    const void* x;
    const void* delta;  // may be null
    const void* weight;
    void* out;
    unsigned int tokens;
    unsigned int width;
    float eps;
    unsigned int mode;
};

// out[t, j] = silu(gu[t, j]) · gu[t, inter + j].
struct SwigluParams {
    const void* gate_up;  // [tokens, 2·inter]
    void* out;            // [tokens, inter]
    unsigned int tokens;
    unsigned int inter;
};

namespace fantom {

// The most pairs (i, i + D/2) one lane holds: D up to 256.
constexpr int ROPE_PAIRS = 4;

template <typename T> __device__ __forceinline__ float round_trip(float x) {
    return to_float(from_float<T>(x));
}

template <typename T> __device__ __forceinline__ void qk_norm_rope(const QkNormRopeParams& p) {
    const unsigned int warps = blockDim.x / 32;
    const size_t job = (size_t)blockIdx.x * warps + threadIdx.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int heads = p.q_heads + p.kv_heads;
    if (job >= (size_t)p.tokens * heads) return;  // the whole warp
    const unsigned int token = static_cast<unsigned int>(job / heads);
    const unsigned int head = static_cast<unsigned int>(job % heads);
    const unsigned int d = p.head_dim, half = d / 2;
    T* x = static_cast<T*>(p.qkv) + (size_t)token * p.stride + (size_t)head * d;
    const T* w = static_cast<const T*>(head < p.q_heads ? p.q_weight : p.k_weight);
    float lo[ROPE_PAIRS], hi[ROPE_PAIRS];
    float ss = 0.0f;
    for (int k = 0; k < ROPE_PAIRS; ++k) {
        const unsigned int i = lane + 32 * k;
        lo[k] = i < half ? to_float(x[i]) : 0.0f;
        hi[k] = i < half ? to_float(x[i + half]) : 0.0f;
        ss += lo[k] * lo[k] + hi[k] * hi[k];
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + p.eps);
    const float pos = static_cast<float>(p.positions[token]);
    for (int k = 0; k < ROPE_PAIRS; ++k) {
        const unsigned int i = lane + 32 * k;
        if (i >= half) break;
        const float a = lo[k] * inv * to_float(w[i]);
        const float b = hi[k] * inv * to_float(w[i + half]);
        float sn, cs;
        sincosf(pos * p.inv_freq[i], &sn, &cs);
        x[i] = from_float<T>(a * cs - b * sn);
        x[i + half] = from_float<T>(b * cs + a * sn);
    }
}

template <typename T> __device__ __forceinline__ void add_rms_norm(const AddRmsNormParams& p) {
    __shared__ float partial[32];
    const unsigned int token = blockIdx.x;
    const size_t base = (size_t)token * p.width;
    const T* x = static_cast<const T*>(p.x) + base;
    const T* delta = p.delta ? static_cast<const T*>(p.delta) + base : nullptr;
    const T* w = static_cast<const T*>(p.weight);
    // The sum as the unfused path holds it: rounded to T.
    auto sum_at = [&](unsigned int j) {
        return delta ? round_trip<T>(to_float(x[j]) + to_float(delta[j])) : to_float(x[j]);
    };
    float ss = 0.0f;
    for (unsigned int j = threadIdx.x; j < p.width; j += blockDim.x) {
        const float s = sum_at(j);
        ss += s * s;
    }
    ss = warp_sum(ss);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0.0f;
    for (unsigned int k = 0; k < blockDim.x / 32; ++k) total += partial[k];
    const float inv = 1.0f / sqrtf(total / static_cast<float>(p.width) + p.eps);
    for (unsigned int j = threadIdx.x; j < p.width; j += blockDim.x) {
        const float s = sum_at(j);
        const float normed = s * inv * to_float(w[j]);
        if (p.mode == 0) {
            T* out = static_cast<T*>(p.out);
            out[base + j] = from_float<T>(s);
            out[(size_t)p.tokens * p.width + base + j] = from_float<T>(normed);
        } else if (p.mode == 1) {
            static_cast<float*>(p.out)[base + j] = normed;
        } else {
            static_cast<T*>(p.out)[base + j] = from_float<T>(normed);
        }
    }
}

template <typename T> __device__ __forceinline__ void swiglu(const SwigluParams& p) {
    // Columns across x, tokens across y (a stride loop past 65 535 rows): no division.
    const T* gu = static_cast<const T*>(p.gate_up);
    T* out = static_cast<T*>(p.out);
    const unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= p.inter) return;
    for (unsigned int token = blockIdx.y; token < p.tokens; token += gridDim.y) {
        const T* row = gu + (size_t)token * 2 * p.inter;
        const float g = to_float(row[j]);
        const float u = to_float(row[p.inter + j]);
        out[(size_t)token * p.inter + j] = from_float<T>(g / (1.0f + expf(-g)) * u);
    }
}

}  // namespace fantom

#define FANTOM_LAYER_OPS(T, NAME)                                                               \
    extern "C" __global__ void qk_norm_rope_##NAME(QkNormRopeParams p) { fantom::qk_norm_rope<T>(p); } \
    extern "C" __global__ void add_rms_norm_##NAME(AddRmsNormParams p) { fantom::add_rms_norm<T>(p); } \
    extern "C" __global__ void swiglu_##NAME(SwigluParams p) { fantom::swiglu<T>(p); }

FANTOM_LAYER_OPS(float, f32)
FANTOM_LAYER_OPS(__nv_bfloat16, bf16)
FANTOM_LAYER_OPS(__half, f16)
