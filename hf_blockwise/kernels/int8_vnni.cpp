// int8 x int8 -> int32 matrix products with AVX-512 VNNI on weights packed once (hf_blockwise.kernels.int8).
//
// Why: torch._int_mm on CPU calls oneDNN's s8s8s32 GEMM with unpacked weights, which reorders the weight and sums its
// columns again in every call: 14-23 us for a 512x512 product of a few rows on a 2-core Zen 4 (8-12 us here). Here
// the weight is laid out once for `vpdpbusd` (16 output columns x 4 inputs per 64 bytes) and its column sums are
// kept, so a call only streams it.
//
// Exactness: `vpdpbusd` multiplies unsigned by signed bytes and adds four products to an int32 without saturation.
// An int8 row r is fed as r + 128 (a flipped sign bit) and 128 * sum_k w[k][n] is subtracted at the end, so every
// output is sum_k r[k] * w[k][n] in exact int32 arithmetic: the same integers as torch._int_mm, whatever the
// blocking. The running sums stay below 255 * 128 * in_features, which fits an int32 for in_features <=
// kMaxFeatures (the operator refuses more).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kColumns = 64;  // output columns of one packed block: four 16-lane int32 accumulators a row
constexpr int64_t kBlockBytes = kColumns * 4;  // one step of the reduction: 64 columns x 4 inputs
constexpr int64_t kMaxFeatures = 65536;  // 255 * 128 * 65536 < 2^31: no int32 sum can wrap

bool vnni_available() {
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vnni");
  return available;
}

// out[r][c] = sum_k rows[r][k] * w[k][c] for Rows rows and the `columns` (<= 64) columns of one packed block.
template <int Rows>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_product(
    const int8_t* rows, int64_t row_stride, const int8_t* block, int64_t steps, const int32_t* offsets,
    int32_t* out, int64_t out_stride, int64_t columns) {
  __m512i sums[Rows][4];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_setzero_si512();
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t step = 0; step < steps; ++step) {
    const int8_t* weights = block + step * kBlockBytes;
    const __m512i w0 = _mm512_loadu_si512(weights);
    const __m512i w1 = _mm512_loadu_si512(weights + 64);
    const __m512i w2 = _mm512_loadu_si512(weights + 128);
    const __m512i w3 = _mm512_loadu_si512(weights + 192);
    for (int r = 0; r < Rows; ++r) {
      int32_t quad;  // four inputs of row r
      std::memcpy(&quad, rows + r * row_stride + 4 * step, 4);
      const __m512i inputs = _mm512_xor_si512(_mm512_set1_epi32(quad), sign);  // int8 x -> uint8 x + 128
      sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], inputs, w0);
      sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], inputs, w1);
      sums[r][2] = _mm512_dpbusd_epi32(sums[r][2], inputs, w2);
      sums[r][3] = _mm512_dpbusd_epi32(sums[r][3], inputs, w3);
    }
  }
  for (int j = 0; j < 4 && 16 * j < columns; ++j) {
    const int64_t left = columns - 16 * j;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512i offset = _mm512_loadu_si512(offsets + 16 * j);  // 128 * the column sums
    for (int r = 0; r < Rows; ++r)
      _mm512_mask_storeu_epi32(out + r * out_stride + 16 * j, mask, _mm512_sub_epi32(sums[r][j], offset));
  }
}

using BlockProduct = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, const int32_t*, int32_t*, int64_t,
                              int64_t);
constexpr BlockProduct kBlockProducts[5] = {nullptr, block_product<1>, block_product<2>, block_product<3>,
                                            block_product<4>};

// rows (N, in) int8 times a packed weight (blocks, in / 4, 64, 4) int8 -> (N, out_features) int32.
at::Tensor int8_mm(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& offsets,
                   int64_t out_features) {
  TORCH_CHECK(vnni_available(), "hf_blockwise::int8_mm needs a CPU with AVX-512 VNNI");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kChar, "hf_blockwise::int8_mm: rows must be 2-D int8");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kColumns && packed.size(3) == 4 &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "hf_blockwise::int8_mm: the weight must be packed as (blocks, in / 4, 64, 4) int8, contiguous");
  TORCH_CHECK(rows.size(1) == 4 * packed.size(1), "hf_blockwise::int8_mm: rows of ", rows.size(1),
              " features against a weight of ", 4 * packed.size(1));
  TORCH_CHECK(rows.size(1) <= kMaxFeatures, "hf_blockwise::int8_mm: ", rows.size(1), " features; at most ",
              kMaxFeatures, " keep its int32 sums exact");
  TORCH_CHECK(out_features > kColumns * (packed.size(0) - 1) && out_features <= kColumns * packed.size(0),
              "hf_blockwise::int8_mm: ", out_features, " outputs do not fit ", packed.size(0), " blocks");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() &&
                  offsets.numel() == kColumns * packed.size(0),
              "hf_blockwise::int8_mm: offsets must be int32, one per packed column");
  const at::Tensor inputs = rows.contiguous();
  const int64_t count = inputs.size(0), features = inputs.size(1), blocks = packed.size(0);
  const int64_t steps = packed.size(1);
  at::Tensor out = at::empty({count, out_features}, inputs.options().dtype(at::kInt));
  const int8_t* row_data = inputs.data_ptr<int8_t>();
  const int8_t* weight_data = packed.data_ptr<int8_t>();
  const int32_t* offset_data = offsets.data_ptr<int32_t>();
  int32_t* out_data = out.data_ptr<int32_t>();
  // threads take column blocks: each streams its own part of the weight once per four rows
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t column = block * kColumns;
      const int64_t columns = std::min(kColumns, out_features - column);
      for (int64_t row = 0; row < count; row += 4) {
        const int64_t taken = std::min<int64_t>(4, count - row);
        kBlockProducts[taken](row_data + row * features, features, weight_data + block * steps * kBlockBytes, steps,
                              offset_data + column, out_data + row * out_features + column, out_features, columns);
      }
    }
  });
  return out;
}

// Each row of `inputs` (count, features) quantized as hf_blockwise.quantization.int8_linear does it with torch
// operations, step by step in the same float32 arithmetic: its largest magnitude (a maximum: exact; NaN where the row
// holds one, as torch's norm gives, so that the row's outputs are NaN there too), clamped to FLT_MIN, divided by 127
// (IEEE division); each input divided by that scale, rounded half to even and cast (exact).
__attribute__((target("avx512f,avx512bw"))) void quantize_rows(const float* inputs, int64_t count, int64_t features,
                                                                int8_t* rows, float* scales) {
  for (int64_t r = 0; r < count; ++r) {
    const float* x = inputs + r * features;
    __m512 largest = _mm512_setzero_ps();
    __mmask16 unordered = 0;  // lanes that met a NaN (`max` would drop it)
    int64_t k = 0;
    for (; k + 16 <= features; k += 16) {
      const __m512 values = _mm512_loadu_ps(x + k);
      unordered |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(values));
    }
    float amax = _mm512_reduce_max_ps(largest);
    bool nan = unordered != 0;
    for (; k < features; ++k) {
      nan = nan || std::isnan(x[k]);
      amax = std::max(amax, std::fabs(x[k]));
    }
    if (nan) amax = std::numeric_limits<float>::quiet_NaN();
    // std::max keeps its first argument when they are unordered: a NaN stays NaN, as clamp_ keeps it
    const float scale = std::max(amax, std::numeric_limits<float>::min()) / 127.0f;
    scales[r] = scale;
    const __m512 divisor = _mm512_set1_ps(scale);
    int8_t* out = rows + r * features;
    for (k = 0; k + 16 <= features; k += 16) {
      const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), divisor),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rounded)));
    }
    for (; k < features; ++k) out[k] = static_cast<int8_t>(std::nearbyint(x[k] / scale));
  }
}

// `int8_linear`'s eager path in one call: the rows quantized (quantize_rows), multiplied by the packed weight in
// exact int32 (block_product), then each sum converted to float32 and multiplied by (row scale x column scale) and
// the bias added: the operations and their order of the torch code, each correctly rounded, with no contraction into
// fused multiply-adds (the library is built with -ffp-contract=off), so its outputs are those bits.
at::Tensor int8_linear(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& offsets,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(vnni_available(), "hf_blockwise::int8_linear needs a CPU with AVX-512 VNNI");
  TORCH_CHECK(inputs.dim() == 2 && inputs.scalar_type() == at::kFloat,
              "hf_blockwise::int8_linear: inputs must be 2-D float32");
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.scalar_type() == at::kFloat,
              "hf_blockwise::int8_linear: weight_scale must be a 1-D float32 tensor");
  const int64_t out_features = weight_scale.size(0);
  TORCH_CHECK(!bias.has_value() ||
                  (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == out_features),
              "hf_blockwise::int8_linear: bias must be a float32 tensor of ", out_features, " values");
  const at::Tensor x = inputs.contiguous(), column_scale = weight_scale.contiguous();
  const std::optional<at::Tensor> bias_values =
      bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  const int64_t count = x.size(0), features = x.size(1);
  at::Tensor rows = at::empty({count, features}, x.options().dtype(at::kChar));
  std::vector<float> scales(count);
  if (count > 0) quantize_rows(x.data_ptr<float>(), count, features, rows.data_ptr<int8_t>(), scales.data());
  const at::Tensor sums = int8_mm(rows, packed, offsets, out_features);  // checks the weight's layout
  at::Tensor out = at::empty({count, out_features}, x.options());
  const int32_t* sum_data = sums.data_ptr<int32_t>();
  const float* column_scales = column_scale.data_ptr<float>();
  const float* bias_data = bias_values.has_value() ? bias_values->data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t c = 0; c < out_features; ++c) {
      const float factor = scales[r] * column_scales[c];
      float value = static_cast<float>(sum_data[r * out_features + c]) * factor;
      if (bias_data != nullptr) value = value + bias_data[c];
      out_data[r * out_features + c] = value;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(hf_blockwise, m) {
  m.def("int8_mm(Tensor rows, Tensor packed, Tensor offsets, int out_features) -> Tensor");
  m.def("int8_linear(Tensor inputs, Tensor packed, Tensor offsets, Tensor weight_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_blockwise, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_linear", &int8_linear);
}
