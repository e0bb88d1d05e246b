// Fused CPU kernels for the decode step (registered as torch.ops.cadence.*).
//
// A decode step at small batch is dozens of tiny tensor ops per layer, and on CPU each one
// costs several microseconds of dispatch and allocation whatever its size. These kernels do
// the element-wise work of a layer in one pass each, with float32 arithmetic inside and
// one rounding to the tensor's dtype at the end, and read the paged K/V pool directly for
// decode attention. They are built on first use (cadence/kernels/__init__.py); the model
// falls back to plain torch ops where they cannot be built.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Dispatch on the three model dtypes; `scalar_t` names the element type inside.
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

// Decode attention straight from the paged pool. q: [B, H * D] (already scaled); kv_buffer:
// [2, KVH, pages, page_size, D]; page_table: [B, max_pages] int64; seq_lens: [B] int64.
// Each (request, KV head) is one task: its G query heads score every token of the sequence
// (reading K once), softmax in float32, then one pass over V. Returns [B, H * D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_buffer, const at::Tensor& page_table,
                            const at::Tensor& seq_lens, int64_t num_heads) {
  check_rows(q, "q");
  TORCH_CHECK(kv_buffer.dim() == 5 && kv_buffer.size(0) == 2 && kv_buffer.is_contiguous(),
              "kv_buffer must be a contiguous [2, KVH, pages, page_size, D] tensor");
  TORCH_CHECK(q.scalar_type() == kv_buffer.scalar_type(), "q and kv_buffer must have the same dtype");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.is_contiguous(),
              "page_table must be a contiguous int64 [batch, max_pages] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [batch] tensor");
  const int64_t bs = q.size(0), kvh = kv_buffer.size(1), num_pages = kv_buffer.size(2);
  const int64_t page_size = kv_buffer.size(3), d = kv_buffer.size(4);
  TORCH_CHECK(num_heads % kvh == 0 && q.size(1) == num_heads * d, "q must be [batch, num_heads * head_dim]");
  TORCH_CHECK(page_table.size(0) == bs && seq_lens.size(0) == bs, "page_table and seq_lens need one row per request");
  const int64_t groups = num_heads / kvh, max_pages = page_table.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_pages * page_size, "seq_lens out of range of page_table");
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p) {
      TORCH_CHECK(table[b * max_pages + p] >= 0 && table[b * max_pages + p] < num_pages,
                  "page_table holds a page outside the pool");
    }
  }
  auto out = at::empty({bs, num_heads * d}, q.options());
  CADENCE_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qd = q.data_ptr<scalar_t>();
    const scalar_t* kvd = kv_buffer.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    const int64_t plane = num_pages * page_size * d;  // one (K/V, head) plane
    at::parallel_for(0, bs * kvh, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(groups * d), row(d), acc(groups * d), scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kvh, h = task % kvh, len = lens[b];
        for (int64_t g = 0; g < groups; ++g) load_row(qd + b * q.stride(0) + (h * groups + g) * d, qf.data() + g * d, d);
        scores.resize(groups * len);
        const scalar_t* kplane = kvd + h * plane;
        const scalar_t* vplane = kvd + (kvh + h) * plane;
        const int64_t* pages = table + b * max_pages;
        for (int64_t t = 0; t < len; ++t) {
          const int64_t page = pages[t / page_size];
          load_row(kplane + (page * page_size + t % page_size) * d, row.data(), d);
          for (int64_t g = 0; g < groups; ++g) {
            const float* qg = qf.data() + g * d;
            float dot = 0.f;
            for (int64_t i = 0; i < d; ++i) dot += qg[i] * row[i];
            scores[g * len + t] = dot;
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          float* s = scores.data() + g * len;
          const float mx = *std::max_element(s, s + len);
          float sum = 0.f;
          for (int64_t t = 0; t < len; ++t) {
            s[t] = std::exp(s[t] - mx);
            sum += s[t];
          }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const int64_t page = pages[t / page_size];
          load_row(vplane + (page * page_size + t % page_size) * d, row.data(), d);
          for (int64_t g = 0; g < groups; ++g) {
            const float p = scores[g * len + t];
            float* a = acc.data() + g * d;
            for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
          }
        }
        for (int64_t g = 0; g < groups; ++g) store_row(acc.data() + g * d, od + b * num_heads * d + (h * groups + g) * d, d);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(cadence, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor factors) -> ()");
  m.def("decode_attention(Tensor q, Tensor kv_buffer, Tensor page_table, Tensor seq_lens, int num_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(cadence, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("decode_attention", &decode_attention);
}
