// LoRA products of a step whose rows use different adapters (cadence/layers/lora.py), in one
// call per projection: a segmented matmul. Included by cpu_ops.cpp inside its namespace (it
// shares that file's dtype dispatch and row loads, and its translation unit: the torch
// headers are most of a build's time).
//
// The step's rows come grouped by adapter: `rows[starts[g] .. starts[g + 1])` are group g's
// rows of x [T, in] and y [T, out], and scales[g] its adapter's scaling. A projection has P
// parts (q, k, v of the fused qkv; gate, up of gate_up; o and down have one), part p writing
// y's columns from offsets[p]. For group g and part p, a[g * P + p] is the adapter's A
// [r, in] and bt[g * P + p] its B transposed [r, out_p], both float32 or both bfloat16 (an
// adapter is kept at its file's precision), rows contiguous; r = 0 where the adapter does
// not target the part. Each row gets y[row, part] += scale * (x[row] A^T) B^T.
//
// The weights are what the step reads most (eight rank-16 adapters on every projection of a
// 135M model are 78 MB in bfloat16), so each is read once per step, whatever the number of
// rows its adapter serves. The sums are float32; y is rounded to its dtype once, at the end,
// as an in-place add of the product would round. Small steps run on the calling thread (a
// thread pool's wake-up costs more than a decode row's products).

constexpr int64_t kLoraSerialWork = 1 << 16;  // multiply-adds below which no thread is woken

struct LoraPart {
  int64_t group, part, rank, out, low_offset;
  const void* a;
  const void* bt;
  int64_t a_stride, bt_stride;
  bool bf16;
};

inline float lora_weight(float w) { return w; }
inline float lora_weight(c10::BFloat16 w) {
  // the top half of a float32: a shift the compiler vectorizes
  return std::bit_cast<float>(static_cast<uint32_t>(w.x) << 16);
}

// One (group, part): low[t, j] = scale * x[t] . A[j], each A row read once for all the
// group's rows; then delta[t, part] += sum_j low[t, j] B^T[j], each B^T row read once. Four
// rows of A (of B^T) go together: four independent sums per x element (a single running sum
// would wait on its own latency), one pass over each delta row per four B^T rows.
template <typename W>
void lora_part(const LoraPart& pt, const float* xs, int64_t in, int64_t first, int64_t count,
               float scale, float* lows, float* delta, int64_t out, int64_t column) {
  const W* a = static_cast<const W*>(pt.a);
  const W* bt = static_cast<const W*>(pt.bt);
  const int64_t r = pt.rank, r4 = r - r % 4;
  for (int64_t t = 0; t < count; ++t) {
    const float* __restrict x = xs + (first + t) * in;
    float* low = lows + t * r;
    for (int64_t j = 0; j < r4; j += 4) {
      const W* __restrict a0 = a + j * pt.a_stride;
      const W* __restrict a1 = a0 + pt.a_stride;
      const W* __restrict a2 = a1 + pt.a_stride;
      const W* __restrict a3 = a2 + pt.a_stride;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int64_t i = 0; i < in; ++i) {
        s0 += lora_weight(a0[i]) * x[i];
        s1 += lora_weight(a1[i]) * x[i];
        s2 += lora_weight(a2[i]) * x[i];
        s3 += lora_weight(a3[i]) * x[i];
      }
      low[j] = scale * s0, low[j + 1] = scale * s1, low[j + 2] = scale * s2, low[j + 3] = scale * s3;
    }
    for (int64_t j = r4; j < r; ++j) {
      const W* __restrict a0 = a + j * pt.a_stride;
      float s0 = 0.f;
      for (int64_t i = 0; i < in; ++i) s0 += lora_weight(a0[i]) * x[i];
      low[j] = scale * s0;
    }
  }
  for (int64_t j = 0; j < r4; j += 4) {
    const W* __restrict b0 = bt + j * pt.bt_stride;
    const W* __restrict b1 = b0 + pt.bt_stride;
    const W* __restrict b2 = b1 + pt.bt_stride;
    const W* __restrict b3 = b2 + pt.bt_stride;
    for (int64_t t = 0; t < count; ++t) {
      const float* low = lows + t * r;
      const float c0 = low[j], c1 = low[j + 1], c2 = low[j + 2], c3 = low[j + 3];
      float* __restrict d = delta + (first + t) * out + column;
      for (int64_t c = 0; c < pt.out; ++c)
        d[c] += c0 * lora_weight(b0[c]) + c1 * lora_weight(b1[c]) + c2 * lora_weight(b2[c]) +
                c3 * lora_weight(b3[c]);
    }
  }
  for (int64_t j = r4; j < r; ++j) {
    const W* __restrict b0 = bt + j * pt.bt_stride;
    for (int64_t t = 0; t < count; ++t) {
      const float c0 = lows[t * r + j];
      float* __restrict d = delta + (first + t) * out + column;
      for (int64_t c = 0; c < pt.out; ++c) d[c] += c0 * lora_weight(b0[c]);
    }
  }
}

// Asks for a part's weights ahead of their use: each part is a few small matrices of its
// own, and the hardware prefetchers start over at each one.
inline void lora_prefetch(const LoraPart& pt, int64_t in) {
  const int64_t elem = pt.bf16 ? 2 : 4;
  const char* a = static_cast<const char*>(pt.a);
  const char* bt = static_cast<const char*>(pt.bt);
  for (int64_t j = 0; j < pt.rank; ++j) {
    for (int64_t off = 0; off < in * elem; off += 64) __builtin_prefetch(a + j * pt.a_stride * elem + off, 0, 1);
    for (int64_t off = 0; off < pt.out * elem; off += 64)
      __builtin_prefetch(bt + j * pt.bt_stride * elem + off, 0, 1);
  }
}

std::vector<LoraPart> lora_parts(at::IntArrayRef starts, const std::vector<at::Tensor>& a,
                                 const std::vector<at::Tensor>& bt, at::IntArrayRef offsets,
                                 int64_t in, int64_t out, int64_t* low_size) {
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  const int64_t parts = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(static_cast<int64_t>(a.size()) == groups * parts && a.size() == bt.size(),
              "lora_products_: a and bt need one tensor per (group, part)");
  std::vector<LoraPart> found;
  *low_size = 0;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(starts[g] <= starts[g + 1], "lora_products_: starts must not decrease");
    for (int64_t p = 0; p < parts; ++p) {
      const at::Tensor& ap = a[g * parts + p];
      const at::Tensor& bp = bt[g * parts + p];
      TORCH_CHECK(ap.dim() == 2 && bp.dim() == 2, "lora_products_: part ", p, " of group ", g,
                  ": A and B^T must be matrices ([r, in] and [r, out]; r = 0: not targeted)");
      if (ap.size(0) == 0) continue;
      const bool bf16 = ap.scalar_type() == at::kBFloat16;
      TORCH_CHECK((ap.scalar_type() == at::kFloat || bf16) && bp.scalar_type() == ap.scalar_type() &&
                      ap.is_cpu() && bp.is_cpu() && ap.stride(1) == 1 &&
                      bp.stride(1) == 1,
                  "lora_products_: A and B^T must be float32 or bfloat16 CPU matrices of one "
                  "dtype with contiguous rows");
      TORCH_CHECK(ap.size(1) == in && bp.size(0) == ap.size(0) && offsets[p] >= 0 &&
                      offsets[p] + bp.size(1) <= out,
                  "lora_products_: part ", p, " of group ", g, " does not fit x and y");
      found.push_back({g, p, ap.size(0), bp.size(1), *low_size, ap.data_ptr(), bp.data_ptr(),
                       ap.stride(0), bp.stride(0), bf16});
      *low_size += (starts[g + 1] - starts[g]) * ap.size(0);
    }
  }
  return found;
}

void lora_products_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                    at::IntArrayRef starts, at::ArrayRef<double> scales,
                    const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
                    at::IntArrayRef offsets) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(x.size(0) == y.size(0), "lora_products_: x and y have different row counts");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "lora_products_: rows must be a contiguous 1-D int64 tensor");
  const int64_t in = x.size(1), out = y.size(1), n = rows.numel();
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && starts.back() == n,
              "lora_products_: starts must run from 0 to the number of rows");
  TORCH_CHECK(scales.size() + 1 == starts.size(), "lora_products_: one scale per group");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "lora_products_: row ", row_ids[i], " is not in x");
  int64_t low_size = 0;
  const std::vector<LoraPart> parts = lora_parts(starts, a, bt, offsets, in, out, &low_size);
  if (parts.empty()) return;

  // The rows' x in float32, in group order.
  std::vector<float> xs(n * in);
  CADENCE_DISPATCH(x.scalar_type(), "lora_products_", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) load_row(src + row_ids[i] * x.stride(0), xs.data() + i * in, in);
  });

  // One task per (group, part); tasks write disjoint (row, column) blocks of delta.
  std::vector<float> low(low_size);
  std::vector<float> delta(n * out, 0.f);
  int64_t work = 0;
  for (const LoraPart& pt : parts) work += (starts[pt.group + 1] - starts[pt.group]) * pt.rank * (in + pt.out);
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      if (k + 1 < end) lora_prefetch(parts[k + 1], in);  // the next weights, while these run
      const LoraPart& pt = parts[k];
      const int64_t first = starts[pt.group], count = starts[pt.group + 1] - first;
      const float scale = static_cast<float>(scales[pt.group]);
      float* lows = low.data() + pt.low_offset;
      if (pt.bf16)
        lora_part<c10::BFloat16>(pt, xs.data(), in, first, count, scale, lows, delta.data(), out, offsets[pt.part]);
      else
        lora_part<float>(pt, xs.data(), in, first, count, scale, lows, delta.data(), out, offsets[pt.part]);
    }
  };
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  if (work < kLoraSerialWork) body(0, num_parts);
  else at::parallel_for(0, num_parts, 1, body);

  // y[row] += delta[t], rounded once to y's dtype.
  CADENCE_DISPATCH(y.scalar_type(), "lora_products_", [&] {
    scalar_t* dst = y.data_ptr<scalar_t>();
    std::vector<float> row(out);
    for (int64_t t = 0; t < n; ++t) {
      scalar_t* yrow = dst + row_ids[t] * y.stride(0);
      load_row(yrow, row.data(), out);
      const float* d = delta.data() + t * out;
      for (int64_t c = 0; c < out; ++c) row[c] += d[c];
      store_row(row.data(), yrow, out);
    }
  });
}
