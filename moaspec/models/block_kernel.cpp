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
// Three loops compute that same arithmetic. One row (a decoding step): weight rows 4 at a time, each
// block decoded in registers and used at once, 4 independent accumulators. Two to four rows (a short
// verification): the same, each decoded block used by every activation row, 2 weight rows at a time.
// More rows: 4 weight rows decoded once into a small buffer that stays in L1, then 3 x 4 tiles of
// (activation row, weight row) accumulators read it, so the decoding is paid once for every row.
// Where the CPU has AVX-512, block_kernel_avx512.cpp's 16-lane loops run instead (chosen at run time).
// Threads split the weight rows through ATen's own pool (at::parallel_for), never torch's other work.
// Both loops prefetch the next group's codes while they use this group's: without it a step's products
// streamed Q4 and Q8 blocks from memory at half the speed they ran from cache (benchmarks/block_types.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <cstring>
#include <utility>
#include <vector>

#include "block_kernel.h"
#include "block_layouts.h"

namespace moaspec {
namespace {

constexpr int64_t kActTile = 3;  // activation rows per tile of the several-row loop

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

// Signed 8-bit codes in order as four 8-lane vectors of d*q, or fma(q, d, m) where `Offset`.
template <bool Offset>
inline void byte_codes(const uint8_t* q, __m256 d, __m256 m, __m256 w[4]) {
    for (int j = 0; j < 4; ++j) {
        const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
        w[j] = Offset ? _mm256_fmadd_ps(c, d, m) : _mm256_mul_ps(c, d);
    }
}

// Each layout's AVX2 decoder: block b's 32 weights, exactly, as four 8-lane vectors (block_layouts.h's Geometry
// says where its codes and fp32 scales are).
template <int Kind>
struct Layout : Geometry<Kind> {  // Q4_0/Q4_1 (4): fma(q, d, m); Q8_0 (8): d*q
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const uint8_t* q = row + b * block_bytes<Kind>();
        if constexpr (Kind == 4)
            small_codes<false>(q, 0, _mm256_set1_ps(df[b]), _mm256_set1_ps(mf[b]), w);
        else
            byte_codes<false>(q, _mm256_set1_ps(df[b]), _mm256_setzero_ps(), w);
    }
};

template <>
struct Layout<kQ5> : Geometry<kQ5> {
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const uint8_t* q = row + b * 20;
        uint32_t high;
        std::memcpy(&high, q, 4);
        small_codes<true>(q + 4, high, _mm256_set1_ps(df[b]), _mm256_set1_ps(mf[b]), w);
    }
};

template <>
struct Layout<kQ8M> : Geometry<kQ8M> {
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        byte_codes<true>(row + b * kBlock, _mm256_set1_ps(df[b]), _mm256_set1_ps(mf[b]), w);
    }
};

template <int Bits>
struct KLayout : Geometry<Bits == 4 ? kQ4K : kQ5K> {
    using G = Geometry<Bits == 4 ? kQ4K : kQ5K>;
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        const int j = static_cast<int>(b % 8);
        __m256i code = bits_of(G::nibbles(row, b), 4 * (j & 1), 0x0F);
        if constexpr (Bits == 5)  // bit j of high byte l is block j's element l
            code = _mm256_or_si256(code, _mm256_slli_epi16(bits_of(G::fifth_bits(row, b), j, 1), 4));
        widen_codes(code, _mm256_set1_ps(df[b]), _mm256_set1_ps(mf[b]), w);
    }
};

template <>
struct Layout<kQ4K> : KLayout<4> {};
template <>
struct Layout<kQ5K> : KLayout<5> {};

template <>
struct Layout<kQ6K> : Geometry<kQ6K> {
    static void decode(const uint8_t* row, int64_t b, const float* df, const float* mf, __m256 w[4]) {
        widen_codes(codes(row, b), _mm256_set1_ps(df[2 * b]), _mm256_set1_ps(mf[2 * b]), _mm256_set1_ps(df[2 * b + 1]),
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

// y[:, n0:n1] for T = 2..4 activation rows (a short verification's): as one_row, each block decoded in registers and
// used at once by every activation row, R weight rows at a time, with no buffer to write and read back. Each output
// is one_row's accumulator, in its order.
template <int Kind, int T, int R>
void few_rows(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
    using L = Layout<Kind>;
    const int64_t blocks = K / kBlock, qrow = L::row_bytes(blocks), srow = blocks / L::kPerScale;
    const int64_t slots = blocks * L::kSlots;
    std::vector<float> widened(2 * R * slots, 0.0f);
    float* d0 = widened.data();
    float* m0 = d0 + R * slots;
    const int64_t group = R * qrow, stride = group / blocks;
    for (int64_t n = n0; n < n1; n += R) {
        const int64_t rows = std::min<int64_t>(R, n1 - n);  // a short group decodes its first row again, unused
        for (int64_t r = 0; r < R; ++r) {
            const int64_t row = n + (r < rows ? r : 0);
            L::widen_row(q + row * qrow, d + row * srow, m + row * srow, blocks, d0 + r * slots, m0 + r * slots);
        }
        __m256 acc[T][R];
        for (int t = 0; t < T; ++t)
            for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
        const uint8_t* ahead = q + n * qrow + (n + 2 * R <= n1 ? group : 0);
        for (int64_t b = 0; b < blocks; ++b) {
            prefetch(ahead + b * stride, stride);
            for (int r = 0; r < R; ++r) {
                __m256 w[4];
                L::decode(q + (n + (r < rows ? r : 0)) * qrow, b, d0 + r * slots, m0 + r * slots, w);
                for (int t = 0; t < T; ++t)
                    for (int j = 0; j < 4; ++j)
                        acc[t][r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + t * K + b * kBlock + 8 * j), acc[t][r]);
            }
        }
        for (int t = 0; t < T; ++t)
            for (int64_t r = 0; r < rows; ++r) y[t * N + n + r] = reduce(acc[t][r]);
    }
}

// y[:, n0:n1] for M activation rows: weight rows decoded in fours into `buf` (4 x K floats), then tiles of
// kActTile activation rows x 4 weight rows, each (row, weight row) one accumulator as in one_row.
template <int Kind>
void many_rows(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m, float* y,
               int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    using L = Layout<Kind>;
    const int64_t blocks = K / kBlock;
    std::vector<float> storage(kRowsAtOnce * K + 16), widened(2 * blocks * L::kSlots, 0.0f);
    float* buf = storage.data();
    float* df = widened.data();
    float* mf = df + blocks * L::kSlots;
    for (int64_t n = n0; n < n1; n += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, n1 - n);
        const int64_t later = std::min(kRowsAtOnce, n1 - n - rows);  // the next group's rows, fetched meanwhile
        decode_rows<L>(q, d, m, n, rows, later, K, buf, df, mf,
                       [](const uint8_t* row, int64_t b, const float* dr, const float* mr, float* out) {
                           __m256 w[4];
                           L::decode(row, b, dr, mr, w);
                           for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, w[j]);
                       });
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

// p rounded up to a 64-byte boundary (within 16 floats of it): a 16-lane load there never spans two cache lines,
// which costs Zen 4 about a second load.
inline float* aligned(float* p) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

template <int Kind>
void product_into(const float* x, int64_t M, const BlockView& w, float* y, bool wide) {
    const int64_t K = w.cols, N = w.rows;
    at::parallel_for(0, (N + kGrain - 1) / kGrain, 1, [&](int64_t t0, int64_t t1) {
        const int64_t n0 = t0 * kGrain, n1 = std::min(N, t1 * kGrain);
        if (wide) {
            std::vector<float> scratch(avx512_scratch(K) + 16);
            block_rows_avx512(x, M, w, y, n0, n1, aligned(scratch.data()));
        } else if (M == 1) {
            one_row<Kind>(x, w.codes, w.scales, w.offsets, y, K, n0, n1);
        } else if (M == 2) {
            few_rows<Kind, 2, 2>(x, w.codes, w.scales, w.offsets, y, K, N, n0, n1);
        } else if (M == 3) {
            few_rows<Kind, 3, 2>(x, w.codes, w.scales, w.offsets, y, K, N, n0, n1);
        } else if (M == 4) {
            few_rows<Kind, 4, 2>(x, w.codes, w.scales, w.offsets, y, K, N, n0, n1);
        } else {
            many_rows<Kind>(x, w.codes, w.scales, w.offsets, y, M, K, N, n0, n1);
        }
    });
}

// Which loops run: the AVX-512 ones wherever the CPU has them, unless set_instruction_set chose AVX2.
std::atomic<bool> use_avx512{avx512_supported()};

}  // namespace

void block_product(const float* x, int64_t M, const BlockView& w, float* y) {
    const bool wide = use_avx512.load(std::memory_order_relaxed);
    switch (w.bits) {
        case 4: product_into<4>(x, M, w, y, wide); break;
        case kQ5: product_into<kQ5>(x, M, w, y, wide); break;
        case kQ4K: product_into<kQ4K>(x, M, w, y, wide); break;
        case kQ5K: product_into<kQ5K>(x, M, w, y, wide); break;
        case kQ6K: product_into<kQ6K>(x, M, w, y, wide); break;
        case kQ8M: product_into<kQ8M>(x, M, w, y, wide); break;
        default: product_into<8>(x, M, w, y, wide);
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

// "avx2" or "avx512": the loops every product of this process runs from now on.
void set_instruction_set(const std::string& name) {
    TORCH_CHECK(name == "avx2" || name == "avx512", "unknown instruction set '", name, "': avx2 or avx512");
    TORCH_CHECK(name == "avx2" || moaspec::avx512_supported(), "this CPU (or this build) has no AVX-512 loops");
    moaspec::use_avx512 = name == "avx512";
}

std::string instruction_set() { return moaspec::use_avx512 ? "avx512" : "avx2"; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("product", &product, "y = x @ W.T for block-quantised W in layout `bits` (fp32 arithmetic)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
    module.def("set_instruction_set", &set_instruction_set, "Run every later product on 'avx2' or 'avx512' loops");
    module.def("instruction_set", &instruction_set, "The loops products run on: 'avx2' or 'avx512'");
    module.def("avx512_supported", &moaspec::avx512_supported, "Whether this CPU and build can run the AVX-512 loops");
    moaspec::register_layers(module);
}
