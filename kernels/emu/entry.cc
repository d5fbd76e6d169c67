// The emulated kernels' one entry point, for the Rust tests (src/inference/emulator.rs): the
// launch the CUDA driver gets (a kernel's name, grid, block, dynamic shared memory and a pointer
// to each parameter), run by the emulator (cuda_emu.h) over host memory. Built by the tests
// themselves: c++ -std=c++20 -O2 -shared -fPIC -pthread -I kernels/emu/include.
#include "cuda_emu.h"

#include "../cosine_matrix.cu"
#include "../layer_ops.cu"
#include "../packed_attention.cu"
#include "../pool_normalize.cu"

namespace {

template <typename... P, size_t... I>
std::tuple<P...> unpack(void** params, std::index_sequence<I...>) {
    return std::tuple<P...>(*static_cast<P*>(params[I])...);
}

template <typename... P>
void run(void (*kernel)(P...), const unsigned int* grid, const unsigned int* block, unsigned int smem,
         void** params) {
    fantom_emu::launch(dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), smem, kernel,
                       unpack<P...>(params, std::index_sequence_for<P...>{}));
}

struct Entry {
    const char* name;
    void (*run)(const unsigned int*, const unsigned int*, unsigned int, void**);
};

#define FANTOM_EMU_KERNEL(k) \
    Entry { #k, [](const unsigned int* g, const unsigned int* b, unsigned int s, void** p) { run(&k, g, b, s, p); } }

const Entry KERNELS[] = {
    FANTOM_EMU_KERNEL(packed_attention_bf16_d32), FANTOM_EMU_KERNEL(packed_attention_bf16_d64),
    FANTOM_EMU_KERNEL(packed_attention_bf16_d128), FANTOM_EMU_KERNEL(packed_attention_f16_d32),
    FANTOM_EMU_KERNEL(packed_attention_f16_d64), FANTOM_EMU_KERNEL(packed_attention_f16_d128),
    FANTOM_EMU_KERNEL(qk_norm_rope_f32), FANTOM_EMU_KERNEL(qk_norm_rope_bf16),
    FANTOM_EMU_KERNEL(qk_norm_rope_f16), FANTOM_EMU_KERNEL(add_rms_norm_f32),
    FANTOM_EMU_KERNEL(add_rms_norm_bf16), FANTOM_EMU_KERNEL(add_rms_norm_f16),
    FANTOM_EMU_KERNEL(swiglu_f32), FANTOM_EMU_KERNEL(swiglu_bf16), FANTOM_EMU_KERNEL(swiglu_f16),
    FANTOM_EMU_KERNEL(pool_normalize_f32), FANTOM_EMU_KERNEL(pool_normalize_bf16),
    FANTOM_EMU_KERNEL(cosine_matrix_f32),
};

std::mutex one_launch_at_a_time;

}  // namespace

// Runs kernel `name`; `readable` holds n_readable (begin, end) address pairs the kernel may read
// through cp.async. Returns 0, or -1 for a kernel this library does not have.
extern "C" int fantom_emu_launch(const char* name, const unsigned int* grid, const unsigned int* block,
                                 unsigned int smem, void** params, const uintptr_t* readable,
                                 unsigned int n_readable) {
    std::lock_guard<std::mutex> lock(one_launch_at_a_time);
    for (const Entry& e : KERNELS) {
        if (std::strcmp(e.name, name) == 0) {
            fantom_emu::readable.clear();
            for (unsigned int i = 0; i < n_readable; ++i) {
                fantom_emu::readable.push_back({readable[2 * i], readable[2 * i + 1]});
            }
            e.run(grid, block, smem, params);
            fantom_emu::readable.clear();
            return 0;
        }
    }
    return -1;
}
