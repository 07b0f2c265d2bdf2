// dfllm's CPU kernels: decode attention straight from the paged KV cache, and the small
// per-token ops of a decoder layer (RMSNorm with its residual add, SiLU-and-multiply,
// rotary embedding), each fused into one pass over memory.
//
// Each kernel has a PyTorch reference with the same semantics in dfllm/kernels/<op>.py; the
// tests compare them. Values are accumulated in float32 whatever the tensors' dtype (float32,
// bfloat16, float16). Work is split over torch's intra-op threads with at::parallel_for.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for the softmax and SiLU, written so that the compiler vectorises the loops that
// call it (std::exp stays a scalar library call): Cephes' expf, range reduction to
// [-ln2/2, ln2/2], a degree-6 polynomial, then 2^n through the exponent bits; within 2 ulp
// of std::exp on [-87, 88] (below, it returns ~0; above, the value at 88).
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float t = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(t + std::copysign(0.5f, t));  // nearest (truncation vectorises)
  const float n = static_cast<float>(ni);
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

template <typename T>
inline void load(float* dst, const T* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = f32(src[i]);
}

// One decode query per sequence: its query heads read the sequence's keys and values block by
// block through its block table, in two passes (scores, then the weighted sum of values).
// Only the positions [start, len) are read: padding and blocks before a sliding window never are.
// DIM > 0 fixes the head dimension at compile time (the common 64 and 128), so that the dot
// products and sums over it unroll into a few vector instructions.
template <typename T, int DIM>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& tables,
                           const at::Tensor& lens, double scale, int64_t window, double softcap) {
  const int64_t n = rows.size(0), heads = q.size(1), dim = DIM > 0 ? DIM : q.size(2);
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2), width = tables.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), o_row = out.stride(0);
  const int64_t slot = kv_heads * dim;  // elements per cached token
  const float cap = static_cast<float>(softcap), sc = static_cast<float>(scale);

  // one task per sequence, every head of a cached token at once: each token's slot (all KV
  // heads, contiguous) is read in one sweep, which the hardware prefetcher follows
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim), acc(heads * dim), kv(slot), scores, total(heads);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t len = lp[i];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = len - start;
      const int32_t* table = tp + i * width;
      scores.resize(heads * span);
      load(qf.data(), qp + rp[i] * q_row, heads * dim);
      // pass 1: scores [heads, span]
      for (int64_t j = start; j < len; ++j) {
        const T* key = kp + (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * slot;
        const float* kf;
        if constexpr (std::is_same_v<T, float>) {
          kf = key;
        } else {
          load(kv.data(), key, slot);
          kf = kv.data();
        }
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
            scores[hq * span + (j - start)] = dot(&qf[hq * dim], kf + h * dim, dim) * sc;
          }
        }
      }
      // softmax per query head (unnormalised weights; divided at the end)
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* s = &scores[hq * span];
        if (cap > 0.f) {
          for (int64_t j = 0; j < span; ++j) s[j] = cap * std::tanh(s[j] / cap);
        }
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < span; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < span; ++j) {
          s[j] = fast_exp(s[j] - m);
          sum += s[j];
        }
        total[hq] = sum;
      }
      // pass 2: weighted sum of the values
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = start; j < len; ++j) {
        const T* value = vp + (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * slot;
        const float* vf;
        if constexpr (std::is_same_v<T, float>) {
          vf = value;
        } else {
          load(kv.data(), value, slot);
          vf = kv.data();
        }
        for (int64_t h = 0; h < kv_heads; ++h) {
          const float* vh = vf + h * dim;
          for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
            const float w = scores[hq * span + (j - start)];
            float* a = &acc[hq * dim];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
          }
        }
      }
      T* o = op + rp[i] * o_row;
      for (int64_t hq = 0; hq < heads; ++hq) {
        const float inv = 1.f / total[hq];
        for (int64_t d = 0; d < dim; ++d) o[hq * dim + d] = static_cast<T>(acc[hq * dim + d] * inv);
      }
    }
  });
}

// out = weight * (x [+ residual]) / rms(...), per row; with a residual the sum is returned too.
template <typename T>
void rms_norm_impl(at::Tensor& out, at::Tensor& sum_out, const at::Tensor& x, const at::Tensor* residual,
                   const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = residual ? sum_out.data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    float* hp = h.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      if (rp) {
        const T* rr = rp + r * rs;
        T* sr = sp + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          // the sum is rounded to T first, as x + residual is in PyTorch
          const T s = static_cast<T>(f32(xr[i]) + f32(rr[i]));
          sr[i] = s;
          hp[i] = f32(s);
        }
      } else {
        load(hp, xr, n);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += hp[i] * hp[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      T* orow = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = static_cast<T>(f32(wp[i]) * f32(static_cast<T>(hp[i] * inv)));
    }
  });
}

// silu(gate) * up for x = cat(gate, up) along the last dimension.
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + n;
      T* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = f32(gate[i]);
        // PyTorch rounds silu(gate) to T before the product
        o[i] = static_cast<T>(f32(static_cast<T>(g / (1.f + fast_exp(-g)))) * f32(up[i]));
      }
    }
  });
}

// Rotate-half rotary embedding of x [T, heads, d] (any row/head strides, last dim contiguous)
// into out [T, heads, d] (contiguous), with cos/sin [T, d/2] in float32.
template <typename T>
void rotary_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const T* a = xp + t * xs0 + h * xs1;
        T* o = op + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          // cos/sin are rounded to T first, and each product too, as in PyTorch
          const float c = f32(static_cast<T>(cp[t * cs + i])), s = f32(static_cast<T>(sp[t * cs + i]));
          const float x1 = f32(a[i]), x2 = f32(a[i + half]);
          o[i] = static_cast<T>(f32(static_cast<T>(x1 * c)) - f32(static_cast<T>(x2 * s)));
          o[i + half] = static_cast<T>(f32(static_cast<T>(x2 * c)) + f32(static_cast<T>(x1 * s)));
        }
      }
    }
  });
}

#define DFLLM_DISPATCH(dtype, NAME, ...)                                              \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, dtype, NAME, \
                                  [&] { __VA_ARGS__; })

}  // namespace

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& lens, double scale,
                      int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == q.size(2),
              "out must be shaped like q, each row contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(q.stride(1) == q.size(2), "q's heads of one token must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "q, out and the KV caches must share one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "rows must be int64, block tables and lengths int32");
  TORCH_CHECK(rows.is_contiguous() && tables.is_contiguous() && lens.is_contiguous(), "metadata must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  const int64_t dim = q.size(2);
  DFLLM_DISPATCH(q.scalar_type(), "decode_attention", {
    if (dim == 64) {
      decode_attention_impl<scalar_t, 64>(out, q, k_cache, v_cache, rows, tables, lens, scale, window, softcap);
    } else if (dim == 128) {
      decode_attention_impl<scalar_t, 128>(out, q, k_cache, v_cache, rows, tables, lens, scale, window, softcap);
    } else {
      decode_attention_impl<scalar_t, 0>(out, q, k_cache, v_cache, rows, tables, lens, scale, window, softcap);
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight must match x");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor sum;
  const at::Tensor* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    sum = at::empty_like(x, at::MemoryFormat::Contiguous);
    res = &residual.value();
  }
  DFLLM_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(out, sum, x, res, weight, eps));
  if (res) return {out, sum};
  return {out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [rows, 2 * n], rows contiguous");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  DFLLM_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(out, x));
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim], last dim contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(1) == 1 &&
                  sin.stride(1) == 1 && cos.strides() == sin.strides() && cos.size(1) * 2 == x.size(2),
              "cos/sin must be float32 [tokens, head_dim / 2]");
  auto out = at::empty(x.sizes(), x.options());
  DFLLM_DISPATCH(x.scalar_type(), "rotary", rotary_impl<scalar_t>(out, x, cos, sin));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("rms_norm", &rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary", &rotary);
}
