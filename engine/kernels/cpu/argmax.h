// torch.argmax's choice over one row of float32 values, shared by the ops that pick a token
// (argmax_rows in pointwise.cpp, which defines it; the sampler's exponential race in sampling.cpp).
#pragma once

#include <cstdint>

namespace inflight_cpu {

// The first index of the row's maximum, NaN counting as the maximum; 0 for a row of -inf only.
int64_t first_argmax(const float* x, int64_t n);

}  // namespace inflight_cpu
