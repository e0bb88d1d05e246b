// Fused CPU kernels for the decode step (registered as torch.ops.cadence.*).
//
// A decode step at small batch is dozens of tiny tensor ops per layer, and on CPU each one
// costs several microseconds of dispatch and allocation whatever its size. These kernels do
// the element-wise work of a layer in one pass each, with float32 arithmetic inside and
// one rounding to the tensor's dtype at the end, and read the paged K/V pool directly for
// decode attention. They are built on first use (cadence/kernels/__init__.py); the model
// falls back to plain torch ops where they cannot be built.

#include <cstring>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bit>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Dispatch on the three model dtypes; `scalar_t` names the element type inside. (ATen's
// AT_DISPATCH_FLOATING_TYPES_AND2 would also instantiate double, which no model uses.)
#define CADENCE_DISPATCH(dtype, name, ...)                                             \
  [&] {                                                                                \
    switch (dtype) {                                                                   \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }               \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); }    \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }            \
      default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);                \
    }                                                                                  \
  }()

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the top half of a float32: a shift the compiler vectorizes.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX512F__)
// 16 values of a row as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// The value a float takes once stored as T (identity for float): the kernels round where
// torch's own ops would round, so both paths give the same numbers.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, features]");
  TORCH_CHECK(t.stride(1) == 1, name, " must be contiguous along its last dimension");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// out = x / sqrt(mean(x^2) + eps) * weight, row by row; with `residual`, first residual += x
// (rounded to its dtype, as an in-place add would) and normalize the sum.
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight,
                   T* out, int64_t out_stride, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(h), w(h);
    load_row(weight, w.data(), h);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x + r * x_stride, buf.data(), h);
      if (residual != nullptr) {
        T* res = residual + r * res_stride;
        for (int64_t i = 0; i < h; ++i) {
          T sum = static_cast<T>(static_cast<float>(res[i]) + buf[i]);
          res[i] = sum;
          buf[i] = static_cast<float>(sum);
        }
      }
      float ss = 0.f;
      for (int64_t i = 0; i < h; ++i) ss += buf[i] * buf[i];
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      for (int64_t i = 0; i < h; ++i) buf[i] = buf[i] * scale * w[i];
      store_row(buf.data(), out + r * out_stride, h);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [features] tensor of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  CADENCE_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), nullptr, 0, weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(x, "x");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual and x must have the same shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [features] tensor of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  CADENCE_DISPATCH(x.scalar_type(), "add_rms_norm_", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0),
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), out.stride(0), x.size(0),
                            x.size(1), static_cast<float>(eps));
  });
  return out;
}

// [rows, 2 * inter] (gate | up) -> silu(gate) * up, [rows, inter]; silu(gate) is rounded to
// the dtype before the multiply, as torch's two ops would.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of features");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  CADENCE_DISPATCH(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> g(inter), u(inter);
      for (int64_t r = begin; r < end; ++r) {
        load_row(src + r * stride, g.data(), inter);
        load_row(src + r * stride + inter, u.data(), inter);
        for (int64_t i = 0; i < inter; ++i) g[i] = round_to<scalar_t>(g[i] / (1.f + std::exp(-g[i]))) * u[i];
        store_row(g.data(), dst + r * inter, inter);
      }
    });
  });
  return out;
}

// In place: each pair (2i, 2i+1) of each head of row t times the complex factor
// factors[t, head, i] (float32 [rows, heads, D/2, 2]: rotation times the head's scale).
void rotary_(at::Tensor& qk, const at::Tensor& factors) {
  check_rows(qk, "qk");
  TORCH_CHECK(factors.scalar_type() == at::kFloat && factors.is_contiguous() && factors.dim() == 4 &&
                  factors.size(0) == qk.size(0) && factors.size(3) == 2 &&
                  factors.size(1) * factors.size(2) * 2 == qk.size(1),
              "factors must be contiguous float32 [rows, heads, head_dim / 2, 2] matching qk");
  const int64_t rows = qk.size(0), width = qk.size(1);
  CADENCE_DISPATCH(qk.scalar_type(), "rotary_", [&] {
    scalar_t* data = qk.data_ptr<scalar_t>();
    const float* f = factors.data_ptr<float>();
    const int64_t stride = qk.stride(0);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> x(width);
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = data + r * stride;
        const float* fr = f + r * width;
        load_row(row, x.data(), width);
        for (int64_t i = 0; i < width; i += 2) {
          const float a = x[i], b = x[i + 1], c = fr[i], s = fr[i + 1];
          x[i] = a * c - b * s;
          x[i + 1] = a * s + b * c;
        }
        store_row(x.data(), row, width);
      }
    });
  });
}

// Decode attention's two parts for a (request, KV head): `store` rotates the new K of each of
// the request's rows and stores it with V in the pool; `attend`, for one row, rotates its G
// query heads and attends over the tokens up to and including that row (the last row: the
// request's `len` tokens; the one before it: one fewer; so drafted tokens see only those
// before them). kD is the head dimension when known at compile time (the loops then unroll
// into registers), 0 when it is only known at run time (`d`).
template <typename T, int kD>
struct DecodeTask {
  const T* qkv; int64_t qkv_stride;   // [R, (H + 2 KVH) * D] this step's projections
  const float* factors;                 // [R, H + KVH, D / 2, 2] rotary (times head scale)
  T* pool; int64_t plane;               // kv_buffer and the size of one (K/V, head) plane
  const int64_t* slots;                 // [R] where each row's new token goes
  const int64_t* table; int64_t max_pages; int64_t page_size;
  const int64_t* lens;                  // [B] each request's length, its new rows included
  const int64_t* starts;                // [B + 1] request b's rows; nullptr: row b alone
  T* out;                               // [R, H * D]
  int64_t heads, kv_heads, d;

  // The new K (rotated, rounded to the pool's dtype) and V of request b's rows for KV head
  // h into their slots; `row` is scratch of D floats.
  void store(int64_t b, int64_t h, float* row) const {
    const int64_t D = kD > 0 ? kD : d, half = D / 2, fq = heads + kv_heads;
    const int64_t r0 = starts ? starts[b] : b, r1 = starts ? starts[b + 1] : b + 1;
    for (int64_t r = r0; r < r1; ++r) {
      const T* src = qkv + r * qkv_stride;
      const int64_t slot = slots[r];
      load_row(src + (heads + h) * D, row, D);
      rotate(row, factors + r * fq * D + (heads + h) * D, half);
      store_row(row, pool + h * plane + slot * D, D);
      std::copy(src + (heads + kv_heads + h) * D, src + (heads + kv_heads + h + 1) * D,
                pool + (kv_heads + h) * plane + slot * D);
    }
  }

  // Row r of request b (KV head h) over the sequence's first `len` tokens.
  void attend(int64_t b, int64_t h, int64_t r, int64_t len, float* qf, float* row, float* acc,
              std::vector<float>& scores) const {
    const int64_t D = kD > 0 ? kD : d, groups = heads / kv_heads;
    const int64_t half = D / 2, fq = heads + kv_heads;
    const T* src = qkv + r * qkv_stride;
    const float* fb = factors + r * fq * D;
    for (int64_t g = 0; g < groups; ++g) {  // the query heads, rotated (and scaled) in float32
      const int64_t head = h * groups + g;
      load_row(src + head * D, qf + g * D, D);
      rotate(qf + g * D, fb + head * D, half);
    }
    // Each group's scores, then (paired V on even pages) its weights as bfloat16 pairs: an
    // odd length's last pair takes a 0 weight from the padding slot.
    const int64_t stride = len + (len & 1);
    const bool paired = kPairedV && page_size % 2 == 0;
    scores.resize(groups * stride);
    static thread_local std::vector<uint32_t> pairs;
    if (paired) pairs.resize(groups * stride / 2);
    const T* kplane = pool + h * plane;
    const T* vplane = pool + (kv_heads + h) * plane;
    const int64_t* pages = table + b * max_pages;
    // Page by page: no division per token (a 64-bit divide costs more than a token's dot products).
    for (int64_t start = 0, p = 0; start < len; start += page_size, ++p) {
      score_rows(kplane + pages[p] * page_size * D, std::min(page_size, len - start), qf, groups,
                 scores.data() + start, stride, row);
    }
    uint32_t* weights = paired ? pairs.data() : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
      float* s = scores.data() + g * stride;
      float mx = s[0];
      for (int64_t t = 1; t < len; ++t) mx = std::max(mx, s[t]);
      float sum = 0.f;
      for (int64_t t = 0; t < len; ++t) {
        s[t] = std::exp(s[t] - mx);
        sum += s[t];
      }
      const float inv = 1.f / sum;
      if (stride > len) s[len] = 0.f;
      if (paired) {
        to_pairs(s, stride, inv, weights + g * stride / 2);
      } else {
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
    }
    std::fill(acc, acc + groups * D, 0.f);
    for (int64_t start = 0, p = 0; start < len; start += page_size, ++p) {
      weigh_rows(vplane + pages[p] * page_size * D, std::min(page_size, len - start), scores.data() + start, stride,
                 groups, acc, row, weights ? weights + start / 2 : nullptr);
    }
    if constexpr (kPairedV) unpermute_acc(acc, groups * D, row);
    for (int64_t g = 0; g < groups; ++g) store_row(acc + g * D, out + r * heads * D + (h * groups + g) * D, D);
  }

  // scores[g * stride + t] = q_g . k_t for the n rows of k (one page, contiguous); `row` is
  // scratch of D floats.
  void score_rows(const T* k, int64_t n, const float* qf, int64_t groups, float* scores, int64_t stride,
                  float* row) const {
    const int64_t D = kD > 0 ? kD : d;
#if defined(__AVX512F__)
    if constexpr (kD > 0 && kD % 32 == 0) {
      // Sixteen tokens at a time: sixteen dot products as vectors, then one transposing
      // reduction instead of sixteen horizontal sums.
      for (int64_t g = 0; g < groups; ++g) {
        float* out = scores + g * stride;
        const float* qg = qf + g * kD;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          // bfloat16 pairs straight into float32 sums (q rounded to bfloat16, as torch's path
          // stores it); k is never converted.
          constexpr int kP = kD / 32;
          __m512bh q[kP];
          for (int j = 0; j < kP; ++j) {
            q[j] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + 32 * j + 16), _mm512_loadu_ps(qg + 32 * j));
          }
          auto dot = [&](int64_t t) {
            __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k + t * kD));
            for (int j = 1; j < kP; ++j) {
              acc = _mm512_dpbf16_ps(acc, q[j], (__m512bh)_mm512_loadu_si512(k + t * kD + 32 * j));
            }
            return acc;
          };
          score_blocks(dot, n, out);
          continue;
        }
#endif
        constexpr int kV = kD / 16;
        __m512 q[kV];
        for (int v = 0; v < kV; ++v) q[v] = _mm512_loadu_ps(qg + 16 * v);
        auto dot = [&](int64_t t) {
          __m512 acc = _mm512_mul_ps(q[0], load16(k + t * kD));
          for (int v = 1; v < kV; ++v) acc = _mm512_fmadd_ps(q[v], load16(k + t * kD + 16 * v), acc);
          return acc;
        };
        score_blocks(dot, n, out);
      }
      return;
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
      load_row(k + t * D, row, D);
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.f;
        for (int64_t i = 0; i < D; ++i) dot += qf[g * D + i] * row[i];
        scores[g * stride + t] = dot;
      }
    }
  }

#if defined(__AVX512F__)
  // out[t] = the sum of dot(t)'s lanes, for t < n.
  template <typename Dot>
  static void score_blocks(const Dot& dot, int64_t n, float* out) {
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = dot(t + i);
      _mm512_storeu_ps(out + t, reduce16(v));
    }
    for (; t < n; ++t) out[t] = _mm512_reduce_add_ps(dot(t));
  }

  // Lane i of the result is the sum of v[i]'s sixteen lanes.
  static __m512 reduce16(const __m512* v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4i .. 4i+3]
      x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    }
    for (int i = 0; i < 2; ++i) {  // lanes 0+1 and 2+3 of x[2i], then of x[2i+1]
      y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  }
#endif

  // Whether weigh_rows keeps acc in its pair-interleaved order (see unpermute_acc).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  static constexpr bool kPairedV = std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 32 == 0;
#else
  static constexpr bool kPairedV = false;
#endif

  // acc[g] += sum_t p[g * stride + t] * v_t for the n rows of v (one page, contiguous);
  // `row` is scratch of n * D floats. `pairs_of_p`, where given (paired V), holds the same
  // weights as bfloat16 pairs, group g's from pairs_of_p[g * stride / 2] on (`to_pairs`).
  void weigh_rows(const T* v, int64_t n, const float* p, int64_t stride, int64_t groups, float* acc,
                  float* row, const uint32_t* pairs_of_p = nullptr) const {
    const int64_t D = kD > 0 ? kD : d;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (kPairedV) {
      // Two tokens per instruction: their V rows interleaved into (v_t[i], v_t+1[i]) pairs, the
      // weights rounded to a bfloat16 pair (as torch's bfloat16 path rounds its softmax). The
      // float32 sums then sit in a fixed permutation of the head dimension (unpermute_acc).
      constexpr int kP = kD / 32;
      // The page's rows interleaved once into pairs (scratch: (n + 1) / 2 pairs of 2 * kP
      // vectors, the same bytes as the page), then each group sums over them in registers.
      __m512i* pairs = reinterpret_cast<__m512i*>(row);
      const int64_t num_pairs = (n + 1) / 2;
      for (int64_t q = 0; q < num_pairs; ++q) {
        const int64_t t = 2 * q;
        for (int j = 0; j < kP; ++j) {
          const __m512i a = _mm512_loadu_si512(v + t * kD + 32 * j);
          const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * kD + 32 * j) : _mm512_setzero_si512();
          _mm512_storeu_si512(pairs + q * 2 * kP + 2 * j, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(pairs + q * 2 * kP + 2 * j + 1, _mm512_unpackhi_epi16(a, b));
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* a = acc + g * kD;
        __m512 sum[2 * kP];
        for (int j = 0; j < 2 * kP; ++j) sum[j] = _mm512_loadu_ps(a + 16 * j);
        const float* pg = p + g * stride;
        const uint32_t* wg = pairs_of_p ? pairs_of_p + g * stride / 2 : nullptr;
        for (int64_t q = 0; q < num_pairs; ++q) {
          const int64_t t = 2 * q;
          const uint32_t pair = wg ? wg[q]
                                   : static_cast<uint32_t>(c10::BFloat16(pg[t]).x) |
                                         (static_cast<uint32_t>(c10::BFloat16(t + 1 < n ? pg[t + 1] : 0.f).x) << 16);
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          for (int j = 0; j < 2 * kP; ++j) {
            sum[j] = _mm512_dpbf16_ps(sum[j], (__m512bh)_mm512_loadu_si512(pairs + q * 2 * kP + j), w);
          }
        }
        for (int j = 0; j < 2 * kP; ++j) _mm512_storeu_ps(a + 16 * j, sum[j]);
      }
      return;
    }
#endif
    load_row(v, row, n * D);  // each value converted once, then read by every group
#if defined(__AVX512F__)
    if constexpr (kD > 0 && kD % 32 == 0) {
      constexpr int kV = kD / 16;
      for (int64_t g = 0; g < groups; ++g) {
        __m512 a[kV];
        for (int i = 0; i < kV; ++i) a[i] = _mm512_loadu_ps(acc + g * kD + 16 * i);
        for (int64_t t = 0; t < n; ++t) {
          const __m512 w = _mm512_set1_ps(p[g * stride + t]);
          for (int i = 0; i < kV; ++i) a[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + t * kD + 16 * i), a[i]);
        }
        for (int i = 0; i < kV; ++i) _mm512_storeu_ps(acc + g * kD + 16 * i, a[i]);
      }
      return;
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < groups; ++g) {
        const float w = p[g * stride + t];
        for (int64_t i = 0; i < D; ++i) acc[g * D + i] += w * row[t * D + i];
      }
    }
  }

  // out[i] = s[2i] * inv and s[2i + 1] * inv as a bfloat16 pair (low half first), rounded to
  // nearest even as c10::BFloat16 rounds, for the even n floats of s; vectors of 32 where
  // the CPU has them.
  static void to_pairs(const float* s, int64_t n, float inv, uint32_t* out) {
    int64_t t = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    const __m512 scale = _mm512_set1_ps(inv);
    for (; t < n; t += 32) {
      const int64_t left = std::min<int64_t>(32, n - t);
      const __mmask16 lo = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
      const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(lo, s + t), scale);
      const __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(hi, s + t + 16), scale);
      const __mmask32 words = left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << left) - 1);
      _mm512_mask_storeu_epi16(out + t / 2, words, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
#endif
    for (; t < n; t += 2) {
      out[t / 2] = static_cast<uint32_t>(c10::BFloat16(s[t] * inv).x) |
                   (static_cast<uint32_t>(c10::BFloat16(s[t + 1] * inv).x) << 16);
    }
  }

  // The paired weighing leaves, per 32 dims and per 128-bit lane k of its two vectors, dims
  // 8k..8k+3 in the first vector's lane and 8k+4..8k+7 in the second's: put them in order.
  static void unpermute_acc(float* acc, int64_t n, float* scratch) {
    for (int64_t base = 0; base < n; base += 32) {
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          scratch[8 * k + j] = acc[base + 4 * k + j];
          scratch[8 * k + 4 + j] = acc[base + 16 + 4 * k + j];
        }
      }
      std::copy(scratch, scratch + 32, acc + base);
    }
  }

  static void rotate(float* x, const float* f, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1], c = f[2 * i], s = f[2 * i + 1];
      x[2 * i] = a * c - b * s;
      x[2 * i + 1] = a * s + b * c;
    }
  }
};

// Work of one (row, KV head) of decode attention, in tokens: its length, plus what setting up
// a row costs (its queries loaded and rotated, the softmax's passes) in tokens' worth.
constexpr int64_t kRowSetupTokens = 16;

// Decode attention over the batch: every (request, KV head)'s stores first, then one task per
// (request, KV head, row), split into one contiguous run per thread of about equal work. A
// verify step's rows differ widely (a request with eight drafts has eight rows, one without
// has one; each over the request's length), so even runs of tasks would leave one thread with
// most of them: a batch with its drafting requests first took 1.6x as long. Each row's output
// does not depend on the split.
template <typename T, int kD>
void decode_tasks(const DecodeTask<T, kD>& task, int64_t bs) {
  const int64_t d = kD > 0 ? kD : task.d, groups = task.heads / task.kv_heads, kvh = task.kv_heads;
  // Stores are a few hundred bytes each: threads only pay for many.
  at::parallel_for(0, bs * kvh, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t i = begin; i < end; ++i) task.store(i / kvh, i % kvh, row.data());
  });
  // Tasks in (request, head, row) order, so a thread's run reads each request's K and V once
  // for all its rows while they are in cache; `end` is the work up to the task's end.
  struct Unit {
    int64_t b, h, r, len, end;
  };
  std::vector<Unit> units;
  units.reserve((task.starts ? task.starts[bs] : bs) * kvh);
  int64_t work = 0;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t r0 = task.starts ? task.starts[b] : b, r1 = task.starts ? task.starts[b + 1] : b + 1;
    for (int64_t h = 0; h < kvh; ++h) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t len = task.lens[b] - (r1 - 1 - r);
        work += len + kRowSetupTokens;
        units.push_back({b, h, r, len, work});
      }
    }
  }
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads()));
  // Run k takes the tasks whose work ends past k / runs of the total and by (k + 1) / runs.
  std::vector<int64_t> first(runs + 1, n);
  first[0] = 0;
  for (int64_t k = 1; k < runs; ++k) {
    const int64_t target = work * k / runs;
    first[k] = std::upper_bound(units.begin(), units.end(), target,
                                [](int64_t v, const Unit& u) { return v < u.end; }) -
               units.begin();
  }
  at::parallel_for(0, runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * d), row(task.page_size * d), acc(groups * d), scores;
    for (int64_t k = begin; k < end; ++k) {
      for (int64_t i = first[k]; i < first[k + 1]; ++i) {
        const Unit& u = units[i];
        task.attend(u.b, u.h, u.r, u.len, qf.data(), row.data(), acc.data(), scores);
      }
    }
  });
}

// Decode attention with its rotary and its K/V store, straight on the paged pool.
// qkv: [R, (H + 2 KVH) * D] this step's un-rotated projections (rows may be strided), one row
// per request, or, with `query_starts` [B + 1] (int64, from 0 to R), request b's rows
// query_starts[b] to query_starts[b + 1]: its last sampled token then its drafted ones, which
// attend causally among themselves (a verify step); factors: float32 [R, H + KVH, D / 2, 2]
// (`rotary_`'s); kv_buffer: [2, KVH, pages, page_size, D], written at `slots` [R] (page *
// page_size + offset); page_table: [B, max_pages] int64; seq_lens: [B] int64, the new rows
// included. Each (request, KV head) is one task: per row it scores its G query heads against
// the tokens up to that row (reading K once), softmax in float32, then one pass over V.
// Returns [R, H * D] in qkv's dtype.
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& factors, at::Tensor& kv_buffer,
                            const at::Tensor& slots, const at::Tensor& page_table, const at::Tensor& seq_lens,
                            int64_t num_heads, const std::optional<at::Tensor>& query_starts) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(kv_buffer.dim() == 5 && kv_buffer.size(0) == 2 && kv_buffer.is_contiguous(),
              "kv_buffer must be a contiguous [2, KVH, pages, page_size, D] tensor");
  TORCH_CHECK(qkv.scalar_type() == kv_buffer.scalar_type(), "qkv and kv_buffer must have the same dtype");
  const int64_t rows = qkv.size(0), bs = seq_lens.numel();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == rows,
              "slots must be a contiguous int64 [rows] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [batch] tensor");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.is_contiguous() &&
                  page_table.size(0) == bs,
              "page_table must be a contiguous int64 [batch, max_pages] tensor");
  const int64_t* starts = nullptr;
  if (query_starts.has_value()) {
    const at::Tensor& qs = *query_starts;
    TORCH_CHECK(qs.scalar_type() == at::kLong && qs.dim() == 1 && qs.is_contiguous() && qs.size(0) == bs + 1,
                "query_starts must be a contiguous int64 [batch + 1] tensor");
    starts = qs.data_ptr<int64_t>();
    TORCH_CHECK(starts[0] == 0 && starts[bs] == rows, "query_starts must run from 0 to the number of rows");
  } else {
    TORCH_CHECK(rows == bs, "without query_starts, one row per request");
  }
  const int64_t kvh = kv_buffer.size(1), num_pages = kv_buffer.size(2);
  const int64_t page_size = kv_buffer.size(3), d = kv_buffer.size(4);
  TORCH_CHECK(num_heads % kvh == 0 && qkv.size(1) == (num_heads + 2 * kvh) * d,
              "qkv must be [rows, (num_heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(factors.scalar_type() == at::kFloat && factors.is_contiguous() &&
                  factors.numel() == rows * (num_heads + kvh) * d && d % 2 == 0,
              "factors must be contiguous float32 [rows, num_heads + kv_heads, head_dim / 2, 2]");
  const int64_t max_pages = page_table.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t r0 = starts ? starts[b] : b, r1 = starts ? starts[b + 1] : b + 1;
    TORCH_CHECK(r1 > r0 && r1 - r0 <= lens[b], "each request needs between 1 and seq_len rows");
    TORCH_CHECK(lens[b] <= max_pages * page_size, "seq_lens out of range of page_table");
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p) {
      TORCH_CHECK(table[b * max_pages + p] >= 0 && table[b * max_pages + p] < num_pages,
                  "page_table holds a page outside the pool");
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pos = lens[b] - (r1 - r);
      TORCH_CHECK(slot[r] == table[b * max_pages + pos / page_size] * page_size + pos % page_size,
                  "slots must be each row's position in page_table");
    }
  }
  auto out = at::empty({rows, num_heads * d}, qkv.options());
  CADENCE_DISPATCH(qkv.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto dim) {
      constexpr int kD = decltype(dim)::value;
      DecodeTask<scalar_t, kD> task{qkv.data_ptr<scalar_t>(), qkv.stride(0), factors.data_ptr<float>(),
                                    kv_buffer.data_ptr<scalar_t>(), num_pages * page_size * d, slot, table,
                                    max_pages, page_size, lens, starts, out.data_ptr<scalar_t>(), num_heads, kvh, d};
      decode_tasks(task, bs);
    };
    if (d == 64) {
      run(std::integral_constant<int, 64>());
    } else if (d == 128) {
      run(std::integral_constant<int, 128>());
    } else {
      run(std::integral_constant<int, 0>());
    }
  });
  return out;
}

// float32 logits of a bfloat16/float16 LM head, with every logit that can still be its row's
// maximum recomputed in float32 from `hidden` [rows, H] and `weight` [vocab, H]: rounding
// moves a value by at most 2^-8 of itself, so every token that can hold the true maximum is
// within 2^-6 of the rounded maximum (see cadence.layers.linear.refine_top_logits, the same
// rule on torch ops). One pass converts and finds each chunk's maximum, a second recomputes
// the few candidates.
at::Tensor refined_logits(const at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight) {
  check_rows(logits, "logits");
  check_rows(hidden, "hidden");
  TORCH_CHECK(logits.scalar_type() == hidden.scalar_type() && weight.scalar_type() == hidden.scalar_type(),
              "logits, hidden and weight must have the same dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == logits.size(1) &&
                  weight.size(1) == hidden.size(1) && hidden.size(0) == logits.size(0),
              "weight must be a contiguous [vocab, hidden] tensor matching logits and hidden");
  const int64_t rows = logits.size(0), vocab = logits.size(1), h = hidden.size(1);
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  auto out = at::empty({rows, vocab}, logits.options().dtype(at::kFloat));
  std::vector<float> chunk_max(rows * chunks), floor(rows);
  CADENCE_DISPATCH(logits.scalar_type(), "refined_logits", [&] {
    const scalar_t* src = logits.data_ptr<scalar_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / chunks, lo = (i % chunks) * kChunk, n = std::min(kChunk, vocab - lo);
        float* o = dst + r * vocab + lo;
        load_row(src + r * logits.stride(0) + lo, o, n);
        chunk_max[i] = *std::max_element(o, o + n);
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      const float top = *std::max_element(chunk_max.begin() + r * chunks, chunk_max.begin() + (r + 1) * chunks);
      floor[r] = top - (std::fabs(top) * 0.015625f + 1e-3f);
    }
    const scalar_t* hd = hidden.data_ptr<scalar_t>();
    const scalar_t* wd = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> hf(h), wf(h);
      int64_t loaded = -1;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / chunks, lo = (i % chunks) * kChunk, n = std::min(kChunk, vocab - lo);
        if (chunk_max[i] < floor[r]) continue;
        float* o = dst + r * vocab + lo;
        for (int64_t j = 0; j < n; ++j) {
          if (o[j] < floor[r]) continue;
          if (loaded != r) {
            load_row(hd + r * hidden.stride(0), hf.data(), h);
            loaded = r;
          }
          load_row(wd + (lo + j) * h, wf.data(), h);
          float dot = 0.f;
          for (int64_t k = 0; k < h; ++k) dot += hf[k] * wf[k];
          o[j] = dot;
        }
      }
    });
  });
  return out;
}

// Whole KV pages between a pool and a packed buffer (prefill/decode disaggregation). Each
// layer is [2, heads, pages, page_size, head_dim] contiguous: one (K/V, head) plane of a page
// is one contiguous block, moved with memcpy. The packed layout is, layer by layer, the
// [2, heads, len(pages), page_size, head_dim] block of the pages in order (KVPool's). torch's
// index_select / index_copy_ reach a third to a half of memcpy's rate on these 4 KiB blocks.
void move_pages_(const std::vector<at::Tensor>& layers, const at::Tensor& pages,
                 const at::Tensor& packed, bool to_packed) {
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 1 && pages.is_contiguous(),
              "move_pages_: pages must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.is_cpu(),
              "move_pages_: packed must be a contiguous uint8 CPU tensor");
  const int64_t n = pages.numel();
  if (layers.empty() || n == 0) return;
  const at::Tensor& first = layers[0];
  TORCH_CHECK(first.dim() == 5, "move_pages_: a layer is [2, heads, pages, page_size, head_dim]");
  const int64_t planes = first.size(0) * first.size(1), num_pages = first.size(2);
  const int64_t block = first.size(3) * first.size(4) * first.element_size();
  TORCH_CHECK(packed.numel() >= static_cast<int64_t>(layers.size()) * planes * n * block,
              "move_pages_: packed holds fewer bytes than the pages");
  const int64_t* idx = pages.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(idx[j] >= 0 && idx[j] < num_pages, "move_pages_: page ", idx[j], " is not in the pool");
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (const at::Tensor& layer : layers) {
    TORCH_CHECK(layer.is_contiguous() && layer.is_cpu() && layer.sizes() == first.sizes() &&
                    layer.scalar_type() == first.scalar_type(),
                "move_pages_: every layer must be a contiguous CPU tensor of the first's shape");
    uint8_t* base = static_cast<uint8_t*>(layer.data_ptr());
    for (int64_t p = 0; p < planes; ++p) {
      for (int64_t j = 0; j < n; ++j) {
        uint8_t* slot = base + (p * num_pages + idx[j]) * block;
        if (to_packed) std::memcpy(out, slot, block);
        else std::memcpy(slot, out, block);
        out += block;
      }
    }
  }
}

// Copies a block whose size is a multiple of 128 bytes (SSE2: 64) to a 32-byte (16) aligned
// destination with non-temporal stores: each destination line is written without being read
// first. A plain copy of blocks this size (glibc streams only far larger ones) reads every
// line it is about to overwrite, a third of the memory traffic, and keeps it in the cache,
// which the next blocks evict anyway. While it copies, it asks for the next block `next` (of
// the same size; null: none) line for line: the hardware prefetchers stop at each 4 KiB
// page, and asking for a whole block at once fills the line buffers the copy itself needs
// (a pool's scattered 4 KiB blocks, 2 Zen cores: 5.5 -> 10.3 GB/s alone). The caller fences
// once after its last block.
inline bool copy_streaming(uint8_t* dst, const uint8_t* src, const uint8_t* next, int64_t bytes) {
#if defined(__AVX2__)
  if (bytes % 128 != 0 || reinterpret_cast<uintptr_t>(dst) % 32 != 0) return false;
  for (int64_t off = 0; off < bytes; off += 128) {
    if (next != nullptr) {
      __builtin_prefetch(next + off, 0, 0);
      __builtin_prefetch(next + off + 64, 0, 0);
    }
    const __m256i* s = reinterpret_cast<const __m256i*>(src + off);
    __m256i* d = reinterpret_cast<__m256i*>(dst + off);
    const __m256i a = _mm256_loadu_si256(s), b = _mm256_loadu_si256(s + 1);
    const __m256i c = _mm256_loadu_si256(s + 2), e = _mm256_loadu_si256(s + 3);
    _mm256_stream_si256(d, a);
    _mm256_stream_si256(d + 1, b);
    _mm256_stream_si256(d + 2, c);
    _mm256_stream_si256(d + 3, e);
  }
  return true;
#elif defined(__SSE2__)
  if (bytes % 64 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0) return false;
  for (int64_t off = 0; off < bytes; off += 64) {
    if (next != nullptr) __builtin_prefetch(next + off, 0, 0);
    const __m128i* s = reinterpret_cast<const __m128i*>(src + off);
    __m128i* d = reinterpret_cast<__m128i*>(dst + off);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  return true;
#else
  (void)dst, (void)src, (void)next, (void)bytes;
  return false;
#endif
}

inline void streaming_done() {
#if defined(__SSE2__)
  _mm_sfence();  // the streamed stores are visible before anyone reads the pages
#endif
}

// Whole KV pages from one pool to another of the same page layout (a decode server copying
// from a prefill server's pool in shared memory): one streamed copy per page plane, in one
// pass over (layer, plane, page), each copy asking for the block after it, across planes and
// layers too (a chunk of a transfer is a few pages: without that, every plane would start
// cold).
void copy_pages_(const std::vector<at::Tensor>& src_layers, const at::Tensor& src_pages,
                 const std::vector<at::Tensor>& dst_layers, const at::Tensor& dst_pages) {
  TORCH_CHECK(src_layers.size() == dst_layers.size(), "copy_pages_: layer counts differ");
  TORCH_CHECK(src_pages.scalar_type() == at::kLong && dst_pages.scalar_type() == at::kLong &&
                  src_pages.is_contiguous() && dst_pages.is_contiguous() &&
                  src_pages.numel() == dst_pages.numel(),
              "copy_pages_: page lists must be contiguous int64 tensors of one length");
  const int64_t n = src_pages.numel();
  if (src_layers.empty() || n == 0) return;
  const at::Tensor& s0 = src_layers[0];
  const at::Tensor& d0 = dst_layers[0];
  TORCH_CHECK(s0.dim() == 5 && d0.dim() == 5 && s0.size(0) == d0.size(0) &&
                  s0.size(1) == d0.size(1) && s0.size(3) == d0.size(3) && s0.size(4) == d0.size(4) &&
                  s0.scalar_type() == d0.scalar_type(),
              "copy_pages_: the pools' pages differ in shape or dtype");
  const int64_t planes = s0.size(0) * s0.size(1), src_num = s0.size(2), dst_num = d0.size(2);
  const int64_t block = s0.size(3) * s0.size(4) * s0.element_size();
  const int64_t* si = src_pages.data_ptr<int64_t>();
  const int64_t* di = dst_pages.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(si[j] >= 0 && si[j] < src_num, "copy_pages_: source page ", si[j], " is not in its pool");
    TORCH_CHECK(di[j] >= 0 && di[j] < dst_num, "copy_pages_: page ", di[j], " is not in the pool");
  }
  const int64_t layers = static_cast<int64_t>(src_layers.size());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& src = src_layers[l];
    const at::Tensor& dst = dst_layers[l];
    TORCH_CHECK(src.is_contiguous() && dst.is_contiguous() && src.is_cpu() && dst.is_cpu() &&
                    src.sizes() == s0.sizes() && dst.sizes() == d0.sizes(),
                "copy_pages_: every layer must be a contiguous CPU tensor of its pool's shape");
  }
  for (int64_t l = 0; l < layers; ++l) {
    const uint8_t* sb = static_cast<const uint8_t*>(src_layers[l].data_ptr());
    uint8_t* db = static_cast<uint8_t*>(dst_layers[l].data_ptr());
    const uint8_t* next_layer =
        l + 1 < layers ? static_cast<const uint8_t*>(src_layers[l + 1].data_ptr()) : nullptr;
    for (int64_t p = 0; p < planes; ++p)
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t* next = nullptr;  // the block copied after this one
        if (j + 1 < n) next = sb + (p * src_num + si[j + 1]) * block;
        else if (p + 1 < planes) next = sb + ((p + 1) * src_num + si[0]) * block;
        else if (next_layer != nullptr) next = next_layer + si[0] * block;
        uint8_t* to = db + (p * dst_num + di[j]) * block;
        const uint8_t* from = sb + (p * src_num + si[j]) * block;
        if (!copy_streaming(to, from, next, block)) std::memcpy(to, from, block);
      }
  }
  streaming_done();
}

#include "lora_products.cpp"

}  // namespace

TORCH_LIBRARY(cadence, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("refined_logits(Tensor logits, Tensor hidden, Tensor weight) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor factors) -> ()");
  m.def("decode_attention(Tensor qkv, Tensor factors, Tensor(a!) kv_buffer, Tensor slots, Tensor page_table, "
        "Tensor seq_lens, int num_heads, Tensor? query_starts=None) -> Tensor");
  m.def("move_pages_(Tensor(a!)[] layers, Tensor pages, Tensor(b!) packed, bool to_packed) -> ()");
  m.def("copy_pages_(Tensor[] src_layers, Tensor src_pages, Tensor(a!)[] dst_layers, Tensor dst_pages) -> ()");
  m.def("lora_products_(Tensor(a!) y, Tensor x, Tensor rows, int[] starts, float[] scales, Tensor[] a, "
        "Tensor[] bt, int[] offsets) -> ()");
  m.def("lora_table(Tensor[] a, Tensor[] bt, int[] offsets) -> Tensor");
  m.def("lora_products_table_(Tensor(a!) y, Tensor x, Tensor rows, int[] starts, float[] scales, "
        "Tensor table) -> ()");
}

TORCH_LIBRARY_IMPL(cadence, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("refined_logits", &refined_logits);
  m.impl("rotary_", &rotary_);
  m.impl("decode_attention", &decode_attention);
  m.impl("move_pages_", &move_pages_);
  m.impl("copy_pages_", &copy_pages_);
  m.impl("lora_products_", &lora_products_);
  m.impl("lora_table", &lora_table);
  m.impl("lora_products_table_", &lora_products_table_);
}
