// Products of fp32 activations with GGUF-style block-quantised weights, in fp32 arithmetic.
//
// Weights stay packed as blocks of 32 along the input dimension: 4-bit codes (Q4_0, Q4_1) or 8-bit
// ones (Q8_0), each block with a scale d and an offset m stored in fp16 as GGUF stores them (8-bit blocks
// have no offset: m = 0 is not read). Every weight is rebuilt in registers as fma(q, d, m) (d*q for 8-bit
// codes), which is exactly the fp32 dequantisation d*q + m (fp16 widens to fp32 exactly, and d*q needs at
// most 19 significant bits, so it is exact and the one rounding is the sum's), and multiplied with fp32
// activations into fp32 accumulators. Nothing is rounded to 8 or 16 bits: results differ from a product with the dequantised
// fp32 matrix only by the order of the fp32 sums.
//
// Every output y[m, n] is one 8-lane accumulator over the input in a fixed order, reduced in a fixed
// tree, whatever the number of rows m or the thread that computes it. So a row's result is bitwise the
// same in a product of 1 row or of 64, which lossless speculative decoding needs: a verification of k
// tokens must score each token exactly as a step of plain decoding does.
//
// Two loops compute that same arithmetic. One row (a decoding step): weight rows 4 at a time, each
// block decoded in registers and used at once, 4 independent accumulators. Several rows (a
// verification): 4 weight rows decoded once into a small buffer that stays in L1, then 3 x 4 tiles of
// (activation row, weight row) accumulators read it, so the decoding is paid once for every row.
// Threads split the weight rows through ATen's own pool (at::parallel_for), never torch's other work.
// Both loops prefetch the next group's codes while they use this group's: without it a step's products
// streamed Q4 and Q8 blocks from memory at half the speed they ran from cache (benchmarks/block_types.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "block_kernel.h"

namespace moaspec {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsAtOnce = 4;    // weight rows decoded together
constexpr int64_t kActTile = 3;       // activation rows per tile of the several-row loop

// Every layout but the 8-bit ones first gathers a block's 32 codes into the bytes of one vector, with a few
// byte-wide shifts and masks for all 32 at once; only the widening below works lane by lane.

// 32 codes of 0..255, one a byte in element order (elements 0..15 in `lo`, 16..31 in `hi`), as four 8-lane
// vectors of fma(q, d, m): the exact weights. Elements 0..15 take the scale and offset (d0, m0), elements 16..31
// (d1, m1): Q6_K scales every 16 weights.
inline void widen_codes(__m128i lo, __m128i hi, __m256 d0, __m256 m0, __m256 d1, __m256 m1, __m256 w[4]) {
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d0, m0);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d0, m0);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d1, m1);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d1, m1);
}

inline void widen_codes(__m256i codes, __m256 d0, __m256 m0, __m256 d1, __m256 m1, __m256 w[4]) {
    widen_codes(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1), d0, m0, d1, m1, w);
}

inline void widen_codes(__m256i codes, __m256 d, __m256 m, __m256 w[4]) { widen_codes(codes, d, m, d, m, w); }

// 32 bytes from q, each shifted right by `shift` and masked to `mask` (a byte-wide mask: the 16-bit shift's
// spill from the next byte is masked away).
inline __m256i bits_of(const uint8_t* q, int shift, int mask) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// Byte i: 16 where bit i of `bits` is set, else 0 (Q5_0/Q5_1's fifth bits of 16 elements).
inline __m128i fifth_bits(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),  // byte i: bits' byte i / 8
                                            _mm_set_epi64x(0x0101010101010101, 0));
    const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte i: bit i % 8
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16));
}

// A block of 32 4-bit codes in 16 bytes, plus a fifth bit each where `Fifth` (Q5_0/Q5_1: bit i of `high` is element
// i's): low nibbles are elements 0..15, high nibbles 16..31 (ggml's order).
template <bool Fifth>
inline void small_codes(const uint8_t* q, uint32_t high, __m256 d, __m256 m, __m256 w[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if constexpr (Fifth) {
        lo = _mm_or_si128(lo, fifth_bits(high));
        hi = _mm_or_si128(hi, fifth_bits(high >> 16));
    }
    widen_codes(lo, hi, d, m, d, m, w);
}

// The 32 weights of one block as four 8-lane vectors: exactly fma(q, d, m) for 4-bit codes, d*q for 8-bit ones.
template <int Bits>
inline void decode_block(const uint8_t* q, float d, float m, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(d);
    if constexpr (Bits == 4) {  // ggml's order: low nibbles are elements 0..15, high nibbles 16..31
        small_codes<false>(q, 0, vd, _mm256_set1_ps(m), w);
    } else {  // signed 8-bit codes, in order
        for (int j = 0; j < 4; ++j) {
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
        }
    }
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
// that the block loops broadcast fp32 values instead of converting one half per block.
template <int Bits>
void widen(const uint16_t* d, const uint16_t* m, int64_t n, float* df, float* mf) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(df + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i))));
        if constexpr (Bits == 4)
            _mm256_storeu_ps(mf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i))));
    }
    for (; i < n; ++i) {
        df[i] = _cvtsh_ss(d[i]);
        if constexpr (Bits == 4) mf[i] = _cvtsh_ss(m[i]);
    }
}

// How each layout (BlockView::bits) lays out a row and decodes its blocks of 32. `widen` turns a row's stored
// scales into fp32 (scale, offset) pairs, kSlots per block of 32 (Q6_K scales every 16 weights); `decode` rebuilds
// block b's 32 weights from them, exactly as GGUF dequantises them (ggml's dequantize_row_* functions).
template <int Bits>
struct Layout {  // Q4_0/Q4_1 (4) and Q8_0 (8): fp16 scale and offset per block, read as they are
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 1;  // blocks of 32 per stored scale
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks * block_bytes<Bits>(); }
    static void widen_row(const uint8_t*, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df, float* mf) {
        widen<Bits>(d, m, blocks, df, mf);
    }
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        decode_block<Bits>(row + b * block_bytes<Bits>(), df[b], mf[b], w);
    }
};

template <>
struct Layout<kQ5> {  // Q5_0/Q5_1: per block 4 bytes of fifth bits (bit i: element i), then 16 as Q4's
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 1;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks * 20; }
    static void widen_row(const uint8_t*, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df, float* mf) {
        widen<4>(d, m, blocks, df, mf);
    }
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const uint8_t* q = row + b * 20;
        uint32_t high;
        std::memcpy(&high, q, 4);
        small_codes<true>(q + 4, high, _mm256_set1_ps(df[b]), _mm256_set1_ps(mf[b]), w);
    }
};

template <>
struct Layout<kQ8M> {  // signed 8-bit codes with an fp16 offset per block: fma(q, d, m), exact as for 4-bit codes
    static constexpr int64_t kSlots = 1;
    static constexpr int64_t kPerScale = 1;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks * kBlock; }
    static void widen_row(const uint8_t*, const uint16_t* d, const uint16_t* m, int64_t blocks, float* df, float* mf) {
        widen<4>(d, m, blocks, df, mf);
    }
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const uint8_t* q = row + b * kBlock;
        const __m256 vd = _mm256_set1_ps(df[b]), vm = _mm256_set1_ps(mf[b]);
        for (int j = 0; j < 4; ++j) {
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
            w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd, vm);
        }
    }
};

// Q4_K/Q5_K's 12 bytes of eight 6-bit scales and minima (ggml's get_scale_min_k4).
inline void k_scales(const uint8_t* s, int j, int& scale, int& min) {
    if (j < 4) {
        scale = s[j] & 63;
        min = s[j + 4] & 63;
    } else {
        scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

template <int Bits>
struct KLayout {  // Q4_K (4) and Q5_K (5): super-blocks of 256 whose fp16 d and dmin are the scales and offsets;
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
        for (int64_t s = 0; s < blocks / 8; ++s) {
            const float ds = _cvtsh_ss(d[s]), ms = _cvtsh_ss(m[s]);
            for (int j = 0; j < 8; ++j) {
                int scale, min;
                k_scales(row + s * kSuper, j, scale, min);
                df[8 * s + j] = ds * static_cast<float>(scale);
                mf[8 * s + j] = -(ms * static_cast<float>(min));
            }
        }
    }
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const int j = static_cast<int>(b % 8);
        const uint8_t* super = row + b / 8 * kSuper;
        const uint8_t* nibbles = super + 12 + kHigh + 32 * (j / 2);  // blocks 2i and 2i+1 share 32 bytes
        __m256i code = bits_of(nibbles, 4 * (j & 1), 0x0F);
        if constexpr (Bits == 5)  // bit j of high byte l is block j's element l
            code = _mm256_or_si256(code, _mm256_slli_epi16(bits_of(super + 12, j, 1), 4));
        widen_codes(code, _mm256_set1_ps(df[b]), _mm256_set1_ps(mf[b]), w);
    }
};

template <>
struct Layout<kQ4K> : KLayout<4> {};
template <>
struct Layout<kQ5K> : KLayout<5> {};

template <>
struct Layout<kQ6K> {  // super-blocks of 256 whose fp16 d is the scale (offsets unused): per super-block the codes
    // hold 128 bytes of low nibbles, 64 of 2-bit high parts, then 16 signed 8-bit scales, one per 16 weights.
    // Weight = d*sc*(q - 32): d*sc is exact in fp32 (18 bits), so is its product with q - 32 (at most 23), and
    // fma(q, d*sc, -32*d*sc) rounds that exact value to itself.
    static constexpr int64_t kSlots = 2;
    static constexpr int64_t kPerScale = 8;
    static constexpr int64_t kSuper = 208;
    static constexpr int64_t row_bytes(int64_t blocks) { return blocks / 8 * kSuper; }
    static void widen_row(const uint8_t* row, const uint16_t* d, const uint16_t*, int64_t blocks, float* df,
                          float* mf) {
        for (int64_t s = 0; s < blocks / 8; ++s) {
            const float ds = _cvtsh_ss(d[s]);
            const int8_t* sc = reinterpret_cast<const int8_t*>(row + s * kSuper + 192);
            for (int i = 0; i < 16; ++i) {  // block b of the super-block: scales 2b and 2b+1 (see decode)
                const int h = i / 8, j = (i % 8) / 2, t = i % 2;  // half, block of the half, which 16
                const float v = ds * static_cast<float>(sc[8 * h + 2 * j + t]);
                df[16 * s + i] = v;
                mf[16 * s + i] = -32.0f * v;
            }
        }
    }
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const int h = static_cast<int>(b % 8) / 4, j = static_cast<int>(b % 4);  // half of 128, block of 32 in it
        const uint8_t* super = row + b / 8 * kSuper;
        const uint8_t* low = super + 64 * h + 32 * (j & 1);  // element l of block j: nibble j/2 of low[l]
        const uint8_t* high = super + 128 + 32 * h;          // and bits 2j, 2j+1 of high[l]
        const __m256i code = _mm256_or_si256(bits_of(low, 4 * (j >> 1), 0x0F),
                                             _mm256_slli_epi16(bits_of(high, 2 * j, 3), 4));
        widen_codes(code, _mm256_set1_ps(df[2 * b]), _mm256_set1_ps(mf[2 * b]), _mm256_set1_ps(df[2 * b + 1]),
                    _mm256_set1_ps(mf[2 * b + 1]), w);
    }
};

// y[0, n0:n1] for one activation row: weight rows in fours, each block decoded in registers and used at once.
template <int Kind>
void one_row(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m, float* y,
             int64_t K, int64_t n0, int64_t n1) {
    using L = Layout<Kind>;
    const int64_t blocks = K / kBlock, qrow = L::row_bytes(blocks), srow = blocks / L::kPerScale;
    const int64_t slots = blocks * L::kSlots;  // fp32 (scale, offset) pairs of a row
    std::vector<float> widened(2 * kRowsAtOnce * slots, 0.0f);
    float* d0 = widened.data();
    float* m0 = d0 + kRowsAtOnce * slots;
    int64_t n = n0;
    const int64_t group = kRowsAtOnce * qrow, stride = group / blocks;  // a group of rows' code bytes, contiguous
    for (; n + kRowsAtOnce <= n1; n += kRowsAtOnce) {
        const uint8_t* q0 = q + n * qrow;
        for (int64_t r = 0; r < kRowsAtOnce; ++r)
            L::widen_row(q0 + r * qrow, d + (n + r) * srow, m + (n + r) * srow, blocks, d0 + r * slots, m0 + r * slots);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        // the next group's codes, fetched while this group's are used: a block's share of them (64 to 128 bytes)
        const uint8_t* ahead = q0 + (n + 2 * kRowsAtOnce <= n1 ? group : 0);
        for (int64_t b = 0; b < blocks; ++b) {
            prefetch(ahead + b * stride, stride);
            const float* xb = x + b * kBlock;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                         x3 = _mm256_loadu_ps(xb + 24);
            __m256 w[4];
#define MOASPEC_ROW(r, acc)                                                                          \
            L::decode(q0 + (r) * qrow, b, d0 + (r) * slots, m0 + (r) * slots, w);                         \
            acc = _mm256_fmadd_ps(w[0], x0, acc);                                                     \
            acc = _mm256_fmadd_ps(w[1], x1, acc);                                                     \
            acc = _mm256_fmadd_ps(w[2], x2, acc);                                                     \
            acc = _mm256_fmadd_ps(w[3], x3, acc);
            MOASPEC_ROW(0, a0)
            MOASPEC_ROW(1, a1)
            MOASPEC_ROW(2, a2)
            MOASPEC_ROW(3, a3)
#undef MOASPEC_ROW
        }
        y[n] = reduce(a0);
        y[n + 1] = reduce(a1);
        y[n + 2] = reduce(a2);
        y[n + 3] = reduce(a3);
    }
    for (; n < n1; ++n) {
        __m256 acc = _mm256_setzero_ps();
        L::widen_row(q + n * qrow, d + n * srow, m + n * srow, blocks, d0, m0);
        for (int64_t b = 0; b < blocks; ++b) {
            __m256 w[4];
            L::decode(q + n * qrow, b, d0, m0, w);
            for (int j = 0; j < 4; ++j) acc = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + b * kBlock + 8 * j), acc);
        }
        y[n] = reduce(acc);
    }
}

// y[:, n0:n1] for M activation rows: weight rows decoded in fours into `buf` (4 x K floats), then tiles of
// kActTile activation rows x 4 weight rows, each (row, weight row) one accumulator as in one_row.
template <int Kind>
void many_rows(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m, float* y,
               int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    using L = Layout<Kind>;
    const int64_t blocks = K / kBlock, qrow = L::row_bytes(blocks), srow = blocks / L::kPerScale;
    std::vector<float> storage(kRowsAtOnce * K + 16), widened(2 * blocks * L::kSlots, 0.0f);
    float* buf = storage.data();
    float* df = widened.data();
    float* mf = df + blocks * L::kSlots;
    for (int64_t n = n0; n < n1; n += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, n1 - n);
        const int64_t later = std::min(kRowsAtOnce, n1 - n - rows);  // the next group's rows, fetched meanwhile
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = n + r;
            if (r < later) prefetch(q + (row + kRowsAtOnce) * qrow, qrow);
            L::widen_row(q + row * qrow, d + row * srow, m + row * srow, blocks, df, mf);
            for (int64_t b = 0; b < blocks; ++b) {
                __m256 w[4];
                L::decode(q + row * qrow, b, df, mf, w);
                for (int j = 0; j < 4; ++j) _mm256_storeu_ps(buf + r * K + b * kBlock + 8 * j, w[j]);
            }
        }
        const float* w0 = buf;
        const float* w1 = buf + (rows > 1 ? 1 : 0) * K;  // short groups read row 0 again; their sums are dropped
        const float* w2 = buf + (rows > 2 ? 2 : 0) * K;
        const float* w3 = buf + (rows > 3 ? 3 : 0) * K;
        int64_t i = 0;
        for (; i + kActTile <= M; i += kActTile) {
            const float* x0 = x + i * K;
            const float* x1 = x0 + K;
            const float* x2 = x1 + K;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
            __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
            __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k), v2 = _mm256_loadu_ps(x2 + k);
                __m256 w = _mm256_loadu_ps(w0 + k);
                a00 = _mm256_fmadd_ps(w, v0, a00); a10 = _mm256_fmadd_ps(w, v1, a10); a20 = _mm256_fmadd_ps(w, v2, a20);
                w = _mm256_loadu_ps(w1 + k);
                a01 = _mm256_fmadd_ps(w, v0, a01); a11 = _mm256_fmadd_ps(w, v1, a11); a21 = _mm256_fmadd_ps(w, v2, a21);
                w = _mm256_loadu_ps(w2 + k);
                a02 = _mm256_fmadd_ps(w, v0, a02); a12 = _mm256_fmadd_ps(w, v1, a12); a22 = _mm256_fmadd_ps(w, v2, a22);
                w = _mm256_loadu_ps(w3 + k);
                a03 = _mm256_fmadd_ps(w, v0, a03); a13 = _mm256_fmadd_ps(w, v1, a13); a23 = _mm256_fmadd_ps(w, v2, a23);
            }
            const __m256 acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
            for (int64_t t = 0; t < kActTile; ++t)
                for (int64_t r = 0; r < rows; ++r) y[(i + t) * N + n + r] = reduce(acc[t][r]);
        }
        for (; i < M; ++i) {
            const float* xi = x + i * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 v = _mm256_loadu_ps(xi + k);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), v, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), v, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), v, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), v, a3);
            }
            const __m256 acc[4] = {a0, a1, a2, a3};
            for (int64_t r = 0; r < rows; ++r) y[i * N + n + r] = reduce(acc[r]);
        }
    }
}

// Weight rows per task: a multiple of kRowsAtOnce, so that tasks never split a group of four.
constexpr int64_t kGrain = 64;

template <int Kind>
void product_into(const float* x, int64_t M, const BlockView& w, float* y) {
    const int64_t K = w.cols, N = w.rows;
    at::parallel_for(0, (N + kGrain - 1) / kGrain, 1, [&](int64_t t0, int64_t t1) {
        const int64_t n0 = t0 * kGrain, n1 = std::min(N, t1 * kGrain);
        if (M == 1)
            one_row<Kind>(x, w.codes, w.scales, w.offsets, y, K, n0, n1);
        else
            many_rows<Kind>(x, w.codes, w.scales, w.offsets, y, M, K, N, n0, n1);
    });
}

}  // namespace

void block_product(const float* x, int64_t M, const BlockView& w, float* y) {
    switch (w.bits) {
        case 4: product_into<4>(x, M, w, y); break;
        case kQ5: product_into<kQ5>(x, M, w, y); break;
        case kQ4K: product_into<kQ4K>(x, M, w, y); break;
        case kQ5K: product_into<kQ5K>(x, M, w, y); break;
        case kQ6K: product_into<kQ6K>(x, M, w, y); break;
        case kQ8M: product_into<kQ8M>(x, M, w, y); break;
        default: product_into<8>(x, M, w, y);
    }
}

// The code bytes of a row of `blocks` blocks of 32 in layout `bits`, and the blocks of 32 per stored scale.
std::pair<int64_t, int64_t> row_layout(int64_t bits, int64_t blocks) {
    switch (bits) {
        case 4: return {Layout<4>::row_bytes(blocks), 1};
        case 8: return {Layout<8>::row_bytes(blocks), 1};
        case kQ5: return {Layout<kQ5>::row_bytes(blocks), 1};
        case kQ4K: return {Layout<kQ4K>::row_bytes(blocks), 8};
        case kQ5K: return {Layout<kQ5K>::row_bytes(blocks), 8};
        case kQ6K: return {Layout<kQ6K>::row_bytes(blocks), 8};
        case kQ8M: return {Layout<kQ8M>::row_bytes(blocks), 1};
        default: TORCH_CHECK(false, "unknown block layout ", bits);
    }
}

void check_tensor(const torch::Tensor& t, c10::ScalarType dtype, int64_t dim, const char* what, bool contiguous) {
    TORCH_CHECK(t.defined() && t.layout() == torch::kStrided && t.device().is_cpu(), what,
                " must be a dense CPU tensor, not ", t.defined() ? t.toString() : "undefined", " on ",
                t.defined() ? t.device().str() : "no device");
    TORCH_CHECK(t.scalar_type() == dtype && t.dim() == dim, what, " must be ", dim, "-D ", c10::toString(dtype),
                ", not ", t.dim(), "-D ", c10::toString(t.scalar_type()));
    TORCH_CHECK(!contiguous || t.is_contiguous(), what, " must be contiguous");
}

BlockView block_view(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m, int64_t bits) {
    check_tensor(q, torch::kUInt8, 2, "codes");
    check_tensor(d, torch::kHalf, 2, "scales");
    check_tensor(m, torch::kHalf, 2, "offsets");
    TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kUInt8 && q.dim() == 2 && q.is_contiguous(),
                "codes must be contiguous 2-D uint8 CPU tensors");
    TORCH_CHECK(d.scalar_type() == torch::kHalf && m.scalar_type() == torch::kHalf && d.dim() == 2 &&
                d.is_contiguous() && m.is_contiguous() && m.sizes() == d.sizes() && d.size(0) == q.size(0),
                "scales and offsets must be contiguous fp16, one per block");
    const int64_t per_scale = row_layout(bits, 8).second, blocks = d.size(1) * per_scale;
    TORCH_CHECK(q.size(1) == row_layout(bits, blocks).first, "codes do not match the scales");
    return BlockView{static_cast<int>(bits), q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                     reinterpret_cast<const uint16_t*>(m.data_ptr()), q.size(0), blocks * kBlock};
}

}  // namespace moaspec

namespace {

torch::Tensor product(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m,
                      int64_t bits) {
    moaspec::check_tensor(x, torch::kFloat32, 2, "x");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                "x must be a contiguous 2-D fp32 CPU tensor");
    const moaspec::BlockView w = moaspec::block_view(q, d, m, bits);
    TORCH_CHECK(x.size(1) == w.cols, "x has ", x.size(1), " columns and the weight ", w.cols);
    auto y = torch::empty({x.size(0), w.rows}, x.options());
    moaspec::block_product(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>());
    return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("product", &product, "y = x @ W.T for block-quantised W in layout `bits` (fp32 arithmetic)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
    moaspec::register_layers(module);
}
