// The CUDA execution model on the CPU, so CI (which has no GPU) runs our kernels' own source.
//
// Every CUDA thread of a block is an OS thread; a launch creates blockDim of them and they run
// the grid's blocks one after another. __syncthreads is a barrier of the block's threads, warp
// collectives (shuffles, mma.sync, ldmatrix) a barrier of the warp's 32 with an exchange of
// their registers, laid out as the PTX ISA lays out fragments. Dynamic shared memory is filled
// with 0xFF (NaN in every float type) before each block, so reading what was never written
// shows. Each warp operation checks what the hardware requires (16-byte aligned ldmatrix rows
// and cp.async operands, rows inside shared memory), and cp.async reads only registered global
// ranges. A barrier that waits more than 30 s (threads that diverged around __syncthreads)
// aborts with a message.
//
// What it cannot show: speed, races the hardware would hide or expose, the real accumulation
// order inside an mma (here sequential in f32), and PTX the driver would refuse. Those stay for
// `fantom-sidecar kernel-check` on a GPU.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <math.h>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef FANTOM_EMU
#define FANTOM_EMU 1
#endif
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Blocks run one at a time, so one copy per kernel is the running block's.
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// --- bf16 and f16 as the CUDA headers name them, rounding to nearest even ---

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
struct __half {
    uint16_t bits;
};
struct __half2 {
    __half x, y;
};

inline float __bfloat162float(__nv_bfloat16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = static_cast<uint16_t>((u >> 16) | 0x40);  // a quiet NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = static_cast<uint16_t>(u >> 16);
    }
    return r;
}

inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16(a), __float2bfloat16(b)};
}

inline float __half2float(__half h) {
    const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
    uint32_t exp = (h.bits >> 10) & 0x1fu;
    uint32_t man = h.bits & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                ++e;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
        }
    } else {
        u = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __half __float2half(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t abs = u & 0x7fffffffu;
    __half r;
    if (abs > 0x7f800000u) {
        r.bits = sign | 0x7e00u;
    } else if (abs >= 0x477ff000u) {  // rounds to ±inf
        r.bits = sign | 0x7c00u;
    } else if (abs < 0x38800000u) {  // below the smallest normal half: a subnormal or zero
        const float a = std::fabs(f);
        // In units of 2^-24, rounded to nearest even by the FPU's default mode.
        const float scaled = std::nearbyint(a * 16777216.0f);
        r.bits = sign | static_cast<uint16_t>(scaled);
    } else {
        uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
        r.bits = sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
    }
    return r;
}

inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half(a), __float2half(b)}; }

namespace fantom_emu {

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "cuda emulator: %s\n", what);
    std::fflush(stderr);
    std::abort();
}

// A reusable barrier that aborts when it waits too long (threads that diverged around it).
class Barrier {
  public:
    explicit Barrier(unsigned int n) : n_(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m_);
        const unsigned long long gen = generation_;
        if (++arrived_ == n_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        if (!cv_.wait_for(lock, std::chrono::seconds(30), [&] { return generation_ != gen; })) {
            fail("a barrier waited 30 s: threads diverged around __syncthreads or a warp collective");
        }
    }

  private:
    std::mutex m_;
    std::condition_variable cv_;
    unsigned int n_;
    unsigned int arrived_ = 0;
    unsigned long long generation_ = 0;
};

struct Warp {
    Barrier bar{32};
    alignas(16) unsigned char slot[32][64];
};

struct Block {
    explicit Block(unsigned int threads, size_t smem_bytes)
        : bar(threads), warps(threads / 32), smem((smem_bytes + 15) / 16 + 1) {}
    Barrier bar;
    std::vector<Warp> warps;
    struct alignas(16) Chunk {
        unsigned char b[16];
    };
    std::vector<Chunk> smem;
    size_t smem_bytes() const { return smem.size() * 16; }
};

struct Range {
    uintptr_t begin, end;
};

inline thread_local dim3 thread_idx;
inline thread_local dim3 block_idx;
inline thread_local Block* block = nullptr;
inline thread_local unsigned int linear_tid = 0;
inline dim3 block_dim;
inline dim3 grid_dim;
// Global memory a launch may read through cp.async (registered by the caller; empty: unchecked).
inline std::vector<Range> readable;

inline void* dynamic_smem() { return block->smem.data(); }
inline unsigned int lane() { return linear_tid % 32; }
inline Warp& warp() { return block->warps[linear_tid / 32]; }

inline bool in_smem(const void* p, size_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(block->smem.data());
    return a >= lo && a + bytes <= lo + block->smem_bytes();
}

// Every lane publishes `mine`; returns what lane `from` published.
template <typename V> inline V exchange(const V& mine, unsigned int from) {
    static_assert(sizeof(V) <= 64, "a warp slot holds 64 bytes");
    Warp& w = warp();
    std::memcpy(w.slot[lane()], &mine, sizeof(V));
    w.bar.wait();
    V got;
    std::memcpy(&got, w.slot[from], sizeof(V));
    w.bar.wait();
    return got;
}

template <typename T> inline float element(uint32_t reg, int high) {
    T v;
    const uint16_t bits = high ? static_cast<uint16_t>(reg >> 16) : static_cast<uint16_t>(reg);
    std::memcpy(&v, &bits, 2);
    if constexpr (sizeof(T) == 2 && std::is_same<T, __nv_bfloat16>::value) {
        return __bfloat162float(v);
    } else {
        return __half2float(v);
    }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += a·b for the warp, the fragments as
// the PTX ISA lays them out (groupID = lane / 4, threadID_in_group = lane % 4).
template <typename T> inline void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    struct Regs {
        uint32_t a[4];
        uint32_t b[2];
    };
    Warp& w = warp();
    const unsigned int l = lane();
    Regs mine;
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    std::memcpy(w.slot[l], &mine, sizeof mine);
    w.bar.wait();
    auto regs = [&](unsigned int from) {
        Regs r;
        std::memcpy(&r, w.slot[from], sizeof r);
        return r;
    };
    // A(row, k): lane (row % 8)·4 + (k % 8)/2, register (row ≥ 8) + 2·(k ≥ 8), half k % 2.
    auto A = [&](int row, int k) {
        return element<T>(regs((row % 8) * 4 + (k % 8) / 2).a[(row >= 8) + 2 * (k >= 8)], k % 2);
    };
    // B(k, n): lane n·4 + (k % 8)/2, register (k ≥ 8), half k % 2.
    auto B = [&](int k, int n) { return element<T>(regs(n * 4 + (k % 8) / 2).b[k >= 8], k % 2); };
    const int g = static_cast<int>(l / 4), t = static_cast<int>(l % 4);
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        float acc = d[i];
        for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        out[i] = acc;
    }
    w.bar.wait();
    std::memcpy(d, out, sizeof out);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0) fail("ldmatrix: a row address is not 16-byte aligned");
    if (!in_smem(row, 16)) fail("ldmatrix: a row lies outside shared memory");
    Warp& w = warp();
    const unsigned int l = lane();
    std::memcpy(w.slot[l], &row, sizeof row);
    w.bar.wait();
    auto at = [&](unsigned int m, unsigned int rr, unsigned int c) {
        const uint16_t* p;
        std::memcpy(&p, w.slot[m * 8 + rr], sizeof p);
        return static_cast<uint32_t>(p[c]);
    };
    uint32_t out[4];
    for (unsigned int i = 0; i < 4; ++i) {
        const unsigned int a = l / 4, b = 2 * (l % 4);
        out[i] = trans ? (at(i, b, a) | at(i, b + 1, a) << 16) : (at(i, a, b) | at(i, a, b + 1) << 16);
    }
    w.bar.wait();
    std::memcpy(r, out, sizeof out);
}

// cp.async.cg.shared.global, 16 bytes, zero-filled when !valid.
inline void copy_16(void* smem, const void* gmem, bool valid) {
    if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 || reinterpret_cast<uintptr_t>(gmem) % 16 != 0) {
        fail("cp.async: an operand is not 16-byte aligned");
    }
    if (!in_smem(smem, 16)) fail("cp.async: the destination lies outside shared memory");
    if (!valid) {
        std::memset(smem, 0, 16);
        return;
    }
    const uintptr_t a = reinterpret_cast<uintptr_t>(gmem);
    if (!readable.empty() &&
        std::none_of(readable.begin(), readable.end(), [&](const Range& r) { return a >= r.begin && a + 16 <= r.end; })) {
        fail("cp.async: a read outside the kernel's inputs");
    }
    std::memcpy(smem, gmem, 16);
}

// Runs `kernel` over `grid` with `threads` per block; `args` are its parameters.
template <typename... P>
inline void launch(dim3 grid, dim3 threads, size_t smem_bytes, void (*kernel)(P...), std::tuple<P...> args) {
    const unsigned int n = threads.x * threads.y * threads.z;
    if (n == 0 || n % 32 != 0 || n > 1024) fail("blocks must hold a whole number of warps, at most 1024 threads");
    grid_dim = grid;
    block_dim = threads;
    Block blk(n, smem_bytes);
    std::memset(blk.smem.data(), 0xff, blk.smem_bytes());
    std::vector<std::thread> pool;
    pool.reserve(n);
    for (unsigned int t = 0; t < n; ++t) {
        pool.emplace_back([&, t] {
            block = &blk;
            linear_tid = t;
            thread_idx = dim3(t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y));
            for (unsigned int z = 0; z < grid.z; ++z)
                for (unsigned int y = 0; y < grid.y; ++y)
                    for (unsigned int x = 0; x < grid.x; ++x) {
                        block_idx = dim3(x, y, z);
                        std::apply(kernel, args);
                        blk.bar.wait();  // the block ends
                        if (t == 0) std::memset(blk.smem.data(), 0xff, blk.smem_bytes());
                        blk.bar.wait();
                    }
        });
    }
    for (auto& th : pool) th.join();
}

}  // namespace fantom_emu

#define threadIdx (fantom_emu::thread_idx)
#define blockIdx (fantom_emu::block_idx)
#define blockDim (fantom_emu::block_dim)
#define gridDim (fantom_emu::grid_dim)

inline void __syncthreads() { fantom_emu::block->bar.wait(); }

template <typename V> inline V __shfl_xor_sync(unsigned int, V v, int lane_mask, int = 32) {
    return fantom_emu::exchange(v, fantom_emu::lane() ^ static_cast<unsigned int>(lane_mask));
}
