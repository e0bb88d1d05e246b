// torch.ops.cadence.quant_*: the schema and CPU implementation of each quantized op.

#include <torch/library.h>

#include "quant_layout.h"

using namespace cadence_quant;

TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("quant_repack(Tensor raw, int qtype, int k) -> Tensor");
  m.def("quant_dequantize(Tensor packed, int qtype, int rows, int k, Tensor? row_ids=None) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, int qtype, int rows, int k, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
  m.def("quant_linear_portable(Tensor x, Tensor packed, int qtype, int rows, int k, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
  m.def("quant_isa() -> str", &quant_isa);
}

TORCH_LIBRARY_IMPL(cadence, CPU, m) {
  m.impl("quant_repack", &quant_repack);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_portable", &quant_linear_portable);
}
