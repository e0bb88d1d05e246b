// The quantized projections' one translation unit. Their sources stay split by concern
// (layout, repack, products, registration), but the torch headers they share take most of a
// build's time (~14 s each), so they are compiled together, once.
#include "quant_repack.cpp"
#include "quant_products.cpp"
#include "quant_registration.cpp"
