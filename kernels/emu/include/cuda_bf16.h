// The emulator's stand-in for CUDA's cuda_bf16.h (kernels/emu/cuda_emu.h).
#pragma once
#include "../cuda_emu.h"
