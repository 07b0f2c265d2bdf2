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
#include <atomic>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

// bfloat16 <-> float32 as integer arithmetic that the compiler vectorises (c10's conversions
// are out-of-line scalar calls: a bfloat16 SiLU-and-multiply ran 15x slower than float32 on
// them). Widening is exact; narrowing rounds to nearest even, NaN to 0x7FC0, as c10 does.
template <>
inline float f32(at::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// x rounded to T's precision, as a float (f32(static_cast<T>(x)), vectorisable for bfloat16)
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return f32(at::BFloat16(bf16_bits(x), at::BFloat16::from_bits()));
  } else {
    return f32(static_cast<T>(x));
  }
}

// *p = x rounded to T; for bfloat16 a store of the raw bits (a loop of struct copies does
// not vectorise)
template <typename T>
inline void put(T* p, float x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    *reinterpret_cast<uint16_t*>(p) = bf16_bits(x);
  } else {
    *p = static_cast<T>(x);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Eight floats as a GCC vector type: one AVX2 register, or two SSE ones. Kernels written with
// it (not intrinsics) build for every x86 capability.
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));  // the lanes of a comparison: -1 true, 0 false

inline v8f vload(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// x in every lane (one vbroadcastss; `v8f{} + x` would add +0.0 first, which is no identity for -0.0)
inline v8f vbroadcast(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// Lanes of a and b (0-7 a's, 8-15 b's) picked by eight constant indices: GCC's and clang's
// builtins (GCC before 12 has only its own)
#if defined(__clang__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// The 8 x 8 floats in b transposed in place (lane j of b[i] <- lane i of b[j]): unpacks of
// pairs, then of 64-bit pairs within each half, then the halves exchanged.
inline void transpose8(v8f b[8]) {
  v8f t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = SHUFFLE8(b[i], b[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = SHUFFLE8(b[i], b[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    b[i] = SHUFFLE8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    b[i + 1] = SHUFFLE8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    b[i + 2] = SHUFFLE8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    b[i + 3] = SHUFFLE8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = SHUFFLE8(b[i], b[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    t[i + 4] = SHUFFLE8(b[i], b[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 8; ++i) b[i] = t[i];
}

// Sixteen lanes: one AVX-512 register (two AVX2 ones where the build has no AVX-512)
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// c in every lane of F (float, v8f or v16f)
template <typename F>
inline F splat(float c) {
  if constexpr (std::is_same_v<F, float>) {
    return c;
  } else if constexpr (std::is_same_v<F, v16f>) {
    return v16f{c, c, c, c, c, c, c, c, c, c, c, c, c, c, c, c};
  } else {
    return vbroadcast(c);
  }
}

// exp(x) for the softmax and SiLU (std::exp stays a scalar library call), on a float or on 8
// lanes (F, with U its bits as unsigned integers): Cephes' expf, range reduction to
// [-ln2/2, ln2/2], a degree-6 polynomial, then 2^n through the exponent bits; within 2 ulp of
// std::exp on [-87, 88] (below, it returns ~0; above, the value at 88). n is rounded to nearest
// even by adding 1.5 * 2^23, whose low mantissa bits then hold n: no float-integer conversion.
// A softmax over fast_exp8 ran 1.5x faster than the compiler's vectorisation of a loop over
// fast_exp (AVX2), with the same values.
template <typename F, typename U>
inline F exp_steps(F x) {
  const F lo = splat<F>(-87.3f), hi = splat<F>(88.3f), round = splat<F>(12582912.f);  // 1.5 * 2^23
  x = x < lo ? lo : (x > hi ? hi : x);
  const F shifted = x * splat<F>(1.44269504088896341f) + round;
  const F n = shifted - round;
  x -= n * splat<F>(0.693359375f);
  x -= n * splat<F>(-2.12194440e-4f);
  F y = splat<F>(1.9875691500e-4f);
  y = y * x + splat<F>(1.3981999507e-3f);
  y = y * x + splat<F>(8.3334519073e-3f);
  y = y * x + splat<F>(4.1665795894e-2f);
  y = y * x + splat<F>(1.6666665459e-1f);
  y = y * x + splat<F>(5.0000001201e-1f);
  y = y * x * x + x + splat<F>(1.0f);
  U bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits << 23) + (127u << 23);  // n + 127 in the exponent field
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline float fast_exp(float x) { return exp_steps<float, uint32_t>(x); }
inline v8f fast_exp8(v8f x) { return exp_steps<v8f, v8u>(x); }
inline v16f fast_exp16v(v16f x) { return exp_steps<v16f, v16u>(x); }

// N (8 or 16) values of T as floats, and back (rounded to T): float and bfloat16 as
// whole-vector operations (the same rounding as bf16_bits), other types lane by lane. F is
// the float vector (v8f, v16f); Lanes<F> gives its integer and bfloat16 companions.
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));

template <typename F>
struct Lanes;
template <>
struct Lanes<v8f> {
  typedef v8u U;
  typedef v8h H;
  static constexpr int n = 8;
};
template <>
struct Lanes<v16f> {
  typedef v16u U;
  typedef v16h H;
  static constexpr int n = 16;
};

template <typename F, typename T>
inline F load_lanes(const T* p) {
  F f;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&f, p, sizeof(f));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    typename Lanes<F>::H h;
    std::memcpy(&h, p, sizeof(h));
    const typename Lanes<F>::U u = __builtin_convertvector(h, typename Lanes<F>::U) << 16;
    std::memcpy(&f, &u, sizeof(f));
  } else {
    for (int i = 0; i < Lanes<F>::n; ++i) f[i] = f32(p[i]);
  }
  return f;
}

template <typename F>
inline typename Lanes<F>::U bf16_bits_lanes(F x) {
  using U = typename Lanes<F>::U;
  U u;
  std::memcpy(&u, &x, sizeof(u));
  const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? U{} + 0x7FC0u : rounded;
}

template <typename T, typename F>
inline void store_lanes(T* p, F x) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &x, sizeof(x));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const typename Lanes<F>::H h = __builtin_convertvector(bf16_bits_lanes(x), typename Lanes<F>::H);
    std::memcpy(p, &h, sizeof(h));
  } else {
    for (int i = 0; i < Lanes<F>::n; ++i) p[i] = static_cast<T>(x[i]);
  }
}

// x rounded to T's precision, as floats (round_to on every lane)
template <typename T, typename F>
inline F round_lanes(F x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const typename Lanes<F>::U u = bf16_bits_lanes(x) << 16;
    F f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  } else {
    for (int i = 0; i < Lanes<F>::n; ++i) x[i] = round_to<T>(x[i]);
    return x;
  }
}

template <typename T>
inline void load(float* dst, const T* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = f32(src[i]);
}

// One KV head of m cached tokens as float32, for a prefill tile: the cache itself (TC float),
// or only that head's DIM values of each token (at h_off in each slot of `slot` elements)
// widened into `wide`, in the cache's slot layout (the rest left unwritten and never read);
// returns the head's values, slots `slot` apart. With 3 KV heads the whole slots had tripled
// the widening, with 8 (Llama 3, Qwen3) it cost more than the weighted sum itself.
template <int DIM, typename TC>
inline const float* head_as_float(const TC* p, int64_t m, int64_t slot, int64_t h_off, float* wide) {
  if constexpr (std::is_same_v<TC, float>) {
    return p + h_off;
  } else {
    for (int64_t t = 0; t < m; ++t) load(wide + t * slot + h_off, p + t * slot + h_off, DIM);
    return wide + h_off;
  }
}

// Each query head's softmax over its scores [heads, span], in place and unnormalised
// (exp(s - max)); each head's sum goes to total[head], by which its output is divided at the
// end. With cap > 0 the scores are soft-capped first: cap * tanh(s / cap).
inline void softmax_heads(float* scores, float* total, int64_t heads, int64_t span, float cap) {
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* s = scores + hq * span;
    if (cap > 0.f) {
      for (int64_t j = 0; j < span; ++j) s[j] = cap * std::tanh(s[j] / cap);
    }
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < span; ++j) m = std::max(m, s[j]);
    const v8f mv = vbroadcast(m);
    v8f sums = {};
    int64_t j = 0;
    for (; j + 8 <= span; j += 8) {
      const v8f p = fast_exp8(vload(s + j) - mv);
      vstore(s + j, p);
      sums += p;
    }
    float sum = 0.f;
    for (; j < span; ++j) {
      s[j] = fast_exp(s[j] - m);
      sum += s[j];
    }
    for (int e = 0; e < 8; ++e) sum += sums[e];
    total[hq] = sum;
  }
}

// The softmax of each of the R columns of scores [span, R] (a tile's query rows in lanes, R a
// multiple of 8), in place and unnormalised (exp(s - the column's max)); each column's sum goes
// to total[r]. A score of -inf (a key the row may not see) weighs exactly 0.
template <int R>
inline void softmax_lanes(float* sbuf, int64_t span, float* total) {
  static_assert(R % 8 == 0, "softmax_lanes takes whole vectors of rows");
  constexpr int NV = R / 8;
  const v8f neg_inf = vbroadcast(-std::numeric_limits<float>::infinity()), zero = {};
  v8f mx[NV], sum[NV];
  for (int v = 0; v < NV; ++v) {
    mx[v] = neg_inf;
    sum[v] = zero;
  }
  for (int64_t u = 0; u < span; ++u)
    for (int v = 0; v < NV; ++v) {
      const v8f x = vload(sbuf + u * R + 8 * v);
      mx[v] = x > mx[v] ? x : mx[v];
    }
  for (int64_t u = 0; u < span; ++u)
    for (int v = 0; v < NV; ++v) {
      float* su = sbuf + u * R + 8 * v;
      const v8f x = vload(su);
      // a hidden key's exp is finite (the column's max is), and is replaced by 0
      const v8f p = x == neg_inf ? zero : fast_exp8(x - mx[v]);
      vstore(su, p);
      sum[v] += p;
    }
  for (int v = 0; v < NV; ++v) vstore(total + 8 * v, sum[v]);
}

// out[head] = acc[head] / total[head] for every query head of one token, rounded to T.
template <typename T>
inline void normalize_heads(T* o, const float* acc, const float* total, int64_t heads, int64_t dim) {
  for (int64_t hq = 0; hq < heads; ++hq) {
    const float inv = 1.f / total[hq];
    for (int64_t d = 0; d < dim; ++d) put(o + hq * dim + d, acc[hq * dim + d] * inv);
  }
}

// What both attention kernels read, unpacked once into raw pointers and sizes: q and out (of
// element type T), the paged KV caches (of TC) and the block tables.
template <typename T, typename TC>
struct PagedCall {
  int64_t heads, dim, bs, kv_heads, width, group, q_row, q_head, o_row, slot, window;
  float sc;
  const T* qp;
  const TC* kp;
  const TC* vp;
  T* op;
  const int32_t* tp;

  PagedCall(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, double scale, int64_t window)
      : heads(q.size(1)), dim(q.size(2)), bs(k_cache.size(1)), kv_heads(k_cache.size(2)), width(tables.size(1)),
        group(heads / kv_heads), q_row(q.stride(0)), q_head(q.stride(1)), o_row(out.stride(0)),
        slot(kv_heads * dim), window(window), sc(static_cast<float>(scale)), qp(q.data_ptr<T>()),
        kp(k_cache.data_ptr<TC>()), vp(v_cache.data_ptr<TC>()), op(out.data_ptr<T>()),
        tp(tables.data_ptr<int32_t>()) {}

  // The chunk of keys [j, j + m) of a sequence (block table `table`) that the kernels walk: at
  // most 16 tokens, within one block, none at or past `end`. Sets m; returns the chunk's
  // element offset in a cache.
  int64_t chunk(const int32_t* table, int64_t j, int64_t end, int64_t& m) const {
    const int64_t b = j / bs;
    m = std::min({int64_t{16}, end - j, (b + 1) * bs - j});
    return (static_cast<int64_t>(table[b]) * bs + j % bs) * slot;
  }
};

// One decode_attention call (passed by value, so that the compiler never reloads a field):
// the decodes' query rows and context lengths, and the soft cap.
template <typename T, typename TC>
struct DecodeCall : PagedCall<T, TC> {
  int64_t n;
  float cap;
  const int64_t* rp;
  const int32_t* lp;

  DecodeCall(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
             double softcap)
      : PagedCall<T, TC>(out, q, k_cache, v_cache, tables, scale, window), n(rows.size(0)),
        cap(static_cast<float>(softcap)), rp(rows.data_ptr<int64_t>()), lp(lens.data_ptr<int32_t>()) {}

  // decode i's first key: its window's, or 0 (blocks before a sliding window are never read)
  int64_t first_key(int64_t i) const { return this->window > 0 ? std::max<int64_t>(0, lp[i] - this->window) : 0; }
};

// body(begin, end) over [0, n) on torch's intra-op threads, one contiguous range per thread,
// the ranges cut so that each holds an equal share of the total cost(i). at::parallel_for cuts
// equal counts of items, which leaves a thread idle while another finishes the longer
// sequences of a batch of mixed lengths.
template <typename Cost, typename Body>
void parallel_balanced(int64_t n, const Cost& cost, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    if (n > 0) body(0, n);
    return;
  }
  std::vector<double> upto(n + 1, 0.0);  // cost of items [0, i)
  for (int64_t i = 0; i < n; ++i) upto[i + 1] = upto[i] + static_cast<double>(cost(i));
  std::vector<int64_t> cuts(threads + 1, n);
  cuts[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const double goal = upto[n] * static_cast<double>(t) / static_cast<double>(threads);
    cuts[t] = std::lower_bound(upto.begin(), upto.end(), goal) - upto.begin();
    cuts[t] = std::clamp<int64_t>(cuts[t], cuts[t - 1], n);
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      if (cuts[t] < cuts[t + 1]) body(cuts[t], cuts[t + 1]);
  });
}

// A decode's cost for parallel_balanced: the keys it reads, plus a fixed share for its query.
template <typename Call>
int64_t decode_cost(const Call& a, int64_t i) {
  return a.lp[i] - a.first_key(i) + 16;
}

// One decode query per sequence: its query heads read the sequence's keys and values block by
// block through its block table, in two passes (scores, then the weighted sum of values).
// Only the positions [start, len) are read: padding and blocks before a sliding window never are.
// DIM > 0 fixes the head dimension at compile time (the common 64 and 128), so that the dot
// products and sums over it unroll into a few vector instructions.
template <typename T, typename TC, int DIM>
void decode_attention_impl(const DecodeCall<T, TC> a) {
  const int64_t dim = DIM > 0 ? DIM : a.dim;

  // one task per sequence, every head of a cached token at once: each token's slot (all KV
  // heads, contiguous) is read in one sweep, which the hardware prefetcher follows
  parallel_balanced(a.n, [&](int64_t i) { return decode_cost(a, i); }, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(a.heads * dim), acc(a.heads * dim), kv(a.slot), scores, total(a.heads);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t len = a.lp[i];
      const int64_t start = a.first_key(i);
      const int64_t span = len - start;
      const int32_t* table = a.tp + i * a.width;
      scores.resize(a.heads * span);
      load(qf.data(), a.qp + a.rp[i] * a.q_row, a.heads * dim);
      // pass 1: scores [heads, span]
      for (int64_t j = start; j < len; ++j) {
        const TC* key = a.kp + (static_cast<int64_t>(table[j / a.bs]) * a.bs + j % a.bs) * a.slot;
        const float* kf;
        if constexpr (std::is_same_v<TC, float>) {
          kf = key;
        } else {
          load(kv.data(), key, a.slot);
          kf = kv.data();
        }
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          for (int64_t hq = h * a.group; hq < (h + 1) * a.group; ++hq) {
            scores[hq * span + (j - start)] = dot(&qf[hq * dim], kf + h * dim, dim) * a.sc;
          }
        }
      }
      // softmax per query head (unnormalised weights; divided at the end)
      softmax_heads(scores.data(), total.data(), a.heads, span, a.cap);
      // pass 2: weighted sum of the values
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = start; j < len; ++j) {
        const TC* value = a.vp + (static_cast<int64_t>(table[j / a.bs]) * a.bs + j % a.bs) * a.slot;
        const float* vf;
        if constexpr (std::is_same_v<TC, float>) {
          vf = value;
        } else {
          load(kv.data(), value, a.slot);
          vf = kv.data();
        }
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          const float* vh = vf + h * dim;
          for (int64_t hq = h * a.group; hq < (h + 1) * a.group; ++hq) {
            const float w = scores[hq * span + (j - start)];
            float* a = &acc[hq * dim];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
          }
        }
      }
      normalize_heads(a.op + a.rp[i] * a.o_row, acc.data(), total.data(), a.heads, dim);
    }
  });
}

#if defined(__AVX512F__)
// The 16 x 16 floats in r transposed in place (lane j of r[i] <- lane i of r[j]): unpacks of
// pairs, then of 64-bit pairs, then two rounds of 128-bit block shuffles.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  const auto lo = [](__m512 x, __m512 y) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
  };
  const auto hi = [](__m512 x, __m512 y) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
  };
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// 16 consecutive values of a cached key or value, widened to float32
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// m cached tokens (slots of `slot` elements) from p as float32: the cache itself, or (bfloat16 or
// float16) widened once into `wide` rather than once per query head that reads them
template <typename TC>
inline const float* as_float(const TC* p, int64_t m, int64_t slot, float* wide) {
  if constexpr (std::is_same_v<TC, float>) {
    return p;
  } else {
    for (int64_t e = 0; e < m * slot; e += 16) _mm512_storeu_ps(&wide[e], load16(p + e));
    return wide;
  }
}

// fast_exp on 16 lanes: the same steps (round to nearest, the same polynomial), so the same values
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
  const __m512i ni = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_cvtepi32_ps(ni);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, x), x, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23)));
}

// softmax_heads with AVX-512 (the max and the exponentials 16 lanes at a time, the tail masked;
// without a cap: the capped scores take softmax_heads)
inline void softmax_heads16(float* scores, float* total, int64_t heads, int64_t span) {
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* s = scores + hq * span;
    const __mmask16 tail = static_cast<__mmask16>((1u << (span % 16)) - 1);
    const int64_t body = span - span % 16;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < body; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + body));
    mv = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < body; j += 16) {
      const __m512 p = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
      _mm512_storeu_ps(s + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    if (tail) {
      const __m512 p = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + body), mv));
      _mm512_mask_storeu_ps(s + body, tail, p);
      sum = _mm512_mask_add_ps(sum, tail, sum, p);
    }
    total[hq] = _mm512_reduce_add_ps(sum);
  }
}

// Four vectors in, one out: each 128-bit lane holds the four vectors' sums over that lane's
// four elements ([x0, x1, x2, x3]), in 6 shuffles and adds
inline __m512 sum_lanes4(const __m512* x) {
  // within 128-bit lanes: [x0 0+2, x1 0+2, x0 1+3, x1 1+3]
  const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a0), _mm512_castps_pd(a1));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a0), _mm512_castps_pd(a1));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

// Sixteen vectors in, one out: lane t holds the sum of the lanes of x[t] (16 dot products
// finished at once, in 45 shuffles and adds instead of 16 horizontal reductions of about 10).
inline __m512 sum_lanes16(__m512 x[16]) {
  __m512 b[4], c[2];
  for (int i = 0; i < 4; ++i) b[i] = sum_lanes4(x + 4 * i);  // [x0, x1, x2, x3] partial sums per 128-bit lane
  for (int i = 0; i < 2; ++i) {  // across pairs of 128-bit lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Whether this CPU has AVX512-BF16's dot product (vdpbf16ps); the library is built for plain
// AVX-512, so the functions that use it carry their own target and are called only when it is.
const bool kBf16Dot = __builtin_cpu_supports("avx512bf16");
typedef int32_t __attribute__((may_alias)) AliasedPair;  // two bfloat16 of a row, read as one
// decode_attention calls whose bfloat16 scores took chunk_scores_bf16, prefill_attention calls
// that took dot_chunk_scores (read by the tests)
std::atomic<int64_t> bf16_dot_calls{0};
std::atomic<int64_t> bf16_dot_prefill_calls{0};
// the prefill kernel takes them unless switched off (set_bf16_dot: the tests compare both paths)
std::atomic<bool> bf16_dot_prefill_enabled{true};

// The lines of m tokens' slots from element offset `at` of a cache: what a chunk reads.
template <typename TC>
inline int64_t chunk_lines(const TC* at, int64_t m, int64_t slot) {
  const auto from = reinterpret_cast<uintptr_t>(at), to = reinterpret_cast<uintptr_t>(at + m * slot);
  return static_cast<int64_t>((to - (from & ~uintptr_t{63}) + 63) / 64);
}

// The cache lines a decode thread reads, in the order it reads them (a sequence's keys chunk by
// chunk, then its values, then the next sequence's keys), issued as prefetches a fixed distance
// ahead of the reads: the blocks are scattered, so the hardware prefetcher loses the stream at
// every block's end, and a prefetch of only the next chunk left the first chunks of each pass
// and each sequence to arrive on demand. A thread issues kAheadLines (16 kB) at its start, then
// as many lines as it reads, so that the distance stays the same; into L2, since 16 kB ahead
// beside the chunk being read would crowd L1. On an AVX512-BF16 EPYC (2 threads, SmolLM2's
// 3 KV heads of 64, 30 layers' caches so that each read comes from memory) 64 sequences of
// ~110 tokens took 245-250 us a layer against 361 with only the next chunk prefetched (14 to
// 21 GB/s of KV, of 33 GB/s that a plain read stream reaches), 256 of ~225 tokens 2.3 ms
// against 4.6 ms; with T0 hints and the same distance, 360-560 us.
constexpr int64_t kAheadLines = 256;

template <typename T, typename TC>
struct DecodeAhead {
  const DecodeCall<T, TC>& a;
  int64_t i, end, j = 0;  // the sequence and token whose lines come next, and the thread's end
  bool values = false;     // walking the sequence's values (else its keys)
  const char* p = nullptr;
  int64_t left = 0;  // lines of the current chunk not yet issued

  DecodeAhead(const DecodeCall<T, TC>& a, int64_t begin, int64_t end) : a(a), i(begin), end(end) {
    if (i < end) j = a.first_key(i);
  }

  void issue(int64_t n) {
    while (n > 0) {
      if (left == 0 && !next()) return;
      const int64_t k = std::min(n, left);
      for (int64_t l = 0; l < k; ++l) _mm_prefetch(p + l * 64, _MM_HINT_T1);
      p += k * 64;
      left -= k;
      n -= k;
    }
  }

  bool next() {
    while (i < end) {
      const int64_t len = a.lp[i];
      if (j < len) {
        int64_t m;
        const TC* at = (values ? a.vp : a.kp) + a.chunk(a.tp + i * a.width, j, len, m);
        p = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(at) & ~uintptr_t{63});
        left = chunk_lines(at, m, a.slot);
        j += m;
        return true;
      }
      if (!values) {
        values = true;
      } else {
        values = false;
        if (++i < end) j = a.first_key(i);
        continue;
      }
      j = a.first_key(i);
    }
    return false;
  }
};

// A bfloat16 key row of zeros: what chunk_scores_bf16 reads in place of a key past the chunk's end
alignas(64) constexpr uint16_t kZeroKey[128] = {};

// The scores of m (<= 16) keys of one KV head (kh, rows `slot` elements apart) for NH query heads
// of its group, sc * (q . k), into s + k * span for head k. Each vdpbf16ps operand holds half a
// head dimension's 16-element block from each of two keys, t and t + 4 (the query's block in both
// halves, qq: NH x DIM / 16 such vectors), so that four vectors' sums hold eight keys and reduce
// to them in 9 shuffles and adds, where sixteen keys' full vectors took 45 (sum_lanes16): that
// reduction had cost as much as the dot products. The products are exact in float32 and summed
// in float32 (in another order than the float32 loop, and with float32 subnormals flushed to
// zero). 64 sequences of ~130 tokens, SmolLM2's heads: ~280 -> ~250 us a layer.
template <int DIM, int NH>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) inline void pair_scores(
    const __m512i* qq, const at::BFloat16* kh, int64_t slot, int64_t m, float sc, float* s, int64_t span) {
  static_assert(DIM % 32 == 0 && DIM <= 128, "DIM must be 32, 64 or 128");
  constexpr int C = DIM / 16;
  const auto* zero = reinterpret_cast<const at::BFloat16*>(kZeroKey);
  for (int64_t base = 0; base < m; base += 8) {
    __m512 acc[NH][4];
    for (int k = 0; k < NH; ++k)
      for (int i = 0; i < 4; ++i) acc[k][i] = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const at::BFloat16* pa = base + i < m ? kh + (base + i) * slot : zero;
      const at::BFloat16* pb = base + i + 4 < m ? kh + (base + i + 4) * slot : zero;
      for (int c = 0; c < C; ++c) {
        const __m512i kv =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa + 16 * c))),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 16 * c)), 1);
        for (int k = 0; k < NH; ++k) acc[k][i] = _mm512_dpbf16_ps(acc[k][i], (__m512bh)qq[k * C + c], (__m512bh)kv);
      }
    }
    const __mmask8 keep = static_cast<__mmask8>((1u << std::min<int64_t>(8, m - base)) - 1);
    for (int k = 0; k < NH; ++k) {
      const __m512 b = sum_lanes4(acc[k]);
      // lanes 0 + 1 are keys base..base+3, lanes 2 + 3 keys base+4..base+7
      const __m512 h = _mm512_add_ps(b, _mm512_shuffle_f32x4(b, b, _MM_SHUFFLE(2, 3, 0, 1)));
      const __m256 r = _mm512_castps512_ps256(_mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(0, 0, 2, 0)));
      _mm256_mask_storeu_ps(s + k * span + base, keep, _mm256_mul_ps(r, _mm256_set1_ps(sc)));
    }
  }
}

// The most query heads pair_scores takes at once: 16 accumulators of the 32 vector registers
constexpr int kScoreHeads = 4;

// pair_scores for nh (1 to NH) query heads: the instance whose accumulators are all in registers
template <int DIM, int NH = kScoreHeads>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) inline void pair_scores_heads(
    int64_t nh, const __m512i* qq, const at::BFloat16* kh, int64_t slot, int64_t m, float sc, float* s, int64_t span) {
  if constexpr (NH > 0) {
    if (nh == NH) {
      pair_scores<DIM, NH>(qq, kh, slot, m, sc, s, span);
    } else {
      pair_scores_heads<DIM, NH - 1>(nh, qq, kh, slot, m, sc, s, span);
    }
  }
}

// A decode's bfloat16 query as pair_scores's operands: each head's 16-element blocks in both
// halves of a vector (qq [heads, DIM / 16])
template <int DIM>
void pair_queries(const at::BFloat16* q, int64_t heads, __m512i* qq) {
  for (int64_t e = 0; e < heads * DIM; e += 16)
    qq[e / 16] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + e)));
}

// Pass 1 of decode_attention_avx512 for one chunk of m (<= 16) keys of a bfloat16 cache under
// bfloat16 queries (qq: pair_queries's): each KV head's keys read straight from the cache (no
// widening) by pair_scores for its query heads, up to four at a time.
template <int DIM, typename Ahead>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) void chunk_scores_bf16(
    const __m512i* qq, const at::BFloat16* key, int64_t slot, int64_t m, int64_t kv_heads, int64_t group, float sc,
    float* scores, int64_t span, Ahead& ahead, int64_t lines) {
  for (int64_t h = 0; h < kv_heads; ++h) {
    ahead.issue(lines * (h + 1) / kv_heads - lines * h / kv_heads);
    for (int64_t hq = h * group, last = (h + 1) * group; hq < last;) {
      const int64_t nh = std::min<int64_t>(kScoreHeads, last - hq);
      pair_scores_heads<DIM>(nh, qq + hq * (DIM / 16), key + h * DIM, slot, m, sc, scores + hq * span, span);
      hq += nh;
    }
  }
}

// Pass 2 of decode_attention_avx512 for one chunk of m cached values (vh: one KV head's, slots
// of `slot` elements) and NH query heads of its group: each value is widened once, in
// registers, and multiplied into every head's accumulator (acc [NH, DIM]; head k's weights at
// w + k * span). The same additions in the same order as one head at a time, without widening
// the chunk through memory first: a chunk's store and reloads of float32 values cost as many
// instructions as its multiply-adds.
template <int DIM, int NH, typename TC>
inline void chunk_values_heads(const TC* vh, int64_t slot, int64_t m, const float* w, int64_t span, float* acc) {
  constexpr int C = DIM / 16;
  __m512 av[NH][C];
  for (int k = 0; k < NH; ++k)
    for (int c = 0; c < C; ++c) av[k][c] = _mm512_loadu_ps(acc + k * DIM + c * 16);
  for (int64_t t = 0; t < m; ++t) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vh + t * slot + c * 16);
    for (int k = 0; k < NH; ++k) {
      const __m512 wt = _mm512_set1_ps(w[k * span + t]);
      for (int c = 0; c < C; ++c) av[k][c] = _mm512_fmadd_ps(wt, v[c], av[k][c]);
    }
  }
  for (int k = 0; k < NH; ++k)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + k * DIM + c * 16, av[k][c]);
}

// The most query heads chunk_values_heads takes at once: their accumulators fill half the 32
// vector registers, the widened value and the weight take a few more.
template <int DIM>
constexpr int kValueHeads = 16 / (DIM / 16);

// chunk_values_heads for nh (1 to NH) heads: the instance whose accumulators are all in registers
template <int DIM, typename TC, int NH = kValueHeads<DIM>>
inline void chunk_values(int64_t nh, const TC* vh, int64_t slot, int64_t m, const float* w, int64_t span,
                         float* acc) {
  if constexpr (NH > 0) {
    if (nh == NH) {
      chunk_values_heads<DIM, NH>(vh, slot, m, w, span, acc);
    } else {
      chunk_values<DIM, TC, NH - 1>(nh, vh, slot, m, w, span, acc);
    }
  }
}

// decode_attention_impl with AVX-512, for head dimensions that are a multiple of 16. The keys
// and values are walked in chunks of up to 16 tokens of one block (one address computation per
// chunk, the lines ahead prefetched by DecodeAhead); a chunk stays in L1 while every query head
// reads it. A head's 16
// dot products end in one transposing reduction, and its value accumulator stays in registers
// through the chunk. The same two passes and softmax as decode_attention_impl, so the same
// results up to the order of the float32 additions within a dot product.
template <typename T, typename TC, int DIM>
void decode_attention_avx512(const DecodeCall<T, TC> a) {
  static_assert(DIM % 16 == 0 && DIM > 0, "DIM must be a multiple of 16");
  constexpr int C = DIM / 16;
  constexpr int64_t CHUNK = 16;
  // bfloat16 queries over a bfloat16 cache: the scores through AVX512-BF16 where the CPU has it
  constexpr bool bf16_dot = std::is_same_v<T, at::BFloat16> && std::is_same_v<TC, at::BFloat16> && DIM % 32 == 0;
  if constexpr (bf16_dot) {
    if (kBf16Dot) bf16_dot_calls.fetch_add(1, std::memory_order_relaxed);
  }

  parallel_balanced(a.n, [&](int64_t i) { return decode_cost(a, i); }, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(a.heads * DIM), acc(a.heads * DIM), scores, total(a.heads);
    std::vector<float> wide(std::is_same_v<TC, float> ? 0 : CHUNK * a.slot);
    std::vector<__m512i> qq(bf16_dot ? a.heads * DIM / 16 : 0);
    DecodeAhead<T, TC> ahead(a, begin, end);
    ahead.issue(kAheadLines);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t len = a.lp[i];
      const int64_t start = a.first_key(i);
      const int64_t span = len - start;
      const int32_t* table = a.tp + i * a.width;
      scores.resize(a.heads * span);
      load(qf.data(), a.qp + a.rp[i] * a.q_row, a.heads * DIM);
      if constexpr (bf16_dot) {
        if (kBf16Dot) pair_queries<DIM>(a.qp + a.rp[i] * a.q_row, a.heads, qq.data());
      }
      // pass 1: scores [heads, span]
      for (int64_t j = start; j < len;) {
        int64_t m;
        const TC* key_at = a.kp + a.chunk(table, j, len, m);
        // as many lines ahead as this chunk reads, a share on each query head's turn
        const int64_t lines = chunk_lines(key_at, m, a.slot);
        if constexpr (bf16_dot) {
          if (kBf16Dot) {
            chunk_scores_bf16<DIM>(qq.data(), key_at, a.slot, m, a.kv_heads, a.group, a.sc, &scores[j - start],
                                   span, ahead, lines);
            j += m;
            continue;
          }
        }
        const float* key = as_float(key_at, m, a.slot, wide.data());
        for (int64_t hq = 0; hq < a.heads; ++hq) {
          ahead.issue(lines * (hq + 1) / a.heads - lines * hq / a.heads);
          const float* kh = key + (hq / a.group) * DIM;
          __m512 qv[C], dots[CHUNK];
          for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(&qf[hq * DIM + c * 16]);
          for (int64_t t = 0; t < CHUNK; ++t) {
            if (t < m) {
              __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kh + t * a.slot));
              for (int c = 1; c < C; ++c) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kh + t * a.slot + c * 16), d);
              dots[t] = d;
            } else {
              dots[t] = _mm512_setzero_ps();
            }
          }
          _mm512_mask_storeu_ps(&scores[hq * span + (j - start)], static_cast<__mmask16>((1u << m) - 1),
                                _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(a.sc)));
        }
        j += m;
      }
      if (a.cap > 0.f) {
        softmax_heads(scores.data(), total.data(), a.heads, span, a.cap);
      } else {
        softmax_heads16(scores.data(), total.data(), a.heads, span);
      }
      // pass 2: weighted sum of the values, a KV head's query heads a few at a time
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = start; j < len;) {
        int64_t m;
        const TC* value_at = a.vp + a.chunk(table, j, len, m);
        const int64_t lines = chunk_lines(value_at, m, a.slot);
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          ahead.issue(lines * (h + 1) / a.kv_heads - lines * h / a.kv_heads);
          for (int64_t hq = h * a.group, last = (h + 1) * a.group; hq < last;) {
            const int64_t nh = std::min<int64_t>(kValueHeads<DIM>, last - hq);
            chunk_values<DIM, TC>(nh, value_at + h * DIM, a.slot, m, &scores[hq * span + (j - start)], span,
                                  &acc[hq * DIM]);
            hq += nh;
          }
        }
        j += m;
      }
      normalize_heads(a.op + a.rp[i] * a.o_row, acc.data(), total.data(), a.heads, DIM);
    }
  });
}

#endif  // __AVX512F__

// One prefill_attention call: every prefill span of a step (the sequences with more than one
// query) attends causally over its keys, which are already in the paged cache (its cached
// prefix and its own new tokens alike), read through its block table.
template <typename T, typename TC>
struct PrefillCall : PagedCall<T, TC> {
  int64_t n;
  const int32_t* qsl;
  const int32_t* lens;

  PrefillCall(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& tables, double scale,
              int64_t window)
      : PagedCall<T, TC>(out, q, k_cache, v_cache, tables, scale, window), n(seq_lens.size(0)),
        qsl(query_start_loc.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()) {}
};

// A tile of a span's queries for one KV head: `tokens` consecutive queries from `first`, each
// with the group's query heads, so rows r = token * group + head (at most 64 rows).
struct PrefillTile {
  int64_t seq, kv_head, first, tokens, cost;
};

// Where a prefill tile sits: its span's first query row (q_start) and position (base), its
// rows (tokens times the group's heads), its first and last query positions, and the keys
// [kstart, kend) its rows may see.
struct TileSpan {
  int64_t q_start, base, rows, first_pos, last_pos, kstart, kend;
};

template <typename T, typename TC>
TileSpan tile_span(const PrefillCall<T, TC>& a, const PrefillTile& tile) {
  const int64_t q_start = a.qsl[tile.seq], q_len = a.qsl[tile.seq + 1] - q_start;
  const int64_t base = a.lens[tile.seq] - q_len;
  const int64_t first_pos = base + tile.first, last_pos = first_pos + tile.tokens - 1;
  const int64_t kstart = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  return {q_start, base, tile.tokens * a.group, first_pos, last_pos, kstart, last_pos + 1};
}

// A prefill tile's queries, transposed to [DIM, R] and scaled (qt; none: the positions alone),
// and each row's position (the span's first query at `base`); padding rows are zero and sit at
// the tile's last position.
template <typename T, typename TC, int DIM, int R>
void tile_queries(const PrefillCall<T, TC>& a, const PrefillTile& tile, int64_t q_start, int64_t base, int32_t* pos,
                  float* qt) {
  const int64_t rows = tile.tokens * a.group;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = std::min<int64_t>(r / a.group, tile.tokens - 1);
    pos[r] = static_cast<int32_t>(base + tile.first + t);
    if (qt == nullptr) continue;
    if (r < rows) {
      const T* qr = a.qp + (q_start + tile.first + t) * a.q_row + (tile.kv_head * a.group + r % a.group) * a.q_head;
      for (int d = 0; d < DIM; ++d) qt[d * R + r] = f32(qr[d]) * a.sc;
    } else {
      for (int d = 0; d < DIM; ++d) qt[d * R + r] = 0.f;
    }
  }
}

#if defined(__AVX512F__)
// ---- AMX: bfloat16 tiles for the prefill scores --------------------------------------------------
// Whether this CPU has AMX's bfloat16 tiles and Linux lets the process use them (the tile
// state is handed out on request, ARCH_REQ_XCOMP_PERM; oneDNN asks too, the answer is the same).
// CPUID is read directly: GCC 12's __builtin_cpu_supports does not know AMX.
bool amx_available() {
#if defined(__linux__)
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tiles = ((d >> 22) & 1) && ((d >> 24) & 1);  // AMX-BF16, AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return tiles && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// The prefill kernel takes AMX where available unless switched off (set_amx: benchmarks and the
// tests compare both paths); prefill_attention calls that did (read by the tests).
std::atomic<bool> amx_enabled{true};
std::atomic<int64_t> amx_prefill_calls{0};

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Pass 1 of prefill_tile on AMX for bfloat16 queries over a bfloat16 cache: the scores of m
// (<= 16) consecutive cached keys (row stride `stride` bytes) for the tile's R = 16 * NRV rows,
// sc * (q . k), written to s [keys, R] (rows m..15 of the 16 written are scratch, overwritten by
// the next chunk or never read). qb holds the queries as AMX's B operand: per 16 rows and 32
// dimensions a [16 pairs of dimensions][16 rows][2] block of the original bfloat16 values. The
// products of two bfloat16 values are exact in float32 and summed in float32 (in another order
// than the AVX-512 loop, and with float32 subnormals flushed to zero), so the scores are the
// float32 path's up to the order of additions; the scale is applied to the sum.
template <int DIM, int NRV>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl"))) void amx_chunk_scores(
    const at::BFloat16* key, int64_t stride, int64_t m, const uint16_t* qb, uint16_t* pad, float* s, float sc) {
  static_assert(DIM % 32 == 0 && DIM <= 128, "DIM must be 32, 64, 96 or 128");
  constexpr int C2 = DIM / 32;  // A tiles (keys, 32 dimensions each)
  constexpr int R = 16 * NRV;
  const void* src = key;
  if (m < 16) {  // a short chunk: its keys copied into 16 rows, the rest zero (never read past the block)
    for (int64_t t = 0; t < 16; ++t) {
      if (t < m) {
        std::memcpy(pad + t * DIM, reinterpret_cast<const char*>(key) + t * stride, DIM * sizeof(uint16_t));
      } else {
        std::memset(pad + t * DIM, 0, DIM * sizeof(uint16_t));
      }
    }
    src = pad;
    stride = DIM * sizeof(uint16_t);
  }
  const char* k = static_cast<const char*>(src);
  _tile_loadd(0, k, stride);
  if constexpr (C2 > 1) _tile_loadd(1, k + 64, stride);
  if constexpr (C2 > 2) _tile_loadd(2, k + 128, stride);
  if constexpr (C2 > 3) _tile_loadd(3, k + 192, stride);
  for (int v = 0; v < NRV; ++v) {
    const uint16_t* b = qb + v * C2 * 512;
    _tile_zero(5);
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(5, 0, 4);
    if constexpr (C2 > 1) {
      _tile_loadd(4, b + 512, 64);
      _tile_dpbf16ps(5, 1, 4);
    }
    if constexpr (C2 > 2) {
      _tile_loadd(4, b + 1024, 64);
      _tile_dpbf16ps(5, 2, 4);
    }
    if constexpr (C2 > 3) {
      _tile_loadd(4, b + 1536, 64);
      _tile_dpbf16ps(5, 3, 4);
    }
    _tile_stored(5, s + 16 * v, R * sizeof(float));
  }
  const __m512 scale = _mm512_set1_ps(sc);
  for (int64_t t = 0; t < m; ++t)
    for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + t * R + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(s + t * R + 16 * v), scale));
}

// The tile configuration of amx_chunk_scores: tiles 0-3 keys, 4 queries, 5 scores, 16 rows of
// 64 bytes each. A constant in memory: GCC 12 dropped the stores into a local configuration
// before ldtilecfg read it (the builtin does not tell it that it reads the struct).
constexpr TileConfig make_tile_config() {
  TileConfig c{};
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}
constexpr TileConfig kTileConfig = make_tile_config();

// Load kTileConfig on the calling thread.
__attribute__((target("amx-tile"))) void amx_configure() { _tile_loadconfig(&kTileConfig); }

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// A prefill tile's queries (bfloat16) as amx_chunk_scores's B operand (see there); padding
// rows are zero.
template <typename TC, int DIM, int NRV>
void amx_tile_queries(const PrefillCall<at::BFloat16, TC>& a, const PrefillTile& tile, int64_t q_start, uint16_t* qb) {
  constexpr int C2 = DIM / 32;
  const int64_t rows = tile.tokens * a.group;
  for (int v = 0; v < NRV; ++v) {
    for (int r = 0; r < 16; ++r) {
      const int64_t row = 16 * v + r;
      const at::BFloat16* q = nullptr;
      if (row < rows) {
        const int64_t t = row / a.group;
        q = a.qp + (q_start + tile.first + t) * a.q_row + (tile.kv_head * a.group + row % a.group) * a.q_head;
      }
      // row r's dimensions as 32-bit pairs, one pair per row p of each block
      alignas(64) uint32_t pairs[DIM / 2] = {};
      if (q) std::memcpy(pairs, q, DIM * sizeof(uint16_t));
      for (int c = 0; c < C2; ++c) {
        uint32_t* blk = reinterpret_cast<uint32_t*>(qb + (v * C2 + c) * 512);
        for (int p = 0; p < 16; ++p) blk[p * 16 + r] = pairs[16 * c + p];
      }
    }
  }
}

// Pass 1 of prefill_tile with AVX512-BF16 where the CPU has no AMX: the scores of m cached keys
// (row stride `slot` elements) for the tile's R = 16 * NRV rows, sc * (q . k), into s [keys, R].
// The queries are amx_tile_queries's blocks, unscaled bfloat16: the 16 rows' pair p of
// dimensions of row vector v lie at qb + (v * DIM / 2 + p) * 32, one vdpbf16ps operand, the
// key's pair broadcast as the other. Exact products summed in float32, as on AMX: half the
// instructions of the float32 multiply-adds over the same values.
template <int DIM, int NRV>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) void dot_chunk_scores(
    const at::BFloat16* key, int64_t slot, int64_t m, const uint16_t* qb, float* s, float sc) {
  constexpr int P = DIM / 2;
  constexpr int64_t R = 16 * NRV;
  const __m512 scale = _mm512_set1_ps(sc);
  const uint16_t* k = reinterpret_cast<const uint16_t*>(key);
  auto query = [&](int v, int p) { return (__m512bh)_mm512_loadu_si512(qb + (v * P + p) * 32); };
  auto pair = [&](int64_t t, int p) {
    return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const AliasedPair*>(k + t * slot + 2 * p));
  };
  int64_t t = 0;
  for (; t + 4 <= m; t += 4) {  // four keys at a time: each query vector loaded once for four
    __m512 acc[4][NRV];
    for (int u = 0; u < 4; ++u)
      for (int v = 0; v < NRV; ++v) acc[u][v] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      __m512bh q[NRV];
      for (int v = 0; v < NRV; ++v) q[v] = query(v, p);
      for (int u = 0; u < 4; ++u) {
        const __m512bh kp = pair(t + u, p);
        for (int v = 0; v < NRV; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], q[v], kp);
      }
    }
    for (int u = 0; u < 4; ++u)
      for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + (t + u) * R + 16 * v, _mm512_mul_ps(acc[u][v], scale));
  }
  for (; t < m; ++t) {
    __m512 acc[NRV];
    for (int v = 0; v < NRV; ++v) acc[v] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512bh kp = pair(t, p);
      for (int v = 0; v < NRV; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], query(v, p), kp);
    }
    for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + t * R + 16 * v, _mm512_mul_ps(acc[v], scale));
  }
}
#endif  // __AVX512F__

#if defined(__AVX512F__)
// prefill_attention for head dimensions DIM of 32, 64 or 128, with AVX-512. A tile's rows are
// laid out in lanes: its queries transposed to [DIM, rows] (scaled), so that the scores of one
// key for all rows are DIM broadcast multiply-adds, with no horizontal sum; the scores
// [keys, rows], their max, exponentials and sums are taken lane-wise, and the output is
// accumulated transposed too ([DIM, rows]: a value's element broadcast times a weight vector).
// Two passes, as the decode kernels: scores and an exact softmax per row, then the weighted sum
// of the values. Keys after a query's position or before its window weigh exactly 0; keys before
// the tile's first window are never read (their blocks may have been freed).
template <typename T, typename TC, int DIM, int NRV>
void prefill_tile(const PrefillCall<T, TC>& a, const PrefillTile& tile, float* qt, float* sbuf, float* obuf,
                  float* wide, uint16_t* amx, bool tiles) {
  constexpr int R = 16 * NRV;  // rows of the tile, padded to whole vectors
  constexpr int C = DIM / 16;
  // bfloat16 queries over a bfloat16 cache: the scores on AMX's tiles where the CPU has them
  // (tiles), else from AVX512-BF16's dot products where it has those; `amx` holds the queries
  constexpr bool amx_types = std::is_same_v<T, at::BFloat16> && std::is_same_v<TC, at::BFloat16> && DIM % 32 == 0;
  const bool use_amx = amx_types && amx != nullptr && tiles;
  const bool use_dot = amx_types && amx != nullptr && !tiles;
  const auto [q_start, base, rows, first_pos, last_pos, kstart, kend] = tile_span(a, tile);
  const int32_t* table = a.tp + tile.seq * a.width;
  const int64_t h_off = tile.kv_head * DIM;

  // queries, transposed and scaled (AMX: its own layout, below); padding rows are zero and sit
  // at the last position
  alignas(64) int32_t pos[R];
  tile_queries<T, TC, DIM, R>(a, tile, q_start, base, pos, use_amx || use_dot ? nullptr : qt);
  __m512i posv[NRV];
  for (int v = 0; v < NRV; ++v) posv[v] = _mm512_load_si512(pos + 16 * v);

  auto chunk = [&](int64_t j, int64_t& m) { return a.chunk(table, j, kend, m); };
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // the scores s [m, R] of keys [j, j + m) that a row may not see (after its position, or
  // before its window): -inf
  auto mask_chunk = [&](int64_t j, int64_t m, float* s) {
    if (j + m - 1 > first_pos || (a.window > 0 && j <= last_pos - a.window)) {
      for (int64_t u = 0; u < m; ++u) {
        const __m512i key_pos = _mm512_set1_epi32(static_cast<int32_t>(j + u));
        for (int v = 0; v < NRV; ++v) {
          __mmask16 hidden = _mm512_cmp_epi32_mask(posv[v], key_pos, _MM_CMPINT_LT);
          if (a.window > 0) {
            const __m512i edge = _mm512_sub_epi32(posv[v], _mm512_set1_epi32(static_cast<int32_t>(a.window)));
            hidden |= _mm512_cmp_epi32_mask(edge, key_pos, _MM_CMPINT_NLT);
          }
          _mm512_mask_storeu_ps(s + u * R + 16 * v, hidden, neg_inf);
        }
      }
    }
  };

  if constexpr (amx_types) {
    if (use_amx || use_dot) amx_tile_queries<TC, DIM, NRV>(a, tile, q_start, amx);
    if (use_amx) amx_configure();
  }
  // pass 1: scores [keys, rows]
  for (int64_t j = kstart; j < kend;) {
    int64_t m;
    const int64_t at = chunk(j, m);  // sets m (before as_float reads it)
    float* s = sbuf + (j - kstart) * R;
    if constexpr (amx_types) {
      if (use_amx) {
        amx_chunk_scores<DIM, NRV>(a.kp + at + h_off, a.slot * static_cast<int64_t>(sizeof(TC)), m,
                                   amx, amx + NRV * (DIM / 32) * 512, s, a.sc);
        mask_chunk(j, m, s);
        j += m;
        continue;
      }
      if (use_dot) {
        dot_chunk_scores<DIM, NRV>(a.kp + at + h_off, a.slot, m, amx, s, a.sc);
        mask_chunk(j, m, s);
        j += m;
        continue;
      }
    }
    const float* key = head_as_float<DIM>(a.kp + at, m, a.slot, h_off, wide);
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) {  // four keys at a time: each query vector loaded once for four
      __m512 acc[4][NRV];
      for (int u = 0; u < 4; ++u)
        for (int v = 0; v < NRV; ++v) acc[u][v] = _mm512_setzero_ps();
      const float* k0 = key + t * a.slot;
      for (int d = 0; d < DIM; ++d) {
        __m512 qv[NRV];
        for (int v = 0; v < NRV; ++v) qv[v] = _mm512_loadu_ps(qt + d * R + 16 * v);
        for (int u = 0; u < 4; ++u) {
          const __m512 kd = _mm512_set1_ps(k0[u * a.slot + d]);
          for (int v = 0; v < NRV; ++v) acc[u][v] = _mm512_fmadd_ps(qv[v], kd, acc[u][v]);
        }
      }
      for (int u = 0; u < 4; ++u)
        for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + (t + u) * R + 16 * v, acc[u][v]);
    }
    for (; t < m; ++t) {
      __m512 acc[NRV];
      for (int v = 0; v < NRV; ++v) acc[v] = _mm512_setzero_ps();
      const float* kt = key + t * a.slot;
      for (int d = 0; d < DIM; ++d) {
        const __m512 kd = _mm512_set1_ps(kt[d]);
        for (int v = 0; v < NRV; ++v) acc[v] = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * R + 16 * v), kd, acc[v]);
      }
      for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + t * R + 16 * v, acc[v]);
    }
    mask_chunk(j, m, s);
    j += m;
  }
  if constexpr (amx_types) {
    if (use_amx) amx_release();
  }
  // softmax over each row's keys (lane-wise), unnormalised; hidden keys weigh exactly 0
  const int64_t span = kend - kstart;
  __m512 mx[NRV], total[NRV];
  for (int v = 0; v < NRV; ++v) {
    mx[v] = neg_inf;
    total[v] = _mm512_setzero_ps();
  }
  for (int64_t u = 0; u < span; ++u)
    for (int v = 0; v < NRV; ++v) mx[v] = _mm512_max_ps(mx[v], _mm512_loadu_ps(sbuf + u * R + 16 * v));
  for (int64_t u = 0; u < span; ++u) {
    for (int v = 0; v < NRV; ++v) {
      float* s = sbuf + u * R + 16 * v;
      const __m512 x = _mm512_loadu_ps(s);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ), fast_exp16(_mm512_sub_ps(x, mx[v])));
      _mm512_storeu_ps(s, p);
      total[v] = _mm512_add_ps(total[v], p);
    }
  }
  // pass 2: the weighted sum of the values, transposed like the queries: out[DIM, rows], four
  // dimensions at a time (each weight vector loaded once for four)
  for (int64_t e = 0; e < DIM * R; ++e) obuf[e] = 0.f;
  for (int64_t j = kstart; j < kend;) {
    int64_t m;
    const int64_t at = chunk(j, m);
    const float* value = head_as_float<DIM>(a.vp + at, m, a.slot, h_off, wide);
    const float* w = sbuf + (j - kstart) * R;
    for (int d0 = 0; d0 < DIM; d0 += 4) {
      __m512 acc[4][NRV];
      for (int e = 0; e < 4; ++e)
        for (int v = 0; v < NRV; ++v) acc[e][v] = _mm512_loadu_ps(obuf + (d0 + e) * R + 16 * v);
      for (int64_t u = 0; u < m; ++u) {
        __m512 wv[NRV];
        for (int v = 0; v < NRV; ++v) wv[v] = _mm512_loadu_ps(w + u * R + 16 * v);
        const float* vu = value + u * a.slot + d0;
        for (int e = 0; e < 4; ++e) {
          const __m512 x = _mm512_set1_ps(vu[e]);
          for (int v = 0; v < NRV; ++v) acc[e][v] = _mm512_fmadd_ps(wv[v], x, acc[e][v]);
        }
      }
      for (int e = 0; e < 4; ++e)
        for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(obuf + (d0 + e) * R + 16 * v, acc[e][v]);
    }
    j += m;
  }
  // out = obuf / total, each row's DIM values from obuf's column: 16 rows x 16 dimensions at a
  // time transposed in registers into `row` (rows of DIM), then rounded to T. Read column-wise
  // one value at a time, this had taken a quarter of the kernel (13.9k prompt tokens of
  // SmolLM2's heads: 18.5 -> 13.8 ms a layer without it); the same products, so the same bits.
  static_assert(DIM % 16 == 0, "the output is transposed in blocks of 16 dimensions");
  alignas(64) float row[16 * DIM];
  for (int v = 0; v < NRV && 16 * v < rows; ++v) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), total[v]);
    for (int c = 0; c < DIM / 16; ++c) {
      __m512 block[16];
      for (int e = 0; e < 16; ++e) block[e] = _mm512_mul_ps(_mm512_loadu_ps(obuf + (16 * c + e) * R + 16 * v), inv);
      transpose16(block);
      for (int e = 0; e < 16; ++e) _mm512_store_ps(row + e * DIM + 16 * c, block[e]);
    }
    for (int64_t e = 0, r = 16 * v; e < 16 && r < rows; ++e, ++r) {
      T* o = a.op + (q_start + tile.first + r / a.group) * a.o_row + (tile.kv_head * a.group + r % a.group) * DIM;
      const float* x = row + e * DIM;
      for (int d = 0; d < DIM; ++d) put(o + d, x[d]);
    }
  }
}

#else
// prefill_tile without intrinsics, for builds without AVX-512 (AVX2 and others): the same
// layout and the same two passes (queries transposed to [DIM, rows], scores [keys, rows],
// output [DIM, rows]), each loop over the tile's R rows written for the compiler to
// vectorise at whatever width the build has.
template <typename T, typename TC, int DIM, int NRV>
void prefill_tile(const PrefillCall<T, TC>& a, const PrefillTile& tile, float* qt, float* sbuf, float* obuf,
                  float* wide, uint16_t* /* amx, tiles: AVX-512 builds only */, bool) {
  constexpr int R = 16 * NRV;  // rows of the tile, padded to 16
  const auto [q_start, base, rows, first_pos, last_pos, kstart, kend] = tile_span(a, tile);
  const int32_t* table = a.tp + tile.seq * a.width;
  const int64_t h_off = tile.kv_head * DIM;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // queries, transposed and scaled; padding rows are zero and sit at the last position
  alignas(64) int32_t pos[R];
  tile_queries<T, TC, DIM, R>(a, tile, q_start, base, pos, qt);
  auto chunk = [&](int64_t j, int64_t& m) { return a.chunk(table, j, kend, m); };

  // pass 1: scores [keys, rows], two keys at a time (each query row loaded once for both)
  for (int64_t j = kstart; j < kend;) {
    int64_t m;
    const int64_t at = chunk(j, m);  // sets m
    const float* key = head_as_float<DIM>(a.kp + at, m, a.slot, h_off, wide);
    float* s = sbuf + (j - kstart) * R;
    int64_t t = 0;
    for (; t + 2 <= m; t += 2) {
      float* s0 = s + t * R;
      float* s1 = s0 + R;
      const float* k0 = key + t * a.slot;
      const float* k1 = k0 + a.slot;
#pragma omp simd
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = 0.f;
      for (int d = 0; d < DIM; ++d) {
        const float* qd = qt + d * R;
        const float x0 = k0[d], x1 = k1[d];
#pragma omp simd
        for (int r = 0; r < R; ++r) {
          s0[r] += qd[r] * x0;
          s1[r] += qd[r] * x1;
        }
      }
    }
    for (; t < m; ++t) {
      float* st = s + t * R;
      const float* kt = key + t * a.slot;
#pragma omp simd
      for (int r = 0; r < R; ++r) st[r] = 0.f;
      for (int d = 0; d < DIM; ++d) {
        const float* qd = qt + d * R;
        const float x = kt[d];
#pragma omp simd
        for (int r = 0; r < R; ++r) st[r] += qd[r] * x;
      }
    }
    // keys a row may not see (after its position, or before its window): -inf
    if (j + m - 1 > first_pos || (a.window > 0 && j <= last_pos - a.window)) {
      for (int64_t u = 0; u < m; ++u) {
        const int32_t key_pos = static_cast<int32_t>(j + u);
        const int32_t window = static_cast<int32_t>(a.window);
        float* su = s + u * R;
#pragma omp simd
        for (int r = 0; r < R; ++r) {
          const bool hidden = pos[r] < key_pos || (window > 0 && pos[r] - window >= key_pos);
          su[r] = hidden ? neg_inf : su[r];
        }
      }
    }
    j += m;
  }
  // softmax over each row's keys, unnormalised; hidden keys weigh exactly 0
  const int64_t span = kend - kstart;
  alignas(64) float total[R];
  softmax_lanes<R>(sbuf, span, total);
  // pass 2: the weighted sum of the values, transposed like the queries: out[DIM, rows]
  for (int64_t e = 0; e < DIM * R; ++e) obuf[e] = 0.f;
  for (int64_t j = kstart; j < kend;) {
    int64_t m;
    const int64_t at = chunk(j, m);
    const float* value = head_as_float<DIM>(a.vp + at, m, a.slot, h_off, wide);
    const float* w = sbuf + (j - kstart) * R;
    for (int d = 0; d < DIM; ++d) {
      float* od = obuf + d * R;
      for (int64_t u = 0; u < m; ++u) {
        const float* wu = w + u * R;
        const float x = value[u * a.slot + d];
#pragma omp simd
        for (int r = 0; r < R; ++r) od[r] += wu[r] * x;
      }
    }
    j += m;
  }
  // out = obuf / total, 8 rows x 8 dimensions at a time transposed into `row` (rows of DIM),
  // then rounded to T (as the AVX-512 kernel does with 16 x 16; the same bits as one value at a
  // time down each column, several times faster)
  static_assert(DIM % 8 == 0, "the output is transposed in blocks of 8 dimensions");
  alignas(32) float row[8 * DIM];
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    v8f inv;
    for (int e = 0; e < 8; ++e) inv[e] = 1.f / total[r0 + e];  // R is a multiple of 16: in range
    for (int c = 0; c < DIM; c += 8) {
      v8f block[8];
      for (int e = 0; e < 8; ++e) block[e] = vload(obuf + (c + e) * R + r0) * inv;
      transpose8(block);
      for (int e = 0; e < 8; ++e) vstore(row + e * DIM + c, block[e]);
    }
    for (int64_t e = 0, r = r0; e < 8 && r < rows; ++e, ++r) {
      T* o = a.op + (q_start + tile.first + r / a.group) * a.o_row + (tile.kv_head * a.group + r % a.group) * DIM;
      const float* x = row + e * DIM;
      for (int d = 0; d < DIM; ++d) put(o + d, x[d]);
    }
  }
}
#endif

// prefill_attention for head dimensions DIM of 32, 64 or 128: the step's prefill spans cut
// into tiles, the tiles shared out over the threads, the largest first.
template <typename T, typename TC, int DIM>
void prefill_attention_tiles(const PrefillCall<T, TC> a) {
  // tiles of at most 64 rows, the larger first (a tile's cost grows with its last position)
  const int64_t per_tile = std::max<int64_t>(1, 64 / a.group);
  std::vector<PrefillTile> tiles;
  int64_t max_span = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t q_len = a.qsl[i + 1] - a.qsl[i], len = a.lens[i];
    if (q_len < 2) continue;  // a decode: decode_attention's
    for (int64_t first = 0; first < q_len; first += per_tile) {
      const int64_t tokens = std::min(per_tile, q_len - first);
      const int64_t last = len - q_len + first + tokens;
      const int64_t keys = a.window > 0 ? std::min(last, a.window + tokens - 1) : last;
      max_span = std::max(max_span, keys);
      for (int64_t h = 0; h < a.kv_heads; ++h) tiles.push_back({i, h, first, tokens, keys * tokens});
    }
  }
  std::sort(tiles.begin(), tiles.end(), [](const PrefillTile& x, const PrefillTile& y) { return x.cost > y.cost; });
  const int64_t count = static_cast<int64_t>(tiles.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
#if defined(__AVX512F__)
  constexpr bool amx_types = std::is_same_v<T, at::BFloat16> && std::is_same_v<TC, at::BFloat16> && DIM % 32 == 0;
  const bool amx = amx_types && count > 0 && amx_enabled.load() && amx_available();
  if (amx) amx_prefill_calls.fetch_add(1, std::memory_order_relaxed);
  // without AMX (or with it switched off), AVX512-BF16's dot products for the scores
  const bool dot = amx_types && count > 0 && !amx && kBf16Dot && bf16_dot_prefill_enabled.load();
  if (dot) bf16_dot_prefill_calls.fetch_add(1, std::memory_order_relaxed);
#else
  constexpr bool amx = false, dot = false;
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> qt(DIM * 64), sbuf((max_span + 16) * 64), obuf(64 * DIM);
    std::vector<float> wide(std::is_same_v<TC, float> ? 0 : 16 * a.slot);
    // AMX's query blocks (at most 4 x 4 of 512 values) and a short chunk's 16 key rows
    std::vector<uint16_t> amx_buf(amx || dot ? 4 * 4 * 512 + 16 * 128 : 0);
    uint16_t* amx_p = amx || dot ? amx_buf.data() : nullptr;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const PrefillTile& tile = tiles[i];
      switch ((tile.tokens * a.group + 15) / 16) {
        case 1: prefill_tile<T, TC, DIM, 1>(a, tile, qt.data(), sbuf.data(), obuf.data(), wide.data(), amx_p, amx); break;
        case 2: prefill_tile<T, TC, DIM, 2>(a, tile, qt.data(), sbuf.data(), obuf.data(), wide.data(), amx_p, amx); break;
        case 3: prefill_tile<T, TC, DIM, 3>(a, tile, qt.data(), sbuf.data(), obuf.data(), wide.data(), amx_p, amx); break;
        default: prefill_tile<T, TC, DIM, 4>(a, tile, qt.data(), sbuf.data(), obuf.data(), wide.data(), amx_p, amx); break;
      }
    }
  }
}

// Bidirectional attention of an encoder over unpadded sequences (BERT and its kin): the
// tokens of every sequence lie back to back in qkv [tokens, 3 * hidden] (q, k, v of each
// token side by side, as the fused projection writes them), sequence i on rows
// cu_seqlens[i] .. cu_seqlens[i + 1]; each query attends to every key of its own sequence.
// The work is cut by sequence and head: that head's keys and values are first copied out of
// qkv's long rows into two small contiguous buffers (read in place, every key row is 3 * hidden
// floats from the next, so a long sequence's keys fell on few cache sets and were read again
// from L2 by every tile), then its queries go in tiles of 16; a tile's rows lie in vector
// lanes (queries transposed to [DIM, 16], scaled), so a key's scores for all rows are DIM
// broadcast multiply-adds with no horizontal sum, and the output is accumulated transposed
// too, as in prefill_tile. Written with v8f, not intrinsics. Two passes: scores and an exact
// softmax per row, then the weighted sum of the values. (Tiles of 16 rows x 4 keys keep their
// 8 accumulators in registers; 16 x 6, 24 x 4 and 32 x 3 ran 8-20% slower on AVX2.)

struct EncoderCall {
  const float* qkv;
  float* out;
  const int64_t* cu;
  int64_t n, heads, hidden, row, out_row;
  float scale;
};

// one sequence's one head
struct EncoderWork {
  int64_t seq, head, len;
};

// encoder_attention calls (read by the tests: the fast path ran)
std::atomic<int64_t> encoder_attention_calls{0};

constexpr int kEncoderTileRows = 16;

// `rows` queries from position `first` of the sequence at `start` against its `len` keys and
// values k0, v0 (contiguous rows of DIM)
template <int DIM>
void encoder_tile(const EncoderCall& a, int64_t start, int64_t len, int64_t head, int64_t first, int64_t rows,
                  const float* k0, const float* v0, float* qt, float* sbuf, float* obuf) {
  constexpr int NV = kEncoderTileRows / 8, R = kEncoderTileRows;  // rows of a tile, in 8-lane vectors
  const float* q0 = a.qkv + (start + first) * a.row + head * DIM;
  for (int r = 0; r < R; ++r) {
    const float* qr = q0 + r * a.row;
    for (int d = 0; d < DIM; ++d) qt[d * R + r] = r < rows ? qr[d] * a.scale : 0.f;
  }
  // pass 1: scores [keys, rows], four keys at a time (each query vector loaded once for four)
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {
    v8f acc[4][NV] = {};
    const float* kj = k0 + j * DIM;
    for (int d = 0; d < DIM; ++d) {
      v8f qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = vload(qt + d * R + 8 * v);
      for (int u = 0; u < 4; ++u) {
        const v8f kd = vbroadcast(kj[u * DIM + d]);
        for (int v = 0; v < NV; ++v) acc[u][v] += qv[v] * kd;
      }
    }
    for (int u = 0; u < 4; ++u)
      for (int v = 0; v < NV; ++v) vstore(sbuf + (j + u) * R + 8 * v, acc[u][v]);
  }
  for (; j < len; ++j) {
    v8f acc[NV] = {};
    const float* kj = k0 + j * DIM;
    for (int d = 0; d < DIM; ++d) {
      const v8f kd = vbroadcast(kj[d]);
      for (int v = 0; v < NV; ++v) acc[v] += vload(qt + d * R + 8 * v) * kd;
    }
    for (int v = 0; v < NV; ++v) vstore(sbuf + j * R + 8 * v, acc[v]);
  }
  // softmax over each row's keys (lane-wise), unnormalised
  alignas(32) float total[R];
  softmax_lanes<R>(sbuf, len, total);
  // pass 2: the weighted sum of the values, out[DIM, rows], four dimensions at a time
  for (int d0 = 0; d0 < DIM; d0 += 4) {
    v8f acc[4][NV] = {};
    for (int64_t u = 0; u < len; ++u) {
      v8f wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = vload(sbuf + u * R + 8 * v);
      const float* vu = v0 + u * DIM + d0;
      for (int e = 0; e < 4; ++e) {
        const v8f x = vbroadcast(vu[e]);
        for (int v = 0; v < NV; ++v) acc[e][v] += wv[v] * x;
      }
    }
    for (int e = 0; e < 4; ++e)
      for (int v = 0; v < NV; ++v) vstore(obuf + (d0 + e) * R + 8 * v, acc[e][v]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = a.out + (start + first + r) * a.out_row + head * DIM;
    const float inv = 1.f / total[r];
    for (int d = 0; d < DIM; ++d) o[d] = obuf[d * R + r] * inv;
  }
}

// One sequence's one head: its keys and values copied into kbuf, vbuf, then its query tiles.
template <int DIM>
void encoder_head(const EncoderCall& a, const EncoderWork& w, float* kbuf, float* vbuf, float* qt, float* sbuf,
                  float* obuf) {
  const int64_t start = a.cu[w.seq];
  const float* k = a.qkv + start * a.row + a.hidden + w.head * DIM;
  for (int64_t j = 0; j < w.len; ++j) {
    std::memcpy(kbuf + j * DIM, k + j * a.row, DIM * sizeof(float));
    std::memcpy(vbuf + j * DIM, k + j * a.row + a.hidden, DIM * sizeof(float));
  }
  for (int64_t first = 0; first < w.len; first += kEncoderTileRows) {
    const int64_t rows = std::min<int64_t>(kEncoderTileRows, w.len - first);
    encoder_tile<DIM>(a, start, w.len, w.head, first, rows, kbuf, vbuf, qt, sbuf, obuf);
  }
}

template <int DIM>
void encoder_attention_impl(const EncoderCall& a) {
  constexpr int64_t R = kEncoderTileRows;
  std::vector<EncoderWork> work;
  int64_t longest = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t len = a.cu[i + 1] - a.cu[i];
    longest = std::max(longest, len);
    if (len > 0)
      for (int64_t h = 0; h < a.heads; ++h) work.push_back({i, h, len});
  }
  // the longest first (cost grows as len^2), so that the last items handed out are short
  std::stable_sort(work.begin(), work.end(), [](const EncoderWork& x, const EncoderWork& y) { return x.len > y.len; });
  const int64_t count = static_cast<int64_t>(work.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> kbuf(longest * DIM), vbuf(longest * DIM), qt(DIM * R), sbuf(longest * R + R), obuf(DIM * R);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i)
      encoder_head<DIM>(a, work[i], kbuf.data(), vbuf.data(), qt.data(), sbuf.data(), obuf.data());
  }
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
          const float s = round_to<T>(f32(xr[i]) + f32(rr[i]));
          put(sr + i, s);
          hp[i] = s;
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
      for (int64_t i = 0; i < n; ++i) put(orow + i, f32(wp[i]) * (hp[i] * inv));  // rounded once, as vLLM's
    }
  });
}

// out [rows, vocab] float32 = logits [rows, vocab] (T) widened, then every entry within
// rel * |max| of its row's maximum recomputed as the float32 dot product of hidden's row and
// weight's row (the LM head's operands, in T). A row with a NaN or an infinite maximum is only
// widened.
template <typename T>
void exact_top_logits_impl(at::Tensor& out, const at::Tensor& logits, const at::Tensor& hidden,
                           const at::Tensor& weight, float rel) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), h = hidden.size(1);
  const T* lp = logits.data_ptr<T>();
  const T* hp = hidden.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t ls = logits.stride(0), hs = hidden.stride(0), ws = weight.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* l = lp + r * ls;
      float* o = op + r * vocab;
      // widen, with the row's maximum and whether it holds a NaN (eight lanes at a time: the
      // compiler left these loops scalar, 2.5 ns an entry, 25x a copy's time)
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t j = 0;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        v8f mv = vbroadcast(m);
        v8i nv{};
        for (; j + 8 <= vocab; j += 8) {
          const v8f v = load_lanes<v8f>(l + j);
          vstore(o + j, v);
          mv = v > mv ? v : mv;
          nv |= v != v;
        }
        for (int k = 0; k < 8; ++k) {
          m = std::max(m, mv[k]);
          nan |= nv[k] != 0;
        }
      }
      for (; j < vocab; ++j) {
        o[j] = f32(l[j]);
        m = std::max(m, o[j]);
        nan |= o[j] != o[j];
      }
      if (nan || !std::isfinite(m)) continue;
      load(x.data(), hp + r * hs, h);
      const float floor = m - rel * std::fabs(m);
      const v8f fv = vbroadcast(floor);
      for (j = 0; j < vocab; ++j) {
        if (j % 16 == 0 && j + 16 <= vocab) {  // skip sixteen entries at once when none is a candidate
          const v8i hit = (vload(o + j) >= fv) | (vload(o + j + 8) >= fv);
          uint64_t any[4];
          std::memcpy(any, &hit, sizeof(any));
          if ((any[0] | any[1] | any[2] | any[3]) == 0) {
            j += 15;
            continue;
          }
        }
        if (!(o[j] >= floor)) continue;
        const T* w = wp + j * ws;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < h; ++k) acc += x[k] * f32(w[k]);
        o[j] = acc;
      }
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
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        // sixteen, then eight lanes at a time (the compiler left the scalar loop below
        // unvectorised: 4-7x slower than PyTorch's two passes), the same steps, so the same
        // values; sixteen lanes took it from 1.6-1.7 to 2.4-2.6 Gelements/s on an AVX-512 EPYC
        for (; i + 16 <= n; i += 16) {
          const v16f g = load_lanes<v16f>(gate + i);
          store_lanes(o + i, round_lanes<T>(g / (splat<v16f>(1.f) + fast_exp16v(-g))) * load_lanes<v16f>(up + i));
        }
        for (; i + 8 <= n; i += 8) {
          const v8f g = load_lanes<v8f>(gate + i);
          store_lanes(o + i, round_lanes<T>(g / (vbroadcast(1.f) + fast_exp8(-g))) * load_lanes<v8f>(up + i));
        }
      }
      for (; i < n; ++i) {
        const float g = f32(gate[i]);
        // PyTorch rounds silu(gate) to T before the product
        put(o + i, round_to<T>(g / (1.f + fast_exp(-g))) * f32(up[i]));
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
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          // in float32 with float32 cos/sin, rounded to T once (bench_fidelity.py: rounding cos,
          // sin and each product to bfloat16 first made greedy tokens part from float32's sooner)
          const float c = cp[t * cs + i], s = sp[t * cs + i];
          const float x1 = f32(a[i]), x2 = f32(a[i + half]);
          put(o + i, x1 * c - x2 * s);
          put(o + i + half, x2 * c + x1 * s);
        }
      }
    }
  });
}

// key/value [T, kv_heads, d] (any row/head strides, last dim contiguous) stored at their slots
// of the caches [blocks, block_size, kv_heads, d] (of type TC: T's, or bfloat16 under float32);
// a slot of -1 (padding) is skipped.
template <typename T, typename TC>
void write_kv_cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2), slot = heads * d;
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  TC* kc = k_cache.data_ptr<TC>();
  TC* vc = v_cache.data_ptr<TC>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = sp[t];
      if (s < 0) continue;
      TORCH_CHECK(s < capacity, "slot ", s, " is past the cache's ", capacity, " slots");
      for (int64_t h = 0; h < heads; ++h) {
        const T* kr = kp + t * ks0 + h * ks1;
        const T* vr = vp + t * vs0 + h * vs1;
        TC* ko = kc + s * slot + h * d;
        TC* vo = vc + s * slot + h * d;
        if constexpr (std::is_same_v<T, TC>) {
          std::memcpy(ko, kr, d * sizeof(T));
          std::memcpy(vo, vr, d * sizeof(T));
        } else {
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) {
            put(ko + i, f32(kr[i]));
            put(vo + i, f32(vr[i]));
          }
        }
      }
    }
  });
}

// The index of each row's largest value, as torch.argmax: the first one among ties, and the
// first NaN of a row that has one. Two passes over a row (its maximum, then where it first
// occurs) instead of torch's scalar-tracking loop over [rows, vocab] logits: a row of a large
// vocabulary stays in L2 between them. With code_non_finite, a row whose maximum is not
// finite (a NaN anywhere, a +inf anywhere, or nothing but -inf: torch.amax's NaN, +inf or
// -inf) gets -1 instead: the sampler's non-finite check in the same pass.
void argmax_rows_impl(at::Tensor& out, const at::Tensor& x, bool code_non_finite) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 mv = _mm512_set1_ps(m);
      __mmask16 unordered = 0;
      for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, v);
      }
      m = _mm512_reduce_max_ps(mv);
      nan = unordered != 0;
#endif
      for (; i < n; ++i) {
        m = std::max(m, row[i]);
        nan = nan || row[i] != row[i];
      }
      int64_t at = 0;
#if defined(__AVX512F__)
      const __m512 target = _mm512_set1_ps(m);
      for (; at + 16 <= n; at += 16) {
        const __m512 v = _mm512_loadu_ps(row + at);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) {
          at += __builtin_ctz(static_cast<unsigned>(hit));
          break;
        }
      }
#endif
      if (code_non_finite && (nan || !std::isfinite(m))) {
        op[r] = -1;
        continue;
      }
      if (nan) {
        while (row[at] == row[at]) ++at;
      } else {
        while (at < n - 1 && row[at] != m) ++at;  // all -inf: the first, as torch
      }
      op[r] = at;
    }
  });
}

// The kernel specialised for the head dimension (q and out of type T, the KV caches of type TC).
template <typename T, typename TC>
void decode_attention_dims(const DecodeCall<T, TC>& a) {
#if defined(__AVX512F__)
  if (a.dim == 32) {
    decode_attention_avx512<T, TC, 32>(a);
  } else if (a.dim == 64) {
    decode_attention_avx512<T, TC, 64>(a);
  } else if (a.dim == 128) {
    decode_attention_avx512<T, TC, 128>(a);
  } else {
#else
  if (a.dim == 64) {
    decode_attention_impl<T, TC, 64>(a);
  } else if (a.dim == 128) {
    decode_attention_impl<T, TC, 128>(a);
  } else {
#endif
    decode_attention_impl<T, TC, 0>(a);
  }
}

#define DFLLM_DISPATCH(dtype, NAME, ...)                                              \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, dtype, NAME, \
                                  [&] { __VA_ARGS__; })

// x and y (q and out, or key and value) of one dtype, the caches of one dtype: theirs, or
// bfloat16 under float32 (kv_cache_dtype="bfloat16")
void check_cache_types(const at::Tensor& x, const at::Tensor& y, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (x.scalar_type() == k_cache.scalar_type() ||
                   (x.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "q/out (key/value) must share one dtype, the KV caches one dtype: theirs, or bfloat16 under float32");
}

// f.template operator()<T, TC>() for x's element type T and the cache's TC (checked above)
template <typename F>
void dispatch_cache_types(const at::Tensor& x, const at::Tensor& cache, F&& f) {
  if (x.scalar_type() == at::kFloat && cache.scalar_type() == at::kBFloat16) {
    f.template operator()<float, at::BFloat16>();
    return;
  }
  DFLLM_DISPATCH(x.scalar_type(), "dfllm attention or cache write", f.template operator()<scalar_t, scalar_t>());
}

// What decode_attention and prefill_attention both require of q, out and the caches.
void check_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == q.size(2),
              "out must be shaped like q, each row contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  check_cache_types(q, out, k_cache, v_cache);
}


#if defined(__AVX512F__)
// ---- bfloat16 GEMM (AVX512-BF16) ----------------------------------------------------------
// y [m, n] = x [m, k] @ w [n, k]^T (+ bias) for bfloat16 x and w, float32 accumulation, the
// result rounded once to bfloat16: what oneDNN's bfloat16 GEMM computes, with the same
// vdpbf16ps instructions (its results equal these on all but a few entries in 10^4, one unit in
// the last place apart, from the order of the additions). Why dfllm has its own: on a CPU with
// AVX512-BF16 and no AMX, oneDNN's call through torch costs 17-25 us even for one row, and it
// reads each weight from memory only when it needs it, so a decode step's GEMMs stall on
// their weights (they stream from memory once a step). This one prefetches the next panel of
// the weight while it multiplies the current one. Measured on an AVX512-BF16 EPYC, 2 threads,
// SmolLM2's 30 layers' linears with weights from memory: 1 row 7.2 ms against oneDNN's 11.6,
// 16 rows 10.0 against 15.7, 64 rows 31.9 against 39.6 (426 GFLOP/s of 420-450 that the
// instructions reach), 512 rows 254 against 268.
//
// The weight is laid out once (bf16_gemm_pack): panels of 64 output columns, each the k / 2
// pairs of its columns' elements in order, [panels, k / 2, 64, 2] (k rounded up to even, the
// columns past n zero), so that a panel streams through memory in one run and one 64-byte
// load holds 16 columns' pair (vdpbf16ps's operand). A tile of up to 6 rows by one panel keeps
// 24 accumulators in registers; each row's pair is broadcast from memory.
constexpr int64_t kGemmPanel = 64;
constexpr int64_t kGemmRows = 6;

// rows [0, R) of x (row stride xs elements) times one panel w over kp pairs, into acc [R, 64];
// P prefetches a pair of the next lines from `ahead` (the last one: `last`)
template <int R, int P>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) void gemm_tile(
    const uint16_t* x, int64_t xs, const uint16_t* w, int64_t kp, float* acc_out, const char* ahead, int64_t last) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) _mm_prefetch(ahead + std::min<int64_t>(k * P + q, last) * 64, _MM_HINT_T1);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + k * 128);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + k * 128 + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(w + k * 128 + 64);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(w + k * 128 + 96);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // (a memcpy here made GCC 12 keep the accumulators in memory: 2.7x slower)
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const AliasedPair*>(x + r * xs + 2 * k));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + r * kGemmPanel + c * 16, acc[r][c]);
}

// gemm_tile for `lines` lines to prefetch from `ahead` over the kp pairs (none: the panel's
// own first line, already in cache, so that the loop has no branch)
template <int R>
void gemm_tile_ahead(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t kp, float* acc, const char* ahead,
                     int64_t lines) {
  if (ahead == nullptr || lines <= 0) {
    ahead = reinterpret_cast<const char*>(w);
    lines = 1;
  }
  if (lines <= kp) {
    gemm_tile<R, 1>(x, xs, w, kp, acc, ahead, lines - 1);
  } else if (lines <= 2 * kp) {
    gemm_tile<R, 2>(x, xs, w, kp, acc, ahead, lines - 1);
  } else {
    gemm_tile<R, 4>(x, xs, w, kp, acc, ahead, lines - 1);
  }
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) void gemm_store(
    uint16_t* o, const float* acc, const float* bias, int64_t cols) {
  alignas(64) uint16_t row[kGemmPanel];
  for (int c = 0; c < 4; ++c) {
    __m512 v = _mm512_loadu_ps(acc + c * 16);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c * 16));  // padded to whole panels
    _mm256_store_si256(reinterpret_cast<__m256i*>(row + c * 16), (__m256i)_mm512_cvtneps_pbh(v));
  }
  std::memcpy(o, row, cols * sizeof(uint16_t));
}

void bf16_gemm_impl(uint16_t* op, const uint16_t* xp, int64_t xs, const uint16_t* wp, const float* bias, int64_t m,
                    int64_t n, int64_t kp, int64_t panels) {
  const int64_t panel_elems = kp * kGemmPanel * 2, panel_lines = panel_elems * 2 / 64;
  const int64_t row_blocks = (m + kGemmRows - 1) / kGemmRows;
  // work items: a panel's row blocks, in two halves where the panels are too few to share out
  // evenly between the threads (9 panels over 2 threads would leave one idle a ninth of the time)
  const int64_t splits = (panels < 8 * at::get_num_threads() && row_blocks >= 2) ? 2 : 1;
  at::parallel_for(0, panels * splits, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[kGemmRows * kGemmPanel];
    for (int64_t it = first; it < last; ++it) {
      const int64_t p = it / splits, rb0 = row_blocks * (it % splits) / splits,
                    rb1 = row_blocks * (it % splits + 1) / splits;
      const uint16_t* w = wp + p * panel_elems;
      // prefetched during this item: the next item's panel, when it is another one, a share in each row block
      const char* next = it + 1 < last && (it + 1) / splits != p ? reinterpret_cast<const char*>(w + panel_elems) : nullptr;
      const int64_t cols = std::min(kGemmPanel, n - p * kGemmPanel);
      for (int64_t rb = rb0; rb < rb1; ++rb) {
        const int64_t r0 = rb * kGemmRows, rows = std::min(kGemmRows, m - r0);
        const int64_t l0 = panel_lines * (rb - rb0) / (rb1 - rb0), l1 = panel_lines * (rb - rb0 + 1) / (rb1 - rb0);
        const char* ahead = next ? next + l0 * 64 : nullptr;
        const uint16_t* x = xp + r0 * xs;
        switch (rows) {
          case 6: gemm_tile_ahead<6>(x, xs, w, kp, acc, ahead, l1 - l0); break;
          case 5: gemm_tile_ahead<5>(x, xs, w, kp, acc, ahead, l1 - l0); break;
          case 4: gemm_tile_ahead<4>(x, xs, w, kp, acc, ahead, l1 - l0); break;
          case 3: gemm_tile_ahead<3>(x, xs, w, kp, acc, ahead, l1 - l0); break;
          case 2: gemm_tile_ahead<2>(x, xs, w, kp, acc, ahead, l1 - l0); break;
          default: gemm_tile_ahead<1>(x, xs, w, kp, acc, ahead, l1 - l0); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          gemm_store(op + (r0 + r) * n + p * kGemmPanel, acc + r * kGemmPanel,
                     bias != nullptr ? bias + p * kGemmPanel : nullptr, cols);
        }
      }
    }
  });
}
#endif  // __AVX512F__

}  // namespace

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& lens, double scale,
                      int64_t window, double softcap) {
  check_attention(out, q, k_cache, v_cache);
  TORCH_CHECK(q.stride(1) == q.size(2), "q's heads of one token must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "rows must be int64, block tables and lengths int32");
  TORCH_CHECK(rows.is_contiguous() && tables.is_contiguous() && lens.is_contiguous(), "metadata must be contiguous");
  dispatch_cache_types(q, k_cache, [&]<typename T, typename TC>() {
    decode_attention_dims(DecodeCall<T, TC>(out, q, k_cache, v_cache, rows, tables, lens, scale, window, softcap));
  });
}

namespace {
template <typename T, typename TC>
void prefill_attention_dims(const PrefillCall<T, TC>& a) {
  if (a.dim == 32) {
    prefill_attention_tiles<T, TC, 32>(a);
  } else if (a.dim == 64) {
    prefill_attention_tiles<T, TC, 64>(a);
  } else {
    prefill_attention_tiles<T, TC, 128>(a);
  }
}
}  // namespace

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& tables,
                       double scale, int64_t window) {
  check_attention(out, q, k_cache, v_cache);
  TORCH_CHECK(q.size(2) == 32 || q.size(2) == 64 || q.size(2) == 128, "head_dim must be 32, 64 or 128");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  tables.scalar_type() == at::kInt && query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  tables.is_contiguous() && query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  tables.size(0) == seq_lens.size(0),
              "query_start_loc ([n + 1]), seq_lens ([n]) and block tables ([n, width]) must be contiguous int32");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= 64, "query heads must be at most 64 times the KV heads");
  dispatch_cache_types(q, k_cache, [&]<typename T, typename TC>() {
    prefill_attention_dims(PrefillCall<T, TC>(out, q, k_cache, v_cache, query_start_loc, seq_lens, tables, scale,
                                              window));
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

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.sizes() == key.sizes() && value.stride(2) == 1,
              "key and value must be [tokens, kv_heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "the caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64, one slot per token");
  check_cache_types(key, value, k_cache, v_cache);
  dispatch_cache_types(key, k_cache, [&]<typename T, typename TC>() {
    write_kv_cache_impl<T, TC>(key, value, k_cache, v_cache, slot_mapping);
  });
}

std::vector<at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  return {rotary(q, cos, sin), rotary(k, cos, sin)};
}

at::Tensor exact_top_logits(const at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight,
                            double rel) {
  TORCH_CHECK(logits.dim() == 2 && hidden.dim() == 2 && weight.dim() == 2 && logits.stride(1) == 1 &&
                  hidden.stride(1) == 1 && weight.stride(1) == 1,
              "logits, hidden and weight must be 2-D with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == hidden.scalar_type() && weight.scalar_type() == hidden.scalar_type() &&
                  logits.scalar_type() != at::kFloat,
              "logits, hidden and weight must share one reduced-precision dtype");
  TORCH_CHECK(logits.size(0) == hidden.size(0) && logits.size(1) == weight.size(0) && hidden.size(1) == weight.size(1),
              "logits [rows, vocab] = hidden [rows, h] @ weight [vocab, h]^T");
  auto out = at::empty(logits.sizes(), logits.options().dtype(at::kFloat));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(logits.scalar_type(), "exact_top_logits",
                                     [&] { exact_top_logits_impl<scalar_t>(out, logits, hidden, weight, rel); });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x, bool code_non_finite) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x must be float32 [rows, n > 0] with contiguous rows");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  argmax_rows_impl(out, x, code_non_finite);
  return out;
}

// Whether prefill_attention takes AMX tiles for bfloat16 scores (the CPU has them, the OS
// allows them, not switched off), and how many calls did.
std::vector<int64_t> amx_stats() {
#if defined(__AVX512F__)
  return {amx_available() && amx_enabled.load() ? 1 : 0, amx_prefill_calls.load()};
#else
  return {0, 0};
#endif
}

// Switch the prefill kernel's AMX path on or off (benchmarks and tests compare the two);
// returns whether it was on.
bool set_amx(bool on) {
#if defined(__AVX512F__)
  return amx_enabled.exchange(on);
#else
  return false;
#endif
}

// Switch the prefill kernel's AVX512-BF16 scores on or off (tests compare the two); returns
// whether they were on.
bool set_bf16_dot(bool on) {
#if defined(__AVX512F__)
  return bf16_dot_prefill_enabled.exchange(on);
#else
  return false;
#endif
}

// Whether the attention kernels take AVX512-BF16 dot products for bfloat16, and how many
// decode_attention and prefill_attention calls did.
std::vector<int64_t> bf16_dot_stats() {
#if defined(__AVX512F__)
  return {kBf16Dot ? 1 : 0, bf16_dot_calls.load(), bf16_dot_prefill_calls.load()};
#else
  return {0, 0, 0};
#endif
}

// The encoders' bidirectional attention over unpadded sequences (encoder_tile): qkv [tokens,
// 3 * heads * dim] float32 (rows may be strided), cu_seqlens int64 [sequences + 1]; returns
// out [tokens, heads * dim]. Head dimensions 32, 64 and 128.
at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& cu_seqlens, int64_t heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.scalar_type() == at::kFloat && qkv.size(1) % (3 * heads) == 0,
              "qkv must be float32 [tokens, 3 * heads * dim] with contiguous rows");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.is_contiguous() && cu_seqlens.scalar_type() == at::kLong &&
                  cu_seqlens.size(0) >= 1,
              "cu_seqlens must be contiguous int64 [sequences + 1]");
  const int64_t hidden = qkv.size(1) / 3, dim = hidden / heads;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t n = cu_seqlens.size(0) - 1;
  TORCH_CHECK(cu[0] == 0 && cu[n] == qkv.size(0), "cu_seqlens must run from 0 to the number of tokens");
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(cu[i + 1] >= cu[i], "cu_seqlens must not decrease");
  auto out = at::empty({qkv.size(0), hidden}, qkv.options());
  const EncoderCall a{qkv.data_ptr<float>(), out.data_ptr<float>(), cu, n, heads, hidden, qkv.stride(0), hidden,
                      static_cast<float>(scale)};
  switch (dim) {
    case 32: encoder_attention_impl<32>(a); break;
    case 64: encoder_attention_impl<64>(a); break;
    case 128: encoder_attention_impl<128>(a); break;
    default: TORCH_CHECK(false, "encoder_attention takes head dimensions 32, 64 and 128, got ", dim);
  }
  encoder_attention_calls.fetch_add(1, std::memory_order_relaxed);
  return out;
}

int64_t encoder_attention_count() { return encoder_attention_calls.load(); }


// Whether bf16_gemm runs here: AVX512-BF16's dot product (the library built for AVX-512).
bool bf16_gemm_available() {
#if defined(__AVX512F__)
  return kBf16Dot;
#else
  return false;
#endif
}

// w [n, k] bfloat16 laid out for bf16_gemm: [ceil(n / 64), ceil(k / 2), 64, 2], zero-padded.
at::Tensor bf16_gemm_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be bfloat16 [n, k]");
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), kp = (k + 1) / 2, panels = (n + 63) / 64;
  auto out = at::zeros({panels, kp, 64, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t c = 0; c < 64 && p * 64 + c < n; ++c)
        for (int64_t j = 0; j < k; ++j) dst[((p * kp + j / 2) * 64 + c) * 2 + j % 2] = src[(p * 64 + c) * k + j];
  });
  return out;
}

// y [m, n] bfloat16 = x [m, k] (bfloat16, rows contiguous, k even) @ w^T (+ bias, float32 [n]),
// w as bf16_gemm_pack laid it out.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(bf16_gemm_available(), "bf16_gemm needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be bfloat16 [m, k] with contiguous rows and k even");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(1) * 2 == x.size(1) && packed.size(2) == 64 && packed.size(3) == 2 &&
                  packed.size(0) == (n + 63) / 64,
              "packed must be bf16_gemm_pack's layout of a [n, k] weight");
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n, "bias must be [n]");
    // the last panel's columns past n read bias entries past n: a padded copy
    if (n % 64) b = at::constant_pad_nd(b, {0, 64 - n % 64});
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__AVX512F__)
  if (x.size(0) > 0) {
    bf16_gemm_impl(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
                   reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bp, x.size(0), n, packed.size(1),
                   packed.size(0));
  }
#endif
  return out;
}

// A decoder layer's linear through the GEMM its weight was packed for: bf16_gemm, or where
// `onednn` oneDNN's, the op PackableLinear's forward calls from Python
// (mkldnn::_linear_pointwise over torch.ops.mkldnn._reorder_linear_weight's copy, the layer's
// bias, no post-op), so the same call and the same bits.
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                        bool onednn) {
  if (!onednn) return bf16_gemm(x, w, bias, n);
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               std::string_view, c10::List<std::optional<at::Scalar>>,
                               std::optional<std::string_view>);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<Signature>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

// The decoder layers of a decode-only step of a Llama-family model, in one call
// (dfllm/models/decode_stack.py decides when it applies): per layer RMSNorm (the residual added
// first from the second layer on), the qkv GEMM, rotary on q and k, the new keys and values into
// the paged caches, decode attention, the o GEMM, RMSNorm with the residual, the gate_up GEMM,
// SiLU-and-multiply and the down GEMM; Qwen3's per-head RMSNorm of q and k before rotary where
// `qk_norms` holds them. The same kernels with the same operands in the same order as the
// modules' forward, so the same bits; from Python those are eleven calls a layer, whose host
// work (~10 ms a step at 64 sequences on SmolLM2's 30 layers) cost more than the norms, rotary
// and SiLU together. `weights` holds six tensors a layer (input norm, qkv, o, post-attention
// norm, gate_up, down; the linears as bf16_gemm_pack laid them out, or oneDNN where `onednn`:
// layer_linear), `biases` four (the linears', None where a linear has none), `qk_norms` two
// (q_norm's and k_norm's weights, eps `qk_eps`) or none at all, `caches` two (keys, values).
// Returns the last layer's output and its residual.
std::vector<at::Tensor> decode_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                                      const std::vector<c10::optional<at::Tensor>>& biases,
                                      const std::vector<at::Tensor>& qk_norms,
                                      const std::vector<at::Tensor>& caches, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& rows,
                                      const at::Tensor& tables, const at::Tensor& lens, int64_t heads, int64_t kv_heads,
                                      int64_t head_dim, int64_t intermediate, double eps, double qk_eps,
                                      double scale, bool onednn) {
  constexpr size_t kPerLayer = 6;
  const size_t layers = weights.size() / kPerLayer;
  TORCH_CHECK(weights.size() == layers * kPerLayer && caches.size() == 2 * layers && biases.size() == 4 * layers &&
                  (qk_norms.empty() || qk_norms.size() == 2 * layers),
              "six weights, four biases, two caches and none or two q/k norms a layer");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  const int64_t t = x.size(0), hidden = x.size(1), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor residual;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kPerLayer];
    if (l == 0) {
      residual = x;
      x = rms_norm(x, w[0], eps, c10::nullopt)[0];
    } else {
      auto normed = rms_norm(x, w[0], eps, residual);
      x = normed[0];
      residual = normed[1];
    }
    const c10::optional<at::Tensor>* b = &biases[l * 4];
    const at::Tensor qkv = layer_linear(x, w[1], b[0], q_size + 2 * kv_size, onednn);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({t, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads, head_dim});
    if (!qk_norms.empty()) {  // as RMSNorm's forward over [tokens, heads, head_dim] does
      q = rms_norm(q.reshape({-1, head_dim}), qk_norms[2 * l], qk_eps, c10::nullopt)[0].view({t, heads, head_dim});
      k = rms_norm(k.reshape({-1, head_dim}), qk_norms[2 * l + 1], qk_eps, c10::nullopt)[0].view(
          {t, kv_heads, head_dim});
    }
    auto qk = rotary_qk(q, k, cos, sin);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, head_dim});
    write_kv_cache(qk[1], v, caches[2 * l], caches[2 * l + 1], slots);
    at::Tensor o = at::empty_like(qk[0], at::MemoryFormat::Contiguous);
    decode_attention(o, qk[0], caches[2 * l], caches[2 * l + 1], rows, tables, lens, scale, 0, 0.0);
    auto normed = rms_norm(layer_linear(o.view({t, q_size}), w[2], b[1], hidden, onednn), w[3], eps, residual);
    residual = normed[1];
    x = layer_linear(silu_and_mul(layer_linear(normed[0], w[4], b[2], 2 * intermediate, onednn)), w[5], b[3], hidden,
                     onednn);
  }
  return {x, residual};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_dot_stats", &bf16_dot_stats);
  m.def("amx_stats", &amx_stats);
  m.def("set_amx", &set_amx);
  m.def("set_bf16_dot", &set_bf16_dot);
  m.def("decode_attention", &decode_attention);
  m.def("decode_layers", &decode_layers);
  m.def("rms_norm", &rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary", &rotary);
  m.def("rotary_qk", &rotary_qk);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("argmax_rows", &argmax_rows);
  m.def("exact_top_logits", &exact_top_logits);
  m.def("encoder_attention", &encoder_attention);
  m.def("encoder_attention_count", &encoder_attention_count);
  m.def("prefill_attention", &prefill_attention);
  m.def("bf16_gemm_available", &bf16_gemm_available);
  m.def("bf16_gemm_pack", &bf16_gemm_pack);
  m.def("bf16_gemm", &bf16_gemm);
}
