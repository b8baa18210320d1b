// How each GGUF block layout lays out a weight row, for both instruction sets' loops (block_kernel.cpp: AVX2,
// block_kernel_avx512.cpp: AVX-512): row sizes, the fp32 scales and offsets of a row, and the byte-wide helpers
// their decoders share. Only the decoding of codes into vectors of weights differs between the two.
//
// Everything here has internal linkage on purpose: each file compiles its own copy for its own instruction set,
// so that a function built for AVX-512 can never be the one the linker picks for a CPU without it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "block_kernel.h"

namespace moaspec {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsAtOnce = 4;  // weight rows decoded together

// 32 bytes from q, each shifted right by `shift` and masked to `mask` (a byte-wide mask: the 16-bit shift's
// spill from the next byte is masked away).
inline __m256i bits_of(const uint8_t* q, int shift, int mask) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// Asks for every 64-byte cache line of [p, p + bytes) ahead of its use.
inline void prefetch(const uint8_t* p, int64_t bytes) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
    for (uintptr_t at = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; at < end; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
}

template <int Bits>
constexpr int64_t block_bytes() { return Bits == 4 ? kBlock / 2 : kBlock; }

// n fp16 values widened to fp32 (exactly), 8 at a time: the scales and offsets of a few weight rows, once, so
// that the block loops broadcast fp32 values instead of converting one half per block. `offsets`: whether to
// widen m too (8-bit blocks have none).
template <bool Offsets>
void widen(const uint16_t* d, const uint16_t* m, int64_t n, float* df, float* mf) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(df + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i))));
        if constexpr (Offsets)
            _mm256_storeu_ps(mf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i))));
    }
    for (; i < n; ++i) {
        df[i] = _cvtsh_ss(d[i]);
        if constexpr (Offsets) mf[i] = _cvtsh_ss(m[i]);
    }
}

// Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit minima (ggml's get_scale_min_k4, for all 16 at
// once): bytes 0..7 of the result are the scales, 8..15 the minima. `s` must be readable for 16 bytes.
//   j < 4:  scale s[j] & 63,                        min s[j + 4] & 63
//   j >= 4: scale (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,  min (s[j + 4] >> 4) | (s[j] >> 6) << 4
inline __m128i k_scales(const uint8_t* s) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low_mask = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i high_nibbles = _mm_and_si128(_mm_srli_epi16(low, 4),  // the minima j >= 4: s[j + 4] >> 4
                                               _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i two_bits = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30));  // (top >> 6) << 4
    return _mm_or_si128(_mm_or_si128(_mm_and_si128(low, low_mask), high_nibbles), two_bits);
}

// A layout's row: its code bytes for `blocks` blocks of 32, and `widen_row`, which turns a row's stored scales into
// fp32 (scale, offset) pairs, kSlots per block of 32 (Q6_K scales every 16 weights), from which each decoder
// rebuilds block b's 32 weights exactly as GGUF dequantises them (ggml's dequantize_row_* functions).
template <int Bits>
struct Geometry {  // Q4_0/Q4_1 (4) and Q8_0 (8): fp16 scale and offset per block, read as they are
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 1;  // blocks of 32 per stored scale
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks * block_bytes<Bits>(); }
    static void widen_row(const uint8_t*, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df, float* mf) {
        widen<Bits == 4>(d, m, blocks, df, mf);
    }
};

template <>
struct Geometry<kQ5> {  // Q5_0/Q5_1: per block 4 bytes of fifth bits (bit i: element i), then 16 as Q4's
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 1;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks * 20; }
    static void widen_row(const uint8_t*, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df, float* mf) {
        widen<true>(d, m, blocks, df, mf);
    }
};

template <>
struct Geometry<kQ8M> {  // signed 8-bit codes with an fp16 offset per block: weight d*q + m
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 1;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks * kBlock; }
    static void widen_row(const uint8_t*, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df, float* mf) {
        widen<true>(d, m, blocks, df, mf);
    }
};

template <int Bits>
struct KGeometry {  // Q4_K (4) and Q5_K (5): super-blocks of 256 whose fp16 d and dmin are the scales and offsets;
    // per super-block, the codes hold the 12 scale bytes, Q5_K's 32 bytes of fifth bits, then 128 of nibbles.
    // Block j of 8 has weights d*sc_j*q - dmin*m_j: d*sc_j and dmin*m_j are exact in fp32 (17 bits), so is d*sc_j*q
    // (at most 22), and the one rounding, fma(q, d*sc_j, -dmin*m_j), is that of ggml's d*sc_j*q - dmin*m_j.
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 8;
    static constexpr int64_t kHigh = Bits == 5 ? 32 : 0;
    static constexpr int64_t kSuper = 12 + kHigh + 128;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks / 8 * kSuper; }
    static void widen_row(const uint8_t* row, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df,
                          float* mf) {
        for (int64_t s = 0; s < blocks / 8; ++s) {  // 8 scales d*sc_j and offsets -(dmin*m_j) per super-block
            const __m128i sm = k_scales(row + s * kSuper);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
            _mm256_storeu_ps(df + 8 * s, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d[s])), sc));
            _mm256_storeu_ps(mf + 8 * s, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(m[s])), mn),
                                                       _mm256_set1_ps(-0.0f)));
        }
    }
    // Where block b's codes are: its 32 nibble bytes (blocks 2i and 2i+1 share them: low and high nibbles), and
    // for Q5_K the 32 bytes whose bit b % 8 is its elements' fifth bits.
    static const uint8_t* nibbles(const uint8_t* row, int64_t b) {
        return row + b / 8 * kSuper + 12 + kHigh + 32 * (b % 8 / 2);
    }
    static const uint8_t* fifth_bits(const uint8_t* row, int64_t b) { return row + b / 8 * kSuper + 12; }
};

template <>
struct Geometry<kQ4K> : KGeometry<4> {};
template <>
struct Geometry<kQ5K> : KGeometry<5> {};

template <>
struct Geometry<kQ6K> {  // super-blocks of 256 whose fp16 d is the scale (offsets unused): per super-block the codes
    // hold 128 bytes of low nibbles, 64 of 2-bit high parts, then 16 signed 8-bit scales, one per 16 weights.
    // Weight = d*sc*(q - 32): d*sc is exact in fp32 (18 bits), so is its product with q - 32 (at most 23), and
    // fma(q, d*sc, -32*d*sc) rounds that exact value to itself.
    static constexpr int64_t kSlots = 2;
    static constexpr int64_t kPerScale = 8;
    static constexpr int64_t kSuper = 208;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks / 8 * kSuper; }
    static void widen_row(const uint8_t* row, const uint16_t* d, const uint16_t*, int64_t blocks, float* df,
                          float* mf) {
        for (int64_t s = 0; s < blocks / 8; ++s) {  // block b of the super-block: scales 2b and 2b + 1 (see codes)
            const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + s * kSuper + 192));
            const __m256 ds = _mm256_set1_ps(_cvtsh_ss(d[s])), minus32 = _mm256_set1_ps(-32.0f);
            const __m256 v0 = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            const __m256 v1 = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
            _mm256_storeu_ps(df + 16 * s, v0);
            _mm256_storeu_ps(df + 16 * s + 8, v1);
            _mm256_storeu_ps(mf + 16 * s, _mm256_mul_ps(minus32, v0));
            _mm256_storeu_ps(mf + 16 * s + 8, _mm256_mul_ps(minus32, v1));
        }
    }
    // Block b's 32 six-bit codes, one a byte in element order.
    static __m256i codes(const uint8_t* row, int64_t b) {
        const int h = static_cast<int>(b % 8) / 4, j = static_cast<int>(b % 4);  // half of 128, block of 32 in it
        const uint8_t* super = row + b / 8 * kSuper;
        const uint8_t* low = super + 64 * h + 32 * (j & 1);  // element l of block j: nibble j/2 of low[l]
        const uint8_t* high = super + 128 + 32 * h;          // and bits 2j, 2j+1 of high[l]
        return _mm256_or_si256(bits_of(low, 4 * (j >> 1), 0x0F), _mm256_slli_epi16(bits_of(high, 2 * j, 3), 4));
    }
};

// The several-row loops' first half, for either instruction set: weight rows n .. n + rows - 1 decoded into `buf` (K
// floats each) by `decode_block(row, b, df, mf, out)`, which writes block b's 32 weights to out, while the next
// `later` rows' codes are fetched; df and mf hold one row's fp32 scales and offsets at a time.
template <class L, class DecodeBlock>
void decode_rows(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t n, int64_t rows, int64_t later,
                 int64_t K, float* buf, float* df, float* mf, DecodeBlock decode_block) {
    const int64_t blocks = K / kBlock, qrow = L::row_bytes(blocks), srow = blocks / L::kPerScale;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = n + r;
        if (r < later) prefetch(q + (row + kRowsAtOnce) * qrow, qrow);
        L::widen_row(q + row * qrow, d + row * srow, m + row * srow, blocks, df, mf);
        for (int64_t b = 0; b < blocks; ++b) decode_block(q + row * qrow, b, df, mf, buf + r * K + b * kBlock);
    }
}

}  // namespace
}  // namespace moaspec
