// What block_kernel.cpp (the products) and decode_layers.cpp (the layers around them) share.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

namespace moaspec {

// Block layouts beyond the 4- and 8-bit codes of blocks of 32 (BlockView::bits; block_kernel.cpp's Layout says how
// each is stored): 5-bit codes of Q5_0/Q5_1, the K-quants' super-blocks of 256, and 8-bit codes with offsets (a
// fused q/k/v whose Q4_1 or Q5_1 parts sit beside a Q8_0 one).
constexpr int kQ5 = 5, kQ4K = 0x104, kQ5K = 0x105, kQ6K = 0x106, kQ8M = 0x108;

// A weight [rows, cols] as GGUF-style blocks of 32 along cols: codes, and one fp16 scale and offset per block (per
// super-block of 256 for the K-quants).
struct BlockView {
    int bits;  // 4: two codes a byte (ggml's nibble order); 8: one signed code a byte, no offset; or a layout above
    const uint8_t* codes;
    const uint16_t* scales;   // fp16 bits
    const uint16_t* offsets;  // fp16 bits; not read for 8-bit codes
    int64_t rows, cols;
};

// Checks a tensor handed in from Python before its data pointer is read: defined, strided, on the CPU, of
// `dtype` and `dim` dimensions, and contiguous unless `contiguous` is false (the caller checks its strides);
// `what` names it in the error. A meta or CUDA tensor's pointer read as host memory is a segfault, not an error.
void check_tensor(const torch::Tensor& t, c10::ScalarType dtype, int64_t dim, const char* what, bool contiguous = true);

// A view of the tensors' data, checked; the tensors must outlive it.
BlockView block_view(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets, int64_t bits);

// y[M, w.rows] = x[M, w.cols] @ W.T in fp32, threads through at::parallel_for; each y[i, n] bitwise
// independent of M and of the thread count.
void block_product(const float* x, int64_t M, const BlockView& w, float* y);

// block_kernel_avx512.cpp: whether this CPU (and this build) runs its 16-lane loops, and y[:, n0:n1] of
// block_product by them, with `scratch` holding avx512_scratch(w.cols) floats.
bool avx512_supported();
void block_rows_avx512(const float* x, int64_t M, const BlockView& w, float* y, int64_t n0, int64_t n1, float* scratch);
inline int64_t avx512_scratch(int64_t cols) { return 4 * cols + cols / 2 + 64; }

// The fixed reduction of an 8-lane accumulator: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
inline float reduce(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Adds decode_layers.cpp's Layers class to the extension module.
void register_layers(pybind11::module& module);

}  // namespace moaspec
