// block_kernel.cpp's products on CPUs with AVX-512 (F, BW, VL and DQ): the same exact weights and fp32
// arithmetic, in 16-lane vectors, and 4- and 5-bit codes decoded by table lookup.
//
// A block of 4-bit codes with scale d and offset m holds at most 16 distinct weights, fma(i, d, m) for i = 0..15.
// One 16-lane fma builds that table, exactly the values the AVX2 decoder computes code by code, and one permute
// (vpermps, which reads an index's low 4 bits) gives 16 weights from 16 codes: no conversion, no mask for the low
// nibbles. Q5_0/Q5_1 and Q5_K look up in two tables at once (vpermt2ps), after a mask register holding the fifth bits
// sets bit 4 of the codes' bytes. Q8_0 and Q6_K (64 weights per scale) convert 16 codes at a time.
//
// Every output y[m, n] is two 16-lane sums over the input in a fixed order (the first and the last 16 weights of
// each block: two chains of dependent fmas, not one), added and reduced in a fixed tree, in all three loops, so a
// row's result is bitwise the same in a product of 1 row or of 64, as in the AVX2 file. The two files' results
// differ from each other in the order of their fp32 sums: a process uses one of them throughout.
//
// This file is compiled for AVX-512 by the pragma below, not by the command line, so that the build needs no
// other flags; its functions run only where block_kernel.cpp found the CPU able to (avx512_supported). It includes
// no library code after the pragma: an inline function of a library compiled here for AVX-512 could be the copy
// the linker keeps for every caller.

#include "block_kernel.h"

#if defined(__GNUC__) && defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#endif

#include "block_layouts.h"

namespace moaspec {
namespace {

constexpr int64_t kActTile = 4;  // activation rows per tile of the several-row loop (16 accumulators of 32)

inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

inline float reduce16(__m512 v) {  // lanes l and l + 8 first, then block_kernel.h's fixed 8-lane tree
    return reduce(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

inline __m512 iota(float from) {
    return _mm512_add_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_ps(from));
}

// The 16 weights 16 codes stand for: in `table` by the index's low 4 bits, or, for 5-bit codes (0..31, nothing above),
// in `table` and then `fifth` (vpermt2ps looks up in both at once).
inline __m512 look_up(__m512i index, __m512 table) { return _mm512_permutexvar_ps(index, table); }
inline __m512 look_up(__m512i index, __m512 table, __m512 fifth) { return _mm512_permutex2var_ps(table, index, fifth); }

// 16 unsigned byte codes as 16 lanes of fma(q, d, m), or signed ones as d*q (no offset) or fma(q, d, m).
inline __m512 widen16(__m128i bytes, __m512 d, __m512 m) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), d, m);
}
template <bool Offset>
inline __m512 signed16(const uint8_t* q, __m512 d, __m512 m) {
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    if constexpr (Offset) return _mm512_fmadd_ps(c, d, m);
    return _mm512_mul_ps(c, d);
}

// Each layout's AVX-512 decoder: block b's 32 weights, exactly, as two 16-lane vectors.
template <int Kind>
struct Layout16 : Geometry<Kind> {  // Q4_0/Q4_1 (4): table lookup; Q8_0 (8): d*q
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m512 w[2]) {
        const uint8_t* q = row + b * block_bytes<Kind>();
        const __m512 d = _mm512_set1_ps(df[b]);
        if constexpr (Kind == 4) {  // low nibbles are elements 0..15, high nibbles 16..31
            const __m512 table = _mm512_fmadd_ps(iota(0), d, _mm512_set1_ps(mf[b]));
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
            w[0] = look_up(c, table);
            w[1] = look_up(_mm512_srli_epi32(c, 4), table);
        } else {
            w[0] = signed16<false>(q, d, d);
            w[1] = signed16<false>(q + 16, d, d);
        }
    }
};

template <>
struct Layout16<kQ5> : Geometry<kQ5> {  // bit i of the block's first 4 bytes: element i's fifth bit
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m512 w[2]) {
        const uint8_t* q = row + b * 20;
        uint32_t high;
        __builtin_memcpy(&high, q, 4);
        const __m512 d = _mm512_set1_ps(df[b]), m = _mm512_set1_ps(mf[b]);
        const __m512 table = _mm512_fmadd_ps(iota(0), d, m), fifth = _mm512_fmadd_ps(iota(16), d, m);
        // the 5-bit codes as bytes (cheap 16-byte operations), then widened: elements 0..15 and 16..31
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4)), mask = _mm_set1_epi8(0x0F);
        const __m128i sixteen = _mm_set1_epi8(16);
        const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        w[0] = look_up(_mm512_cvtepu8_epi32(_mm_mask_add_epi8(lo, static_cast<__mmask16>(high), lo, sixteen)), table, fifth);
        w[1] = look_up(_mm512_cvtepu8_epi32(_mm_mask_add_epi8(hi, static_cast<__mmask16>(high >> 16), hi, sixteen)), table,
                       fifth);
    }
};

template <>
struct Layout16<kQ8M> : Geometry<kQ8M> {
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m512 w[2]) {
        const uint8_t* q = row + b * kBlock;
        const __m512 d = _mm512_set1_ps(df[b]), m = _mm512_set1_ps(mf[b]);
        w[0] = signed16<true>(q, d, m);
        w[1] = signed16<true>(q + 16, d, m);
    }
};

template <int Kind>
struct KLayout16 : Geometry<Kind> {  // Q4_K and Q5_K: one table per block of 32 (two for Q5_K)
    using G = Geometry<Kind>;
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m512 w[2]) {
        const int j = static_cast<int>(b % 8);
        const __m512 d = _mm512_set1_ps(df[b]), m = _mm512_set1_ps(mf[b]);
        const __m512 table = _mm512_fmadd_ps(iota(0), d, m);
        const uint8_t* nibbles = G::nibbles(row, b);
        if constexpr (Kind == kQ4K) {
            __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)));
            __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles + 16)));
            if (j & 1) {  // odd blocks are the high nibbles (the lookup reads the low 4 bits: even ones need no shift)
                c0 = _mm512_srli_epi32(c0, 4);
                c1 = _mm512_srli_epi32(c1, 4);
            }
            w[0] = look_up(c0, table);
            w[1] = look_up(c1, table);
        } else {  // bit j of high byte l is block j's element l: the 5-bit codes as bytes, then widened
            const __m256i code = _mm256_or_si256(bits_of(nibbles, 4 * (j & 1), 0x0F),
                                                 _mm256_slli_epi16(bits_of(G::fifth_bits(row, b), j, 1), 4));
            const __m512 fifth = _mm512_fmadd_ps(iota(16), d, m);
            w[0] = look_up(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(code)), table, fifth);
            w[1] = look_up(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(code, 1)), table, fifth);
        }
    }
};

template <>
struct Layout16<kQ4K> : KLayout16<kQ4K> {};
template <>
struct Layout16<kQ5K> : KLayout16<kQ5K> {};

template <>
struct Layout16<kQ6K> : Geometry<kQ6K> {  // elements 0..15 take scale slot 2b, 16..31 slot 2b + 1
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m512 w[2]) {
        const __m256i c = codes(row, b);
        w[0] = widen16(_mm256_castsi256_si128(c), _mm512_set1_ps(df[2 * b]), _mm512_set1_ps(mf[2 * b]));
        w[1] = widen16(_mm256_extracti128_si256(c, 1), _mm512_set1_ps(df[2 * b + 1]), _mm512_set1_ps(mf[2 * b + 1]));
    }
};

// y[0, n0:n1] for one activation row: weight rows in fours, each block decoded in registers and used at once.
// `scratch`: the rows' fp32 scales and offsets.
template <int Kind>
void one_row(const float* x, const BlockView& w, float* y, int64_t n0, int64_t n1, float* scratch) {
    using L = Layout16<Kind>;
    const int64_t K = w.cols, blocks = K / kBlock, qrow = L::row_bytes(blocks), srow = blocks / L::kPerScale;
    const int64_t slots = blocks * L::kSlots;
    const uint8_t* q = w.codes;
    const uint16_t *d = w.scales, *m = w.offsets;
    float* d0 = scratch;
    float* m0 = d0 + kRowsAtOnce * slots;
    const int64_t group = kRowsAtOnce * qrow, stride = group / blocks;  // a group of rows' code bytes, contiguous
    int64_t n = n0;
    for (; n + kRowsAtOnce <= n1; n += kRowsAtOnce) {
        const uint8_t* q0 = q + n * qrow;
        for (int64_t r = 0; r < kRowsAtOnce; ++r)
            L::widen_row(q0 + r * qrow, d + (n + r) * srow, m + (n + r) * srow, blocks, d0 + r * slots, m0 + r * slots);
        __m512 a[kRowsAtOnce], e[kRowsAtOnce];
        for (int64_t r = 0; r < kRowsAtOnce; ++r) a[r] = e[r] = _mm512_setzero_ps();
        const uint8_t* ahead = q0 + (n + 2 * kRowsAtOnce <= n1 ? group : 0);  // the next group's codes
        for (int64_t b = 0; b < blocks; ++b) {
            prefetch(ahead + b * stride, stride);
            const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
            for (int64_t r = 0; r < kRowsAtOnce; ++r) {
                __m512 v[2];
                L::decode(q0 + r * qrow, b, d0 + r * slots, m0 + r * slots, v);
                a[r] = _mm512_fmadd_ps(v[0], x0, a[r]);
                e[r] = _mm512_fmadd_ps(v[1], x1, e[r]);
            }
        }
        for (int64_t r = 0; r < kRowsAtOnce; ++r) y[n + r] = reduce16(_mm512_add_ps(a[r], e[r]));
    }
    for (; n < n1; ++n) {
        __m512 a = _mm512_setzero_ps(), e = a;
        L::widen_row(q + n * qrow, d + n * srow, m + n * srow, blocks, d0, m0);
        for (int64_t b = 0; b < blocks; ++b) {
            __m512 v[2];
            L::decode(q + n * qrow, b, d0, m0, v);
            a = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(x + b * kBlock), a);
            e = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(x + b * kBlock + 16), e);
        }
        y[n] = reduce16(_mm512_add_ps(a, e));
    }
}

// y[:, n0:n1] for T = 2..8 activation rows (a short verification's): as one_row, each block decoded in registers and
// used at once by every activation row, R weight rows at a time (R * T * 2 accumulators in registers), with no
// buffer to write and read back. Each output's two sums are one_row's, in its order.
template <int Kind, int T, int R>
void few_rows(const float* x, const BlockView& w, float* y, int64_t n0, int64_t n1, float* scratch) {
    using L = Layout16<Kind>;
    const int64_t K = w.cols, N = w.rows, blocks = K / kBlock, qrow = L::row_bytes(blocks), srow = blocks / L::kPerScale;
    const int64_t slots = blocks * L::kSlots;
    const uint8_t* q = w.codes;
    const uint16_t *d = w.scales, *m = w.offsets;
    float* d0 = scratch;
    float* m0 = d0 + R * slots;
    const int64_t group = R * qrow, stride = group / blocks;
    for (int64_t n = n0; n < n1; n += R) {
        const int64_t rows = smaller(R, n1 - n);  // a short group decodes its last row again; its sums are dropped
        const uint8_t* q0 = q + n * qrow;
        for (int64_t r = 0; r < R; ++r) {
            const int64_t row = n + (r < rows ? r : 0);
            L::widen_row(q + row * qrow, d + row * srow, m + row * srow, blocks, d0 + r * slots, m0 + r * slots);
        }
        __m512 a[T][R], e[T][R];
        for (int t = 0; t < T; ++t)
            for (int r = 0; r < R; ++r) a[t][r] = e[t][r] = _mm512_setzero_ps();
        const uint8_t* ahead = q0 + (n + 2 * R <= n1 ? group : 0);
        for (int64_t b = 0; b < blocks; ++b) {
            prefetch(ahead + b * stride, stride);
            for (int r = 0; r < R; ++r) {
                __m512 v[2];
                L::decode(q + (n + (r < rows ? r : 0)) * qrow, b, d0 + r * slots, m0 + r * slots, v);
                for (int t = 0; t < T; ++t) {
                    a[t][r] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(x + t * K + b * kBlock), a[t][r]);
                    e[t][r] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(x + t * K + b * kBlock + 16), e[t][r]);
                }
            }
        }
        for (int t = 0; t < T; ++t)
            for (int64_t r = 0; r < rows; ++r) y[t * N + n + r] = reduce16(_mm512_add_ps(a[t][r], e[t][r]));
    }
}

// y[t, 0:rows] for T activation rows x[t] (rows of K) and 4 decoded weight rows w[r] (rows beyond `rows` are
// read, their sums dropped): one_row's two sums of each output (elements 0..15 and 16..31 of every block), in two
// passes that keep a tile's 4 x T accumulators in registers, each the same fp32 sum in the same order as there.
template <int T>
void tile(const float* x, int64_t K, const float* const w[kRowsAtOnce], int64_t rows, float* y, int64_t N) {
    __m512 sums[2][T][kRowsAtOnce];
    for (int64_t half = 0; half < 2; ++half) {
        __m512 acc[T][kRowsAtOnce];
        for (int t = 0; t < T; ++t)
            for (int64_t r = 0; r < kRowsAtOnce; ++r) acc[t][r] = _mm512_setzero_ps();
        for (int64_t k = 16 * half; k < K; k += kBlock) {
            __m512 v[T];
            for (int t = 0; t < T; ++t) v[t] = _mm512_loadu_ps(x + t * K + k);
            for (int64_t r = 0; r < kRowsAtOnce; ++r) {
                const __m512 wk = _mm512_loadu_ps(w[r] + k);
                for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(wk, v[t], acc[t][r]);
            }
        }
        for (int t = 0; t < T; ++t)
            for (int64_t r = 0; r < kRowsAtOnce; ++r) sums[half][t][r] = acc[t][r];
    }
    for (int t = 0; t < T; ++t)
        for (int64_t r = 0; r < rows; ++r) y[t * N + r] = reduce16(_mm512_add_ps(sums[0][t][r], sums[1][t][r]));
}

// y[:, n0:n1] for M activation rows: weight rows decoded in fours into `scratch` (4 x K floats, then the fp32
// scales), then tiles of up to kActTile activation rows x 4 weight rows.
template <int Kind>
void many_rows(const float* x, int64_t M, const BlockView& w, float* y, int64_t n0, int64_t n1, float* scratch) {
    using L = Layout16<Kind>;
    const int64_t K = w.cols, N = w.rows, blocks = K / kBlock;
    const uint8_t* q = w.codes;
    const uint16_t *d = w.scales, *m = w.offsets;
    float* buf = scratch;
    float* df = buf + kRowsAtOnce * K;
    float* mf = df + blocks * L::kSlots;
    for (int64_t n = n0; n < n1; n += kRowsAtOnce) {
        const int64_t rows = smaller(kRowsAtOnce, n1 - n);
        const int64_t later = smaller(kRowsAtOnce, n1 - n - rows);  // the next group's rows, fetched meanwhile
        decode_rows<L>(q, d, m, n, rows, later, K, buf, df, mf,
                       [](const uint8_t* row, int64_t b, const float* dr, const float* mr, float* out) {
                           __m512 v[2];
                           L::decode(row, b, dr, mr, v);
                           _mm512_storeu_ps(out, v[0]);
                           _mm512_storeu_ps(out + 16, v[1]);
                       });
        const float* wr[kRowsAtOnce];  // short groups read row 0 again; their sums are dropped
        for (int64_t r = 0; r < kRowsAtOnce; ++r) wr[r] = buf + (r < rows ? r : 0) * K;
        int64_t i = 0;
        for (; i + kActTile <= M; i += kActTile) tile<kActTile>(x + i * K, K, wr, rows, y + i * N + n, N);
        switch (M - i) {  // the last rows, as one shorter tile
            case 3: tile<3>(x + i * K, K, wr, rows, y + i * N + n, N); break;
            case 2: tile<2>(x + i * K, K, wr, rows, y + i * N + n, N); break;
            case 1: tile<1>(x + i * K, K, wr, rows, y + i * N + n, N); break;
            default: break;
        }
    }
}

template <int Kind>
void rows_of(const float* x, int64_t M, const BlockView& w, float* y, int64_t n0, int64_t n1, float* scratch) {
    switch (M) {
        case 1: one_row<Kind>(x, w, y, n0, n1, scratch); break;
        case 2: few_rows<Kind, 2, 4>(x, w, y, n0, n1, scratch); break;
        case 3: few_rows<Kind, 3, 2>(x, w, y, n0, n1, scratch); break;
        case 4: few_rows<Kind, 4, 2>(x, w, y, n0, n1, scratch); break;
        case 5: few_rows<Kind, 5, 2>(x, w, y, n0, n1, scratch); break;
        case 6: few_rows<Kind, 6, 2>(x, w, y, n0, n1, scratch); break;
        case 7: few_rows<Kind, 7, 1>(x, w, y, n0, n1, scratch); break;
        case 8: few_rows<Kind, 8, 1>(x, w, y, n0, n1, scratch); break;
        default: many_rows<Kind>(x, M, w, y, n0, n1, scratch);
    }
}

}  // namespace

void block_rows_avx512(const float* x, int64_t M, const BlockView& w, float* y, int64_t n0, int64_t n1,
                       float* scratch) {
    switch (w.bits) {
        case 4: rows_of<4>(x, M, w, y, n0, n1, scratch); break;
        case kQ5: rows_of<kQ5>(x, M, w, y, n0, n1, scratch); break;
        case kQ4K: rows_of<kQ4K>(x, M, w, y, n0, n1, scratch); break;
        case kQ5K: rows_of<kQ5K>(x, M, w, y, n0, n1, scratch); break;
        case kQ6K: rows_of<kQ6K>(x, M, w, y, n0, n1, scratch); break;
        case kQ8M: rows_of<kQ8M>(x, M, w, y, n0, n1, scratch); break;
        default: rows_of<8>(x, M, w, y, n0, n1, scratch);
    }
}

}  // namespace moaspec

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace moaspec {

bool avx512_supported() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace moaspec

#else  // other compilers (MSVC) and machines: the AVX2 loops only

namespace moaspec {

bool avx512_supported() { return false; }

void block_rows_avx512(const float*, int64_t, const BlockView&, float*, int64_t, int64_t, float*) {
    TORCH_CHECK(false, "this build has no AVX-512 loops");
}

}  // namespace moaspec

#endif
