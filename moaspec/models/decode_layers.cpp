// A decoder's layers over the few new tokens of a decoding step or a verification, in one C++ call.
//
// Once a GGUF target's products read its 4-bit blocks, a one-token step of SmolLM2-135M spends less
// time in them (about 10 ms on a 2-core AVX2 EPYC) than in the ~30 small torch operations per layer
// around them (about 12 ms: each costs microseconds of dispatch from Python, for a few hundred floats of
// work). Here the norms, the rotary embedding, the cache writes, attention and SwiGLU are plain loops
// around block_product, in fp32, with nothing rounded to fewer bits.
//
// Every value a token gets is computed by the same loops in the same order, whatever the number of new
// tokens or threads: norms, rotations and SwiGLU row by row; attention for each (token, head) over the keys
// that token may see, in cache order, gathered first so that a draft tree's ancestors are summed exactly
// as the same keys would be in a chain. So a verification scores each token bitwise as a step of plain
// decoding does, given the same cache: greedy speculative decoding reproduces plain decoding exactly.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "block_kernel.h"

namespace moaspec {
namespace {

// e^x for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial; about 1 ulp),
// clamped so that very negative inputs give exactly 0 (a masked or negligible score).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// y = x · rsqrt(mean(x²) + eps) · w for one row of n floats (n a multiple of 8), as F.rms_norm computes it.
void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(reduce(acc) / static_cast<float>(n) + eps));
    for (int64_t k = 0; k < n; k += 8)
        _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), r), _mm256_loadu_ps(w + k)));
}

// The half-split rotation of one head's D floats (as transformer.apply_rope: x·cos + rotate_half(x)·sin).
void rope_head(const float* x, const float* cos, const float* sin, float* y, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) {
        y[i] = x[i] * cos[i] - x[i + half] * sin[i];
        y[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

// q · k over D floats (D a multiple of 8), one accumulator in a fixed order.
inline float dot(const float* q, const float* k, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    return reduce(acc);
}

// out = Σ_j p[j] · V[seen[j]] over D floats, each lane summed over j in order. Lanes (8 at a time) are
// independent, so the loop runs over j outside and keeps every lane's sum in a register (Lanes = D / 8),
// instead of one dependent chain per lane group.
template <int Lanes>
void weighted_values(const float* p, const float* V, const int64_t* seen, int64_t n, float* out, float total) {
    __m256 acc[Lanes];
    for (int i = 0; i < Lanes; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float* v = V + seen[j] * (8 * Lanes);
        for (int i = 0; i < Lanes; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    const __m256 t = _mm256_set1_ps(total);
    for (int i = 0; i < Lanes; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_div_ps(acc[i], t));
}

// The same for any D (a multiple of 8): 8 lanes at a time, each summed over j in the same order.
void weighted_values_any(const float* p, const float* V, const int64_t* seen, int64_t n, int64_t D, float* out,
                         float total) {
    for (int64_t i = 0; i < D; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(V + seen[j] * D + i), acc);
        _mm256_storeu_ps(out + i, _mm256_div_ps(acc, _mm256_set1_ps(total)));
    }
}

// One query's attention over the `n` keys listed in `seen` (cache rows, in order): softmax(q·K/√D)·V into out.
// `scores` has room for n rounded up to 8.
void attend_one(const float* q, const float* K, const float* V, const int64_t* seen, int64_t n, int64_t D,
                float scale, float* scores, float* out) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
        scores[j] = dot(q, K + seen[j] * D, D) * scale;
        top = std::max(top, scores[j]);
    }
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t j = n; j < padded; ++j) scores[j] = -std::numeric_limits<float>::infinity();  // exp gives 0
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vtop));
        _mm256_storeu_ps(scores + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    const float total = reduce(sum);
    if (D == 64)
        weighted_values<8>(scores, V, seen, n, out, total);
    else if (D == 128)
        weighted_values<16>(scores, V, seen, n, out, total);
    else
        weighted_values_any(scores, V, seen, n, D, out, total);
}

// x[i] = silu(gate[i]) · up[i] = gate / (1 + e^-gate) · up, for n floats (n a multiple of 8).
void swiglu_row(const float* gate, const float* up, float* y, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) {
        const __m256 g = _mm256_loadu_ps(gate + k);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(y + k, _mm256_mul_ps(silu, _mm256_loadu_ps(up + k)));
    }
}

void add_rows(float* h, const float* x, int64_t n) {
    for (int64_t k = 0; k < n; k += 8)
        _mm256_storeu_ps(h + k, _mm256_add_ps(_mm256_loadu_ps(h + k), _mm256_loadu_ps(x + k)));
}

struct Layer {
    BlockView qkv, o, gate_up, down;  // qkv: q, k and v stacked; a cross-attention layer's holds q alone
    const float* qkv_bias;  // null: none
    const float* attn_norm;
    const float* mlp_norm;
};

// Work of one (token, head) attention below which it is not worth waking another thread.
constexpr int64_t kAttentionGrainKeys = 8192;

// The buffers of one forward over T tokens, carved from one tensor.
struct Scratch {
    torch::Tensor storage;
    float *normed, *qkv, *rotated_q, *attended, *out, *gate_up, *act;
    Scratch(int64_t T, int64_t d, int64_t width, int64_t q_dim, int64_t inter, const torch::TensorOptions& options)
        : storage(torch::empty({T * (d + width + q_dim + q_dim + d + 2 * inter + inter)}, options)) {
        normed = storage.data_ptr<float>();
        qkv = normed + T * d;
        rotated_q = qkv + T * width;
        attended = rotated_q + T * q_dim;
        out = attended + T * q_dim;
        gate_up = out + T * d;
        act = gate_up + T * 2 * inter;
    }
};

const float* fp32_rows(const torch::Tensor& t, int64_t rows, int64_t cols, const char* what) {
    check_tensor(t, torch::kFloat32, 2, what);
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
                t.size(1) == cols, what, " must be contiguous fp32 [", rows, ", ", cols, "]");
    return t.data_ptr<float>();
}

class Layers {
public:
    // `tensors`: for each layer, 15 tensors: the codes, scales and offsets of qkv, o, gate_up and down (fused as
    // the runtime holds them), then attn_norm, mlp_norm and the qkv bias (empty: none). `bits`: 4 per layer.
    // `cross`: one layer whose queries attend to another sequence's keys and values (its qkv holds q alone).
    Layers(std::vector<torch::Tensor> tensors, std::vector<int64_t> bits, int64_t heads, int64_t kv_heads,
           int64_t head_dim, double eps, bool cross)
        : tensors_(std::move(tensors)), heads_(heads), kv_heads_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
          cross_(cross) {
        TORCH_CHECK(tensors_.size() % 15 == 0 && bits.size() * 15 == tensors_.size() * 4, "15 tensors and 4 widths a layer");
        TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 16 == 0, "unsupported head layout");
        const int64_t L = static_cast<int64_t>(tensors_.size()) / 15;
        TORCH_CHECK(!cross || L == 1, "a cross-attention Layers holds one layer");
        const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
        width_ = cross ? q : q + 2 * kv;
        for (int64_t l = 0; l < L; ++l) {
            const torch::Tensor* t = &tensors_[15 * l];
            auto view = [&](int i) { return block_view(t[3 * i], t[3 * i + 1], t[3 * i + 2], bits[4 * l + i]); };
            Layer layer{view(0), view(1), view(2), view(3), nullptr, nullptr, nullptr};
            for (int i = 12; i < 15; ++i) {
                check_tensor(t[i], torch::kFloat32, 1, i == 14 ? "the qkv bias" : "a norm gain");
                TORCH_CHECK(t[i].scalar_type() == torch::kFloat32 && t[i].is_contiguous() && t[i].dim() == 1,
                            "norm gains and biases must be contiguous 1-D fp32");
            }
            if (l == 0) {  // run() sizes its scratch by these, so every layer must share them
                d_ = t[12].numel();
                inter_ = layer.gate_up.rows / 2;
            }
            TORCH_CHECK(d_ % 32 == 0 && t[12].numel() == d_ && t[13].numel() == d_ && layer.qkv.cols == d_ &&
                        layer.qkv.rows == width_ && layer.o.cols == q && layer.o.rows == d_ &&
                        layer.gate_up.cols == d_ && layer.gate_up.rows == 2 * inter_ && inter_ % 32 == 0 &&
                        layer.down.cols == inter_ && layer.down.rows == d_, "layer ", l, "'s weights do not fit together");
            TORCH_CHECK(t[14].numel() == 0 || t[14].numel() == width_, "the qkv bias has the wrong size");
            layer.attn_norm = t[12].data_ptr<float>();
            layer.mlp_norm = t[13].data_ptr<float>();
            layer.qkv_bias = t[14].numel() ? t[14].data_ptr<float>() : nullptr;
            layers_.push_back(layer);
        }
    }

    // Blocks first..last-1 on x [T, d] (fp32): writes each block's keys and values at positions start.. of cache
    // layer (block - cache_offset) of `keys`/`values` ([layers, 1, kv_heads, capacity, head_dim] fp32), and returns
    // the residual stream after the last block. cos/sin: [T, head_dim], the new tokens' rotations. mask: none (each
    // token sees the whole cache and the new tokens up to itself) or bool [T, start + T], True = may attend.
    torch::Tensor run(const torch::Tensor& x, torch::Tensor keys, torch::Tensor values, const torch::Tensor& cos,
                      const torch::Tensor& sin, int64_t start, const c10::optional<torch::Tensor>& mask, int64_t first,
                      int64_t last, int64_t cache_offset) const {
        TORCH_CHECK(!cross_, "a cross-attention layer runs through cross()");
        const int64_t L = static_cast<int64_t>(layers_.size());
        TORCH_CHECK(0 <= first && first <= last && last <= L, "blocks ", first, "..", last, " of ", L);
        const int64_t T = check_input(x);
        std::vector<Sequence> seqs{sequence(keys, values, start, 0, T, mask, first - cache_offset, last - cache_offset)};
        return blocks(x, seqs, fp32_rows(cos, T, D_, "cos"), fp32_rows(sin, T, D_, "sin"), first, last, cache_offset);
    }

    // Several sequences' new tokens through every block as one forward: x [T, d] holds sequence i's tokens in rows
    // rows[0] + .. + rows[i-1] onward, rows[i] of them, after starts[i] cached positions of its own cache
    // keys[i]/values[i] (as run()'s), with masks[i] as run()'s mask (none: causal). cos/sin: [T, head_dim]. Each
    // product reads the weights once for every row, and each row's values are computed exactly as run() computes
    // them for its sequence alone.
    torch::Tensor run_many(const torch::Tensor& x, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                           const torch::Tensor& cos, const torch::Tensor& sin, std::vector<int64_t> starts,
                           std::vector<int64_t> rows, std::vector<c10::optional<torch::Tensor>> masks) const {
        TORCH_CHECK(!cross_, "a cross-attention layer runs through cross()");
        const size_t n = keys.size();
        TORCH_CHECK(n > 0 && values.size() == n && starts.size() == n && rows.size() == n && masks.size() == n,
                    "one cache, start, row count and mask for each sequence");
        const int64_t T = check_input(x), L = static_cast<int64_t>(layers_.size());
        std::vector<Sequence> seqs;
        int64_t row = 0;
        for (size_t i = 0; i < n; ++i) {
            TORCH_CHECK(rows[i] > 0, "every sequence has new tokens");
            seqs.push_back(sequence(keys[i], values[i], starts[i], row, rows[i], masks[i], 0, L));
            row += rows[i];
        }
        TORCH_CHECK(row == T, "the sequences' rows add up to x's");
        return blocks(x, seqs, fp32_rows(cos, T, D_, "cos"), fp32_rows(sin, T, D_, "sin"), 0, L, 0);
    }

    // The cross-attention layer on x [T, d]: each token's queries, rotated by cos/sin [T, head_dim], attend to
    // every entry of `keys`/`values` ([1, kv_heads, n, head_dim] fp32, keys rotated already; a prefix of a larger
    // cache will do: rows must be contiguous, heads may lie `capacity` rows apart). Returns the residual stream.
    torch::Tensor cross(const torch::Tensor& x, const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& cos, const torch::Tensor& sin) const {
        TORCH_CHECK(cross_, "a self-attention layer runs through run()");
        const int64_t T = check_input(x);
        for (const torch::Tensor* c : {&keys, &values}) {
            check_tensor(*c, torch::kFloat32, 4, "memory keys and values", false);
            TORCH_CHECK(c->scalar_type() == torch::kFloat32 && c->dim() == 4 && c->size(0) == 1 &&
                        c->size(1) == kv_heads_ && c->size(3) == D_ && c->stride(3) == 1 && c->stride(2) == D_ &&
                        c->stride(1) % D_ == 0 && c->stride(1) >= c->size(2) * D_,
                        "memory keys and values must be fp32 [1, ", kv_heads_, ", entries, ", D_, "] with contiguous rows");
        }
        TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides(), "keys and values differ in layout");
        const int64_t n = keys.size(2), capacity = keys.stride(1) / D_;
        TORCH_CHECK(n > 0, "there is no entry to attend to");
        const float* cosp = fp32_rows(cos, T, D_, "cos");
        const float* sinp = fp32_rows(sin, T, D_, "sin");
        std::vector<int64_t> all(n);
        for (int64_t j = 0; j < n; ++j) all[j] = j;
        const int64_t q_dim = heads_ * D_;
        torch::Tensor h = x.contiguous().clone();
        Scratch s(T, d_, width_, q_dim, inter_, x.options());
        float* hp = h.data_ptr<float>();
        const Layer& layer = layers_[0];
        project(layer, hp, T, s);
        for (int64_t t = 0; t < T; ++t)
            rotate_queries(s.qkv + t * width_, cosp + t * D_, sinp + t * D_, s.rotated_q + t * q_dim);
        const Visible memory{keys.data_ptr<float>(), values.data_ptr<float>(), capacity, all.data(), n};
        attend(s, T, n, [&](int64_t) { return memory; });
        finish(layer, hp, T, s);
        return h;
    }

private:
    int64_t check_input(const torch::Tensor& x) const {
        check_tensor(x, torch::kFloat32, 2, "x", false);  // copied with contiguous() before it is read
        TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == d_ &&
                    x.size(0) > 0, "x must be fp32 [tokens, ", d_, "]");
        return x.size(0);
    }

    // The capacity of a cache that must hold layers c0..c1-1.
    int64_t check_cache(const torch::Tensor& keys, const torch::Tensor& values, int64_t c0, int64_t c1) const {
        for (const torch::Tensor* c : {&keys, &values}) {
            check_tensor(*c, torch::kFloat32, 5, "the cache");
            TORCH_CHECK(c->scalar_type() == torch::kFloat32 && c->is_contiguous() && c->dim() == 5 && c->size(1) == 1 &&
                        c->size(2) == kv_heads_ && c->size(4) == D_ && c0 >= 0 && c1 <= c->size(0), "the cache must be "
                        "contiguous fp32 [layers, 1, ", kv_heads_, ", capacity, ", D_, "] holding these blocks");
        }
        TORCH_CHECK(keys.sizes() == values.sizes(), "keys and values differ in shape");
        return keys.size(3);
    }

    // The normed residual stream's q(kv) projection (+ bias) into s.qkv.
    void project(const Layer& layer, const float* hp, int64_t T, Scratch& s) const {
        for (int64_t t = 0; t < T; ++t) rms_norm_row(hp + t * d_, layer.attn_norm, s.normed + t * d_, d_, eps_);
        block_product(s.normed, T, layer.qkv, s.qkv);
        if (layer.qkv_bias)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t i = 0; i < width_; ++i) s.qkv[t * width_ + i] += layer.qkv_bias[i];
    }

    void rotate_queries(const float* row, const float* cos, const float* sin, float* out) const {
        for (int64_t hd = 0; hd < heads_; ++hd) rope_head(row + hd * D_, cos, sin, out + hd * D_, D_);
    }

    // What a token attends to: a cache layer's keys and values (heads `capacity` rows apart) at the positions listed.
    struct Visible {
        const float* K;
        const float* V;
        int64_t capacity;
        const int64_t* keys;
        int64_t n;
    };

    // Every (token, head)'s attention over what `visible(t)` gives (at most S keys), into s.attended.
    template <typename Source>
    void attend(Scratch& s, int64_t T, int64_t S, Source visible) const {
        const int64_t q_dim = heads_ * D_, group = heads_ / kv_heads_;
        const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
        const int64_t grain = std::max<int64_t>(1, kAttentionGrainKeys / S);
        at::parallel_for(0, T * heads_, grain, [&](int64_t i0, int64_t i1) {
            std::vector<float> scores((S + 7) / 8 * 8);
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t t = i / heads_, hd = i % heads_, g = hd / group;
                const Visible v = visible(t);
                attend_one(s.rotated_q + t * q_dim + hd * D_, v.K + g * v.capacity * D_, v.V + g * v.capacity * D_,
                           v.keys, v.n, D_, scale, scores.data(), s.attended + t * q_dim + hd * D_);
            }
        });
    }

    // One sequence of a forward: its cache, where its new tokens go, its rows of x, and what each of them sees.
    struct Sequence {
        float* keys;  // cache layer 0's; layer c lies c * kv_heads * capacity * head_dim floats on
        float* values;
        int64_t capacity, start, first_row, rows;
        std::vector<std::vector<int64_t>> seen;  // per new token: the cache positions it sees, in cache order
    };

    // A Sequence for `rows` new tokens from row `first_row` of x, after `start` cached positions of a cache that
    // must hold layers c0..c1-1; mask as run()'s.
    Sequence sequence(torch::Tensor& keys, torch::Tensor& values, int64_t start, int64_t first_row, int64_t rows,
                      const c10::optional<torch::Tensor>& mask, int64_t c0, int64_t c1) const {
        const int64_t capacity = check_cache(keys, values, c0, c1), S = start + rows;
        TORCH_CHECK(start >= 0 && S <= capacity, "no room in the cache");
        const bool* allowed = nullptr;
        if (mask.has_value()) {
            check_tensor(*mask, torch::kBool, 2, "the mask");
            TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 2 &&
                        mask->size(0) == rows && mask->size(1) == S,
                        "the mask must be contiguous bool [tokens, cache + tokens]");
            allowed = mask->data_ptr<bool>();
        }
        // the keys each token sees, in cache order: the same list whatever else is verified beside it
        std::vector<std::vector<int64_t>> seen(rows);
        for (int64_t t = 0; t < rows; ++t)
            for (int64_t j = 0; j < S; ++j)
                if (allowed ? allowed[t * S + j] : j <= start + t) seen[t].push_back(j);
        return {keys.data_ptr<float>(), values.data_ptr<float>(), capacity, start, first_row, rows, std::move(seen)};
    }

    // Blocks first..last-1 on x, whose rows belong to `seqs` (in order), each writing its own cache.
    torch::Tensor blocks(const torch::Tensor& x, const std::vector<Sequence>& seqs, const float* cosp, const float* sinp,
                         int64_t first, int64_t last, int64_t cache_offset) const {
        const int64_t T = x.size(0), q_dim = heads_ * D_, kv_dim = kv_heads_ * D_;
        std::vector<const Sequence*> owner(T);
        int64_t S = 1;
        for (const Sequence& q : seqs) {
            for (int64_t r = 0; r < q.rows; ++r) owner[q.first_row + r] = &q;
            S = std::max(S, q.start + q.rows);
        }
        torch::Tensor h = x.contiguous().clone();
        Scratch s(T, d_, width_, q_dim, inter_, x.options());
        float* hp = h.data_ptr<float>();
        for (int64_t b = first; b < last; ++b) {
            const Layer& layer = layers_[b];
            const int64_t layer_floats = (b - cache_offset) * kv_heads_ * D_;
            project(layer, hp, T, s);
            for (int64_t t = 0; t < T; ++t) {
                const Sequence& q = *owner[t];
                float* K = q.keys + layer_floats * q.capacity;
                float* V = q.values + layer_floats * q.capacity;
                const float* row = s.qkv + t * width_;
                rotate_queries(row, cosp + t * D_, sinp + t * D_, s.rotated_q + t * q_dim);
                for (int64_t g = 0; g < kv_heads_; ++g) {
                    const int64_t at = (g * q.capacity + q.start + t - q.first_row) * D_;
                    rope_head(row + q_dim + g * D_, cosp + t * D_, sinp + t * D_, K + at, D_);
                    std::copy_n(row + q_dim + kv_dim + g * D_, D_, V + at);
                }
            }
            attend(s, T, S, [&](int64_t t) {
                const Sequence& q = *owner[t];
                const std::vector<int64_t>& keys = q.seen[t - q.first_row];
                return Visible{q.keys + layer_floats * q.capacity, q.values + layer_floats * q.capacity, q.capacity,
                               keys.data(), static_cast<int64_t>(keys.size())};
            });
            finish(layer, hp, T, s);
        }
        return h;
    }

    // o, the residual, the MLP's norm, gate/up, SwiGLU, down and the residual again.
    void finish(const Layer& layer, float* hp, int64_t T, Scratch& s) const {
        block_product(s.attended, T, layer.o, s.out);
        for (int64_t t = 0; t < T; ++t) {
            add_rows(hp + t * d_, s.out + t * d_, d_);
            rms_norm_row(hp + t * d_, layer.mlp_norm, s.normed + t * d_, d_, eps_);
        }
        block_product(s.normed, T, layer.gate_up, s.gate_up);
        for (int64_t t = 0; t < T; ++t)
            swiglu_row(s.gate_up + t * 2 * inter_, s.gate_up + t * 2 * inter_ + inter_, s.act + t * inter_, inter_);
        block_product(s.act, T, layer.down, s.out);
        for (int64_t t = 0; t < T; ++t) add_rows(hp + t * d_, s.out + t * d_, d_);
    }

    std::vector<torch::Tensor> tensors_;  // owned here, so that the views below stay valid
    std::vector<Layer> layers_;
    int64_t heads_, kv_heads_, D_, d_ = 0, inter_ = 0, width_ = 0;
    float eps_;
    bool cross_;
};

}  // namespace

void register_layers(pybind11::module& module) {
    pybind11::class_<Layers>(module, "Layers", "A decoder's layers on their GGUF blocks, for a few new tokens at a time")
        .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double, bool>())
        // without the GIL: a server's decoders, one thread each, run their forwards side by side
        .def("run", &Layers::run, "the blocks first..last-1 on x, writing the cache; see decode_layers.cpp",
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("run_many", &Layers::run_many, "several sequences' new tokens through every block as one forward; see "
             "decode_layers.cpp", pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("cross", &Layers::cross, "a cross-attention layer on x over the given keys and values; see decode_layers.cpp",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace moaspec
