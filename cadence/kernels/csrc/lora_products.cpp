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
// rows its adapter serves. The sums are float32 and y is rounded to its dtype once: a
// float32 y takes each part's product in place (y + product, as an in-place add of the
// product rounds), any other dtype goes through a float32 copy of the rows. Every row's sums
// run in one order whatever rows share its group, so a row's result does not depend on the
// batch it is in. Small steps run on the calling thread (a thread pool's wake-up costs more
// than a decode row's products); larger ones are split between the threads by work, one
// contiguous run of (group, part) tasks each.

constexpr int64_t kLoraSerialWork = 1 << 16;  // multiply-adds below which no thread is woken

struct LoraPart {
  int64_t group, rank, out, column;
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

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 lora_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 lora_load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline float lora_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The cache lines of a matrix's rows, asked for a few at a time while other work runs: the
// B^T of a part while its A is summed, the next part's A while this one's B^T is (each part
// is a few small matrices of its own, and the hardware prefetchers start over at each).
struct LoraPrefetch {
  const char* base = nullptr;
  int64_t stride = 0, row_bytes = 0, rows = 0, row = 0, off = 0;
  LoraPrefetch() = default;
  LoraPrefetch(const void* p, int64_t stride_bytes, int64_t bytes, int64_t n)
      : base(static_cast<const char*>(p)), stride(stride_bytes), row_bytes(bytes), rows(n) {}
  int64_t lines() const { return rows * ((row_bytes + 63) / 64); }
  inline void issue(int64_t n) {
    for (; n > 0 && row < rows; --n) {
      _mm_prefetch(base + row * stride + off, _MM_HINT_T0);
      off += 64;
      if (off >= row_bytes) off = 0, ++row;
    }
  }
};

// low[t * r + j] = scale * A[j] . x_t for rank rows [j0, j0 + J) and rows [t0, t0 + T): the
// 8-lane sums over the columns, then the lanes, then the tail columns (one order per row).
template <typename W, int J, int T>
inline void lora_shrink_block(const W* a, int64_t a_stride, const float* const* xs, int64_t in, int64_t j0,
                              int64_t t0, int64_t r, float scale, float* low, LoraPrefetch* pf, int64_t pf_step) {
  __m256 acc[J][T];
  for (int q = 0; q < J; ++q)
    for (int t = 0; t < T; ++t) acc[q][t] = _mm256_setzero_ps();
  const int64_t in8 = in - in % 8;
  for (int64_t i = 0; i < in8; i += 8) {
    pf->issue(pf_step);
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(xs[t0 + t] + i);
    for (int q = 0; q < J; ++q) {
      const __m256 w = lora_load8(a + (j0 + q) * a_stride + i);
      for (int t = 0; t < T; ++t) acc[q][t] = _mm256_fmadd_ps(w, xv[t], acc[q][t]);
    }
  }
  for (int q = 0; q < J; ++q) {
    for (int t = 0; t < T; ++t) {
      float s = lora_hsum(acc[q][t]);
      for (int64_t i = in8; i < in; ++i) s += lora_weight(a[(j0 + q) * a_stride + i]) * xs[t0 + t][i];
      low[(t0 + t) * r + j0 + q] = scale * s;
    }
  }
}

template <typename W, int J>
inline void lora_shrink_rows(const W* a, int64_t a_stride, const float* const* xs, int64_t in, int64_t j0,
                             int64_t count, int64_t r, float scale, float* low, LoraPrefetch* pf, int64_t pf_step) {
  int64_t t0 = 0;
  for (; t0 + 2 <= count; t0 += 2) lora_shrink_block<W, J, 2>(a, a_stride, xs, in, j0, t0, r, scale, low, pf, pf_step);
  if (t0 < count) lora_shrink_block<W, J, 1>(a, a_stride, xs, in, j0, t0, r, scale, low, pf, pf_step);
}

// ys[t][c] += sum_j low[t * r + j] B^T[j][c] over `C` 8-column chunks from c, rows [t0, t0 + T):
// even and odd j summed apart (independent chains), then joined, then added to y once.
template <typename W, int C, int T>
inline void lora_expand_block(const W* bt, int64_t bt_stride, const float* low, int64_t r, int64_t c, int64_t t0,
                              float* const* ys) {
  __m256 acc[T][C][2];
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < C; ++k) acc[t][k][0] = acc[t][k][1] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= r; j += 2) {
    __m256 w0[C], w1[C];
    for (int k = 0; k < C; ++k) {
      w0[k] = lora_load8(bt + j * bt_stride + c + 8 * k);
      w1[k] = lora_load8(bt + (j + 1) * bt_stride + c + 8 * k);
    }
    for (int t = 0; t < T; ++t) {
      const __m256 l0 = _mm256_broadcast_ss(low + (t0 + t) * r + j);
      const __m256 l1 = _mm256_broadcast_ss(low + (t0 + t) * r + j + 1);
      for (int k = 0; k < C; ++k) {
        acc[t][k][0] = _mm256_fmadd_ps(l0, w0[k], acc[t][k][0]);
        acc[t][k][1] = _mm256_fmadd_ps(l1, w1[k], acc[t][k][1]);
      }
    }
  }
  if (j < r) {
    for (int k = 0; k < C; ++k) {
      const __m256 w = lora_load8(bt + j * bt_stride + c + 8 * k);
      for (int t = 0; t < T; ++t)
        acc[t][k][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(low + (t0 + t) * r + j), w, acc[t][k][0]);
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < C; ++k) {
      float* y = ys[t0 + t] + c + 8 * k;
      _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_add_ps(acc[t][k][0], acc[t][k][1])));
    }
  }
}

template <typename W, int C>
inline void lora_expand_rows(const W* bt, int64_t bt_stride, const float* low, int64_t r, int64_t c,
                             int64_t count, float* const* ys) {
  int64_t t0 = 0;
  for (; t0 + 2 <= count; t0 += 2) lora_expand_block<W, C, 2>(bt, bt_stride, low, r, c, t0, ys);
  if (t0 < count) lora_expand_block<W, C, 1>(bt, bt_stride, low, r, c, t0, ys);
}
#endif

// One (group, part): low[t, j] = scale * x_t . A[j], A read once for all the group's rows
// (`xs` their float32 rows); then y_t[column + c] += sum_j low[t, j] B^T[j][c] (`ys` their
// float32 rows, at column 0 of y), B^T read once for all of them.
template <typename W>
void lora_part(const LoraPart& pt, const float* const* xs, float* const* ys, int64_t in, int64_t count,
               float scale, float* low, const LoraPart* next) {
  const W* a = static_cast<const W*>(pt.a);
  const W* bt = static_cast<const W*>(pt.bt);
  const int64_t r = pt.rank, out = pt.out;
  int64_t c0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int64_t kElem = sizeof(W);
  // B^T's lines over the shrink's column steps, the next part's A's over the expand's chunks.
  LoraPrefetch pf_bt(bt, pt.bt_stride * kElem, out * kElem, r);
  // (lora_shrink_rows passes over the columns once per two token rows)
  const int64_t shrink_steps = std::max<int64_t>(1, (r / 4 + r % 4) * ((count + 1) / 2) * (in / 8));
  const int64_t bt_step = (pf_bt.lines() + shrink_steps - 1) / shrink_steps;
  int64_t j = 0;
  for (; j + 4 <= r; j += 4) lora_shrink_rows<W, 4>(a, pt.a_stride, xs, in, j, count, r, scale, low, &pf_bt, bt_step);
  for (; j < r; ++j) lora_shrink_rows<W, 1>(a, pt.a_stride, xs, in, j, count, r, scale, low, &pf_bt, bt_step);
  LoraPrefetch pf_a;
  if (next != nullptr) {
    const int64_t elem = next->bf16 ? 2 : 4;
    pf_a = LoraPrefetch(next->a, next->a_stride * elem, in * elem, next->rank);
  }
  const int64_t expand_steps = std::max<int64_t>(1, (out / 8) * ((count + 1) / 2));
  const int64_t a_step = (pf_a.lines() + expand_steps - 1) / expand_steps;
  float* cols[64];
  for (int64_t t0 = 0; t0 < count; t0 += 64) {  // y pointers at this part's first column
    const int64_t n = std::min<int64_t>(64, count - t0);
    for (int64_t t = 0; t < n; ++t) cols[t] = ys[t0 + t] + pt.column;
    const float* lw = low + t0 * r;
    int64_t c = 0;
    for (; c + 16 <= out; c += 16) {
      pf_a.issue(2 * a_step);
      lora_expand_rows<W, 2>(bt, pt.bt_stride, lw, r, c, n, cols);
    }
    for (; c + 8 <= out; c += 8) {
      pf_a.issue(a_step);
      lora_expand_rows<W, 1>(bt, pt.bt_stride, lw, r, c, n, cols);
    }
    c0 = c;
  }
#else
  (void)next;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t j = 0; j < r; ++j) {
      const W* aj = a + j * pt.a_stride;
      float s = 0.f;
      for (int64_t i = 0; i < in; ++i) s += lora_weight(aj[i]) * xs[t][i];
      low[t * r + j] = scale * s;
    }
  }
#endif
  // The columns past the last 8-column chunk (all of them without AVX2): row by row.
  if (c0 < out) {
    for (int64_t t = 0; t < count; ++t) {
      float* y = ys[t] + pt.column;
      for (int64_t c = c0; c < out; ++c) {
        float s = 0.f;
        for (int64_t j = 0; j < r; ++j) s += low[t * r + j] * lora_weight(bt[j * pt.bt_stride + c]);
        y[c] += s;
      }
    }
  }
}

// The (group, part) tasks of `groups` groups' A and B^T, checked against x's width `in` and
// y's `out` (out < 0: not yet; lora_products_table_ checks each part's end at every step).
std::vector<LoraPart> lora_parts(int64_t groups, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
                                 at::IntArrayRef offsets, int64_t in, int64_t out) {
  const int64_t parts = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(parts > 0 && static_cast<int64_t>(a.size()) == groups * parts && a.size() == bt.size(),
              "lora_products_: a and bt need one tensor per (group, part)");
  std::vector<LoraPart> found;
  for (int64_t g = 0; g < groups; ++g) {
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
                      (out < 0 || offsets[p] + bp.size(1) <= out),
                  "lora_products_: part ", p, " of group ", g, " does not fit x and y");
      found.push_back({g, ap.size(0), bp.size(1), offsets[p], ap.data_ptr(), bp.data_ptr(),
                       ap.stride(0), bp.stride(0), bf16});
    }
  }
  return found;
}

// The checks of a step's rows; returns row ids.
const int64_t* lora_check_step(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                               at::IntArrayRef starts, at::ArrayRef<double> scales) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(x.size(0) == y.size(0), "lora_products_: x and y have different row counts");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "lora_products_: rows must be a contiguous 1-D int64 tensor");
  const int64_t n = rows.numel();
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && starts.back() == n,
              "lora_products_: starts must run from 0 to the number of rows");
  for (size_t g = 0; g + 1 < starts.size(); ++g)
    TORCH_CHECK(starts[g] <= starts[g + 1], "lora_products_: starts must not decrease");
  TORCH_CHECK(scales.size() + 1 == starts.size(), "lora_products_: one scale per group");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "lora_products_: row ", row_ids[i], " is not in x");
  return row_ids;
}

// Rows `row_ids` of t [*, width] as float32 rows: t's own where t is float32, else copies
// made in `copy`.
std::vector<float*> lora_float_rows(const at::Tensor& t, const int64_t* row_ids, int64_t n, std::vector<float>* copy) {
  std::vector<float*> rows(n);
  const int64_t width = t.size(1), stride = t.stride(0);
  if (t.scalar_type() == at::kFloat) {
    for (int64_t i = 0; i < n; ++i) rows[i] = t.data_ptr<float>() + row_ids[i] * stride;
    return rows;
  }
  copy->resize(n * width);
  CADENCE_DISPATCH(t.scalar_type(), "lora_products_", [&] {
    const scalar_t* src = t.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) load_row(src + row_ids[i] * stride, copy->data() + i * width, width);
  });
  for (int64_t i = 0; i < n; ++i) rows[i] = copy->data() + i * width;
  return rows;
}

void lora_run(at::Tensor& y, const at::Tensor& x, const int64_t* row_ids, at::IntArrayRef starts,
              at::ArrayRef<double> scales, const std::vector<LoraPart>& parts) {
  if (parts.empty()) return;
  const int64_t in = x.size(1), out = y.size(1), n = starts.back();

  // The rows in group order, as float32 rows: x's and y's own where they are float32 (y then
  // takes the products in place), else copies (y's written back, rounded once, at the end).
  std::vector<float> x_copy, y_copy;
  const std::vector<float*> xs = lora_float_rows(x, row_ids, n, &x_copy);
  const std::vector<float*> ys = lora_float_rows(y, row_ids, n, &y_copy);
  const bool y_float = y.scalar_type() == at::kFloat;

  // Tasks (group, part) write disjoint (row, column) blocks of y. Each thread takes one
  // contiguous run of them holding about its share of the multiply-adds.
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  std::vector<int64_t> work_before(num_parts + 1, 0);
  int64_t max_low = 0;
  for (int64_t k = 0; k < num_parts; ++k) {
    const LoraPart& pt = parts[k];
    const int64_t count = starts[pt.group + 1] - starts[pt.group];
    work_before[k + 1] = work_before[k] + std::max<int64_t>(count, 1) * pt.rank * (in + pt.out);
    max_low = std::max(max_low, count * pt.rank);
  }
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> low(max_low);
    for (int64_t k = begin; k < end; ++k) {
      const LoraPart& pt = parts[k];
      const int64_t first = starts[pt.group], count = starts[pt.group + 1] - first;
      if (count == 0) continue;
      const float scale = static_cast<float>(scales[pt.group]);
      const LoraPart* next = k + 1 < end ? &parts[k + 1] : nullptr;
      if (pt.bf16)
        lora_part<c10::BFloat16>(pt, xs.data() + first, ys.data() + first, in, count, scale, low.data(), next);
      else
        lora_part<float>(pt, xs.data() + first, ys.data() + first, in, count, scale, low.data(), next);
    }
  };
  const int64_t work = work_before[num_parts];
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_parts);
  if (work < kLoraSerialWork || threads <= 1) {
    run(0, num_parts);
  } else {
    std::vector<int64_t> bounds(threads + 1, num_parts);
    bounds[0] = 0;
    for (int64_t th = 1; th < threads; ++th) {  // the first task past th / threads of the work
      const int64_t target = work * th / threads;
      bounds[th] = std::lower_bound(work_before.begin(), work_before.end(), target) - work_before.begin();
    }
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t th = begin; th < end; ++th) run(bounds[th], bounds[th + 1]);
    });
  }

  if (!y_float) {
    CADENCE_DISPATCH(y.scalar_type(), "lora_products_", [&] {
      scalar_t* dst = y.data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) store_row(y_copy.data() + i * out, dst + row_ids[i] * y.stride(0), out);
    });
  }
}

void lora_products_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, at::IntArrayRef starts,
                    at::ArrayRef<double> scales, const std::vector<at::Tensor>& a,
                    const std::vector<at::Tensor>& bt, at::IntArrayRef offsets) {
  const int64_t* row_ids = lora_check_step(y, x, rows, starts, scales);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  lora_run(y, x, row_ids, starts, scales, lora_parts(groups, a, bt, offsets, x.size(1), y.size(1)));
}

// A projection's tasks for a batch of adapters, checked once and kept as a table of int64
// rows (kTableColumns each: group, rank, in, out_p, column, A's and B^T's addresses and row
// strides, bfloat16 or not): lora_products_table_ then reads one small tensor per call, not
// two per adapter and part (a decode step makes ~120 such calls, and the tensors' own
// records are out of the cache by then). The table holds addresses: whoever keeps it keeps
// the tensors it was made from.
constexpr int64_t kTableColumns = 10;

at::Tensor lora_table(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt, at::IntArrayRef offsets) {
  const int64_t parts = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(parts > 0 && !a.empty() && a[0].dim() == 2, "lora_table: a needs one [r, in] matrix per (group, part)");
  const std::vector<LoraPart> found = lora_parts(static_cast<int64_t>(a.size()) / parts, a, bt, offsets, a[0].size(1), -1);
  at::Tensor table = at::empty({static_cast<int64_t>(found.size()), kTableColumns}, at::kLong);
  int64_t* t = table.data_ptr<int64_t>();
  for (const LoraPart& pt : found) {
    const int64_t row[kTableColumns] = {pt.group, pt.rank, a[0].size(1), pt.out, pt.column,
                                        reinterpret_cast<int64_t>(pt.a), reinterpret_cast<int64_t>(pt.bt),
                                        pt.a_stride, pt.bt_stride, pt.bf16 ? 1 : 0};
    std::copy(row, row + kTableColumns, t);
    t += kTableColumns;
  }
  return table;
}

void lora_products_table_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, at::IntArrayRef starts,
                          at::ArrayRef<double> scales, const at::Tensor& table) {
  const int64_t* row_ids = lora_check_step(y, x, rows, starts, scales);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == kTableColumns &&
                  table.is_contiguous() && table.is_cpu(),
              "lora_products_table_: table must come from lora_table");
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  std::vector<LoraPart> parts(table.size(0));
  const int64_t* t = table.data_ptr<int64_t>();
  for (LoraPart& pt : parts) {
    TORCH_CHECK(t[0] >= 0 && t[0] < groups && t[2] == x.size(1) && t[4] + t[3] <= y.size(1),
                "lora_products_table_: the table's part for group ", t[0], " does not fit x, y and the groups");
    pt = {t[0], t[1], t[3], t[4], reinterpret_cast<const void*>(t[5]), reinterpret_cast<const void*>(t[6]),
          t[7], t[8], t[9] != 0};
    t += kTableColumns;
  }
  lora_run(y, x, row_ids, starts, scales, parts);
}
