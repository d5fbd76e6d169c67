// Attention over packed rows (no padding), FlashAttention-2's algorithm on tensor cores.
//
// Q [tokens, q_heads·D], K and V [tokens, kv_heads·D] are read in place through their row
// strides (column slices of one fused QKV projection); the output is contiguous
// [tokens, q_heads·D]. A row is tokens start .. start+len; a row that continues a shared prefix
// (a Qwen3 rerank's template, instruction and query) attends to the prefix's keys first, all of
// them visible, then to its own. Causal rows see own keys 0..i; bidirectional ones all own keys.
//
// One block per (tile of 64 queries of one row, query head): 4 warps of 16 query rows each.
// Keys and values stream through shared memory in tiles of 64 (cp.async, double-buffered); per
// tile S = Q·Kᵀ and O += P·V are mma.sync m16n8k16 with f32 accumulators, the softmax is online
// (running max and sum per query row, in base 2), P is rounded to T for the second product (as
// FlashAttention-2 does) and O is divided by the row's sum once at the end. The scores are
// never stored, no padding token is computed, and K/V are never copied per query head (grouped
// query heads read their kv head's columns).
//
// Host side (src/inference/attention.rs): `rows` holds 4 u32 per row (start, len, prefix start,
// prefix len; the prefix len is 0 without one) and `tiles` 2 u32 per tile (row, first query),
// longest work first; a flat grid of tiles × q_heads blocks, block b serving tile b / q_heads
// and head b % q_heads (the order holds across heads, and the query heads of one kv head run
// side by side and share its K/V in L2); 128 threads, (64 + 4·64)·(D+8)·sizeof(T) bytes of
// dynamic shared memory. Rows of shared memory are padded by 8 elements so ldmatrix's eight
// 16-byte rows fall in distinct banks. A warp whose 16 query rows are all past the row's end
// (short rows) only takes part in the block's copies and barriers.
#include "fantom.cuh"

struct PackedAttentionParams {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const unsigned int* rows;
    const unsigned int* tiles;
    unsigned int q_stride;    // elements from one token's Q to the next's
    unsigned int k_stride;
    unsigned int v_stride;
    unsigned int out_stride;
    unsigned int group;       // query heads per kv head
    unsigned int causal;
    float scale_log2;         // softmax scale × log2(e)
    unsigned int q_heads;
};

namespace fantom {

constexpr int ATT_BM = 64;        // queries per block
constexpr int ATT_BN = 64;        // keys per tile
constexpr int ATT_THREADS = 128;  // 4 warps × 16 query rows

__device__ __forceinline__ unsigned int umin(unsigned int a, unsigned int b) { return a < b ? a : b; }

template <typename T, int D>
__device__ __forceinline__ void packed_attention(const PackedAttentionParams& p) {
    constexpr int SROW = D + 8;  // a shared-memory row, padded
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
    FANTOM_DYNAMIC_SMEM(T, smem);
    T* sQ = smem;                          // [BM][SROW]: Q, later the output tile
    T* sK = smem + ATT_BM * SROW;          // [2][BN][SROW]
    T* sV = sK + 2 * ATT_BN * SROW;        // [2][BN][SROW]

    const unsigned int tile = blockIdx.x / p.q_heads, head = blockIdx.x % p.q_heads;
    const unsigned int row = p.tiles[2 * tile], m0 = p.tiles[2 * tile + 1];
    const unsigned int start = p.rows[4 * row], len = p.rows[4 * row + 1];
    const unsigned int pre_start = p.rows[4 * row + 2], pre_len = p.rows[4 * row + 3];
    const unsigned int kv_head = head / p.group;
    const unsigned int m_rows = umin(ATT_BM, len - m0);  // queries of this tile that exist
    const unsigned int own_keys = p.causal ? umin(len, m0 + ATT_BM) : len;
    const unsigned int pre_tiles = (pre_len + ATT_BN - 1) / ATT_BN;
    const unsigned int n_tiles = pre_tiles + (own_keys + ATT_BN - 1) / ATT_BN;

    const T* q = static_cast<const T*>(p.q) + (size_t)(start + m0) * p.q_stride + (size_t)head * D;
    const T* k_base = static_cast<const T*>(p.k) + (size_t)kv_head * D;
    const T* v_base = static_cast<const T*>(p.v) + (size_t)kv_head * D;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    // Whether any of this warp's 16 query rows exists (uniform across the warp).
    const bool active = static_cast<unsigned int>(warp * 16) < m_rows;

    // Rows [first, first + 64) of a [tokens, ·] matrix into a shared tile; rows from `valid` on
    // are zeros (never read from global memory).
    auto load_tile = [&](T* dst, const T* src, unsigned int stride, unsigned int valid) {
        for (int c = tid; c < ATT_BN * CHUNKS; c += ATT_THREADS) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
            const bool ok = static_cast<unsigned int>(r) < valid;
            cp_async_16(dst + r * SROW + col, ok ? src + (size_t)r * stride + col : src, ok);
        }
    };
    // Key tile i: the prefix's tiles first, then the row's own.
    auto load_kv = [&](unsigned int i, int buf) {
        const bool pre = i < pre_tiles;
        const unsigned int n0 = (pre ? i : i - pre_tiles) * ATT_BN;
        const unsigned int token = (pre ? pre_start : start) + n0;
        const unsigned int valid = umin(ATT_BN, (pre ? pre_len : own_keys) - n0);
        load_tile(sK + buf * ATT_BN * SROW, k_base + (size_t)token * p.k_stride, p.k_stride, valid);
        load_tile(sV + buf * ATT_BN * SROW, v_base + (size_t)token * p.v_stride, p.v_stride, valid);
    };

    load_tile(sQ, q, p.q_stride, m_rows);
    load_kv(0, 0);
    cp_async_commit();

    float o[D / 8][4];
    for (int n = 0; n < D / 8; ++n)
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};  // this lane's part; the quad adds them up at the end
    uint32_t qf[D / 16][4];
    // This lane's two query rows (within the row's own tokens), clamped to the last real one:
    // rows past the end are computed as that one and never written.
    unsigned int qi[2];
    for (int r = 0; r < 2; ++r) qi[r] = umin(m0 + warp * 16 + g + 8 * r, len - 1);

    for (unsigned int i = 0; i < n_tiles; ++i) {
        const int buf = i & 1;
        if (i + 1 < n_tiles) load_kv(i + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // everything but the tile just requested has landed
        __syncthreads();
        if (active) {
            if (i == 0) {
                // Q as A fragments, kept in registers: matrix m of each k-step is rows
                // 8·(m % 2) .. +7, columns 8·(m / 2) .. +7 of the warp's 16 × 16 block.
                for (int kk = 0; kk < D / 16; ++kk) {
                    const int r = warp * 16 + ((lane / 8) % 2) * 8 + lane % 8;
                    ldmatrix_x4(qf[kk], sQ + r * SROW + kk * 16 + (lane / 16) * 8);
                }
            }
            const T* K = sK + buf * ATT_BN * SROW;
            const T* V = sV + buf * ATT_BN * SROW;

            // S = Q·Kᵀ: 16 query rows × 64 keys per warp, 8 fragments of 16 × 8.
            float s[ATT_BN / 8][4];
            for (int n = 0; n < ATT_BN / 8; ++n)
                for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
            for (int kk = 0; kk < D / 16; ++kk) {
                for (int nb = 0; nb < ATT_BN / 16; ++nb) {
                    // Keys 16·nb .. +15 as two B fragments: matrices (keys +0..7, d +0..7),
                    // (keys +0..7, d +8..15), (keys +8..15, d +0..7), (keys +8..15, d +8..15).
                    uint32_t kf[4];
                    const int key = nb * 16 + (lane / 16) * 8 + lane % 8;
                    ldmatrix_x4(kf, K + key * SROW + kk * 16 + ((lane / 8) % 2) * 8);
                    const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
                    mma_16816<T>(s[2 * nb], qf[kk], b0);
                    mma_16816<T>(s[2 * nb + 1], qf[kk], b1);
                }
            }

            // Scale into base 2 and mask: keys past the range's end, and own keys after the query.
            const bool pre = i < pre_tiles;
            const unsigned int n0 = (pre ? i : i - pre_tiles) * ATT_BN;
            const unsigned int valid = umin(ATT_BN, (pre ? pre_len : own_keys) - n0);
            const bool causal_here = !pre && p.causal && n0 + ATT_BN - 1 > m0;
            for (int n = 0; n < ATT_BN / 8; ++n) {
                for (int e = 0; e < 4; ++e) {
                    const unsigned int key = n * 8 + 2 * t + (e & 1);  // within the tile
                    bool visible = key < valid;
                    if (causal_here) visible = visible && n0 + key <= qi[e / 2];
                    s[n][e] = visible ? s[n][e] * p.scale_log2 : -INFINITY;
                }
            }

            // Online softmax per query row (e / 2 picks the lane's row g or g + 8).
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
                for (int n = 0; n < ATT_BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
                mx = warp_max4(mx);
                const float m_new = fmaxf(row_max[r], mx);
                // A row that has seen only masked keys so far keeps a finite base (its p are 0).
                const float base = m_new == -INFINITY ? 0.0f : m_new;
                const float correction = exp2f(row_max[r] - base);
                row_max[r] = m_new;
                float sum = 0.0f;
                for (int n = 0; n < ATT_BN / 8; ++n) {
                    s[n][2 * r] = exp2f(s[n][2 * r] - base);
                    s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - base);
                    sum += s[n][2 * r] + s[n][2 * r + 1];
                }
                row_sum[r] = row_sum[r] * correction + sum;
                for (int n = 0; n < D / 8; ++n) {
                    o[n][2 * r] *= correction;
                    o[n][2 * r + 1] *= correction;
                }
            }

            // O += P·V. The accumulators of two adjacent 8-key fragments are one A fragment of
            // 16 keys (rows g and g + 8, keys 2t, 2t+1 and 8+2t, 9+2t).
            for (int kk = 0; kk < ATT_BN / 16; ++kk) {
                const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                       pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                for (int nd = 0; nd < D / 16; ++nd) {
                    // V transposed: matrices (keys +0..7, d +0..7), (keys +8..15, d +0..7),
                    // (keys +0..7, d +8..15), (keys +8..15, d +8..15).
                    uint32_t vf[4];
                    const int key = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
                    ldmatrix_x4_trans(vf, V + key * SROW + nd * 16 + (lane / 16) * 8);
                    const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
                    mma_16816<T>(o[2 * nd], a, b0);
                    mma_16816<T>(o[2 * nd + 1], a, b1);
                }
            }
        }
        __syncthreads();  // the buffer is free for the tile after next
    }

    // O / row sum, staged through shared memory (each warp its own 16 rows of sQ) so the
    // stores to global memory are 16 bytes each.
    for (int r = 0; r < 2; ++r) {
        const float sum = warp_sum4(row_sum[r]);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int srow = warp * 16 + g + 8 * r;
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<uint32_t*>(sQ + srow * SROW + n * 8 + 2 * t) =
                pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        }
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out) + (size_t)(start + m0) * p.out_stride + (size_t)head * D;
    for (int c = tid; c < ATT_BM * CHUNKS; c += ATT_THREADS) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        if (static_cast<unsigned int>(r) < m_rows) {
            *reinterpret_cast<uint4*>(out + (size_t)r * p.out_stride + col) =
                *reinterpret_cast<const uint4*>(sQ + r * SROW + col);
        }
    }
}

}  // namespace fantom

#define FANTOM_PACKED_ATTENTION(T, NAME, D)                                                   \
    extern "C" __global__ void __launch_bounds__(fantom::ATT_THREADS)                          \
        packed_attention_##NAME##_d##D(PackedAttentionParams p) {                             \
        fantom::packed_attention<T, D>(p);                                                     \
    }

FANTOM_PACKED_ATTENTION(__nv_bfloat16, bf16, 32)
FANTOM_PACKED_ATTENTION(__nv_bfloat16, bf16, 64)
FANTOM_PACKED_ATTENTION(__nv_bfloat16, bf16, 128)
FANTOM_PACKED_ATTENTION(__half, f16, 32)
FANTOM_PACKED_ATTENTION(__half, f16, 64)
FANTOM_PACKED_ATTENTION(__half, f16, 128)
