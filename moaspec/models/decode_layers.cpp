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

#include <cmath>
#include <limits>
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
    BlockView qkv, o, gate_up, down;
    const float* qkv_bias;  // null: none
    const float* attn_norm;
    const float* mlp_norm;
};

// Work of one (token, head) attention below which it is not worth waking another thread.
constexpr int64_t kAttentionGrainKeys = 8192;

class Layers {
public:
    // `tensors`: for each layer, 15 tensors: the codes, scales and offsets of qkv, o, gate_up and down (fused as
    // the runtime holds them), then attn_norm, mlp_norm and the qkv bias (empty: none). `bits`: 4 per layer.
    Layers(std::vector<torch::Tensor> tensors, std::vector<int64_t> bits, int64_t heads, int64_t kv_heads,
           int64_t head_dim, double eps)
        : tensors_(std::move(tensors)), heads_(heads), kv_heads_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)) {
        TORCH_CHECK(tensors_.size() % 15 == 0 && bits.size() * 15 == tensors_.size() * 4, "15 tensors and 4 widths a layer");
        TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 16 == 0, "unsupported head layout");
        const int64_t L = static_cast<int64_t>(tensors_.size()) / 15;
        for (int64_t l = 0; l < L; ++l) {
            const torch::Tensor* t = &tensors_[15 * l];
            auto view = [&](int i) { return block_view(t[3 * i], t[3 * i + 1], t[3 * i + 2], bits[4 * l + i]); };
            Layer layer{view(0), view(1), view(2), view(3), nullptr, nullptr, nullptr};
            for (int i = 12; i < 15; ++i)
                TORCH_CHECK(t[i].scalar_type() == torch::kFloat32 && t[i].is_contiguous() && t[i].dim() == 1,
                            "norm gains and biases must be contiguous 1-D fp32");
            if (l == 0) {  // run() sizes its scratch by these, so every layer must share them
                d_ = t[12].numel();
                inter_ = layer.gate_up.rows / 2;
            }
            const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
            TORCH_CHECK(d_ % 32 == 0 && t[12].numel() == d_ && t[13].numel() == d_ && layer.qkv.cols == d_ &&
                        layer.qkv.rows == q + 2 * kv && layer.o.cols == q && layer.o.rows == d_ &&
                        layer.gate_up.cols == d_ && layer.gate_up.rows == 2 * inter_ && inter_ % 32 == 0 &&
                        layer.down.cols == inter_ && layer.down.rows == d_, "layer ", l, "'s weights do not fit together");
            TORCH_CHECK(t[14].numel() == 0 || t[14].numel() == q + 2 * kv, "the qkv bias has the wrong size");
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
        const int64_t L = static_cast<int64_t>(layers_.size());
        TORCH_CHECK(0 <= first && first <= last && last <= L, "blocks ", first, "..", last, " of ", L);
        TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == d_ &&
                    x.size(0) > 0, "x must be fp32 [tokens, ", d_, "]");
        const int64_t T = x.size(0), S = start + T;
        for (const torch::Tensor* c : {&keys, &values})
            TORCH_CHECK(c->scalar_type() == torch::kFloat32 && c->is_contiguous() && c->dim() == 5 && c->size(1) == 1 &&
                        c->size(2) == kv_heads_ && c->size(4) == D_ && first - cache_offset >= 0 &&
                        last - cache_offset <= c->size(0), "the cache must be contiguous fp32 [layers, 1, ", kv_heads_,
                        ", capacity, ", D_, "] holding these blocks");
        const int64_t capacity = keys.size(3);
        TORCH_CHECK(start >= 0 && S <= capacity && keys.sizes() == values.sizes(), "no room in the cache");
        for (const torch::Tensor* c : {&cos, &sin})
            TORCH_CHECK(c->scalar_type() == torch::kFloat32 && c->is_contiguous() && c->dim() == 2 && c->size(0) == T &&
                        c->size(1) == D_, "cos/sin must be contiguous fp32 [tokens, head_dim]");
        const bool* allowed = nullptr;
        if (mask.has_value()) {
            TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 2 &&
                        mask->size(0) == T && mask->size(1) == S, "the mask must be contiguous bool [tokens, cache + tokens]");
            allowed = mask->data_ptr<bool>();
        }
        // the keys each token sees, in cache order: the same list whatever else is verified beside it
        std::vector<std::vector<int64_t>> seen(T);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < S; ++j)
                if (allowed ? allowed[t * S + j] : j <= start + t) seen[t].push_back(j);

        const int64_t q_dim = heads_ * D_, kv_dim = kv_heads_ * D_, width = q_dim + 2 * kv_dim;
        torch::Tensor h = x.contiguous().clone();
        torch::Tensor scratch = torch::empty({T * (d_ + width + q_dim + q_dim + d_ + 2 * inter_ + inter_)}, x.options());
        float* hp = h.data_ptr<float>();
        float* normed = scratch.data_ptr<float>();
        float* qkv = normed + T * d_;
        float* rotated_q = qkv + T * width;
        float* attended = rotated_q + T * q_dim;
        float* out = attended + T * q_dim;
        float* gate_up = out + T * d_;
        float* act = gate_up + T * 2 * inter_;
        const float* cosp = cos.data_ptr<float>();
        const float* sinp = sin.data_ptr<float>();
        const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
        const int64_t group = heads_ / kv_heads_;
        for (int64_t b = first; b < last; ++b) {
            const Layer& layer = layers_[b];
            const int64_t c = b - cache_offset;
            float* K = keys.data_ptr<float>() + c * kv_heads_ * capacity * D_;
            float* V = values.data_ptr<float>() + c * kv_heads_ * capacity * D_;
            for (int64_t t = 0; t < T; ++t) rms_norm_row(hp + t * d_, layer.attn_norm, normed + t * d_, d_, eps_);
            block_product(normed, T, layer.qkv, qkv);
            for (int64_t t = 0; t < T; ++t) {
                float* row = qkv + t * width;
                if (layer.qkv_bias)
                    for (int64_t i = 0; i < width; ++i) row[i] += layer.qkv_bias[i];
                const float* ct = cosp + t * D_;
                const float* st = sinp + t * D_;
                for (int64_t hd = 0; hd < heads_; ++hd) rope_head(row + hd * D_, ct, st, rotated_q + t * q_dim + hd * D_, D_);
                for (int64_t g = 0; g < kv_heads_; ++g) {
                    const int64_t at = (g * capacity + start + t) * D_;
                    rope_head(row + q_dim + g * D_, ct, st, K + at, D_);
                    std::copy_n(row + q_dim + kv_dim + g * D_, D_, V + at);
                }
            }
            const int64_t grain = std::max<int64_t>(1, kAttentionGrainKeys / S);
            at::parallel_for(0, T * heads_, grain, [&](int64_t i0, int64_t i1) {
                std::vector<float> scores((S + 7) / 8 * 8);
                for (int64_t i = i0; i < i1; ++i) {
                    const int64_t t = i / heads_, hd = i % heads_, g = hd / group;
                    attend_one(rotated_q + t * q_dim + hd * D_, K + g * capacity * D_, V + g * capacity * D_,
                               seen[t].data(), static_cast<int64_t>(seen[t].size()), D_, scale, scores.data(),
                               attended + t * q_dim + hd * D_);
                }
            });
            block_product(attended, T, layer.o, out);
            for (int64_t t = 0; t < T; ++t) {
                add_rows(hp + t * d_, out + t * d_, d_);
                rms_norm_row(hp + t * d_, layer.mlp_norm, normed + t * d_, d_, eps_);
            }
            block_product(normed, T, layer.gate_up, gate_up);
            for (int64_t t = 0; t < T; ++t)
                swiglu_row(gate_up + t * 2 * inter_, gate_up + t * 2 * inter_ + inter_, act + t * inter_, inter_);
            block_product(act, T, layer.down, out);
            for (int64_t t = 0; t < T; ++t) add_rows(hp + t * d_, out + t * d_, d_);
        }
        return h;
    }

private:
    std::vector<torch::Tensor> tensors_;  // owned here, so that the views below stay valid
    std::vector<Layer> layers_;
    int64_t heads_, kv_heads_, D_, d_ = 0, inter_ = 0;
    float eps_;
};

}  // namespace

void register_layers(pybind11::module& module) {
    pybind11::class_<Layers>(module, "Layers", "A decoder's layers on their GGUF blocks, for a few new tokens at a time")
        .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double>())
        // without the GIL: a server's decoders, one thread each, run their forwards side by side
        .def("run", &Layers::run, "the blocks first..last-1 on x, writing the cache; see decode_layers.cpp",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace moaspec
