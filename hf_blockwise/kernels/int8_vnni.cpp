// int8 x int8 -> int32 matrix products on weights packed once (hf_blockwise.kernels.int8): with AVX-512 VNNI, and
// with AVX2 on the same packed layout (the same integers).
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
//
// AVX2 (no VNNI: AMD Zen 3, Intel client CPUs before AVX-VNNI): the same packed bytes are sign-extended to int16 and
// multiplied by the row's int8 inputs, also sign-extended (`vpmaddwd`: two int16 products summed into an int32, each
// at most 128 * 128 in magnitude), and summed in int32. No offset is needed (the inputs stay signed) and every sum
// stays below 128 * 128 * in_features <= 2^30: the same exact integers again.
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

bool avx2_available() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}

// block_product's sums with AVX2, for Rows (<= 2) rows: the block's 64 columns in four quarters of 16, each quarter
// held in four accumulators of 4 columns x 2 partial sums (13 of the 16 ymm registers at two rows).
template <int Rows>
__attribute__((target("avx2"))) void block_product_avx2(const int8_t* rows, int64_t row_stride, const int8_t* block,
                                                         int64_t steps, const int32_t* /*offsets*/, int32_t* out,
                                                         int64_t out_stride, int64_t columns) {
  for (int64_t quarter = 0; quarter < 4 && 16 * quarter < columns; ++quarter) {
    __m256i sums[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < 4; ++j) sums[r][j] = _mm256_setzero_si256();
    for (int64_t step = 0; step < steps; ++step) {
      const int8_t* weights = block + step * kBlockBytes + 64 * quarter;  // 16 columns x 4 inputs
      __m256i w[4];  // 4 columns x 4 inputs each, as int16
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(weights + 16 * j)));
      for (int r = 0; r < Rows; ++r) {
        int32_t quad;  // four inputs of row r, repeated for the four columns
        std::memcpy(&quad, rows + r * row_stride + 4 * step, 4);
        const __m256i inputs = _mm256_cvtepi8_epi16(_mm_set1_epi32(quad));
        for (int j = 0; j < 4; ++j) sums[r][j] = _mm256_add_epi32(sums[r][j], _mm256_madd_epi16(w[j], inputs));
      }
    }
    for (int r = 0; r < Rows; ++r) {
      for (int j = 0; j < 4; ++j) {
        alignas(32) int32_t pairs[8];  // (column, half) pairs of 4 columns
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), sums[r][j]);
        for (int c = 0; c < 4; ++c) {
          const int64_t column = 16 * quarter + 4 * j + c;
          if (column < columns) out[r * out_stride + column] = pairs[2 * c] + pairs[2 * c + 1];
        }
      }
    }
  }
}

constexpr BlockProduct kBlockProductsAvx2[3] = {nullptr, block_product_avx2<1>, block_product_avx2<2>};

// The kernels of one instruction set: a block product for 1..max_rows rows (index = rows), and the rows' quantization.
struct Kernels {
  const char* name;
  bool (*supported)();
  const BlockProduct* products;
  int64_t max_rows;
  void (*quantize)(const float*, int64_t, int64_t, int8_t*, float*);
};

void check_mm(const Kernels& kernels, const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& offsets,
              int64_t out_features) {
  TORCH_CHECK(kernels.supported(), "hf_blockwise::int8_mm: this CPU has no ", kernels.name);
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
}

// rows (N, in) int8 times a packed weight (blocks, in / 4, 64, 4) int8 -> (N, out_features) int32.
at::Tensor packed_mm(const Kernels& kernels, const at::Tensor& rows, const at::Tensor& packed,
                     const at::Tensor& offsets, int64_t out_features) {
  check_mm(kernels, rows, packed, offsets, out_features);
  const at::Tensor inputs = rows.contiguous();
  const int64_t count = inputs.size(0), features = inputs.size(1), blocks = packed.size(0);
  const int64_t steps = packed.size(1);
  at::Tensor out = at::empty({count, out_features}, inputs.options().dtype(at::kInt));
  const int8_t* row_data = inputs.data_ptr<int8_t>();
  const int8_t* weight_data = packed.data_ptr<int8_t>();
  const int32_t* offset_data = offsets.data_ptr<int32_t>();
  int32_t* out_data = out.data_ptr<int32_t>();
  // threads take column blocks: each streams its own part of the weight once per `max_rows` rows
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t column = block * kColumns;
      const int64_t columns = std::min(kColumns, out_features - column);
      for (int64_t row = 0; row < count; row += kernels.max_rows) {
        const int64_t taken = std::min<int64_t>(kernels.max_rows, count - row);
        kernels.products[taken](row_data + row * features, features, weight_data + block * steps * kBlockBytes,
                                steps, offset_data + column, out_data + row * out_features + column, out_features,
                                columns);
      }
    }
  });
  return out;
}

// Each row of `inputs` (count, features) quantized as hf_blockwise.quantization.int8_linear does it with torch
// operations, step by step in the same float32 arithmetic: its largest magnitude (a maximum: exact; NaN where the row
// holds one, as torch's norm gives, so that the row's outputs are NaN there too), clamped to FLT_MIN, divided by 127
// (IEEE division); each input divided by that scale, rounded half to even and cast (exact).
__attribute__((target("avx512f,avx512bw"))) void quantize_rows_avx512(const float* inputs, int64_t count,
                                                                       int64_t features, int8_t* rows, float* scales) {
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

// quantize_rows_avx512's steps one value at a time (the same operations, so the same bytes and scales).
void quantize_rows_scalar(const float* inputs, int64_t count, int64_t features, int8_t* rows, float* scales) {
  for (int64_t r = 0; r < count; ++r) {
    const float* x = inputs + r * features;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t k = 0; k < features; ++k) {
      nan = nan || std::isnan(x[k]);
      amax = std::max(amax, std::fabs(x[k]));
    }
    if (nan) amax = std::numeric_limits<float>::quiet_NaN();
    const float scale = std::max(amax, std::numeric_limits<float>::min()) / 127.0f;
    scales[r] = scale;
    for (int64_t k = 0; k < features; ++k) rows[r * features + k] = static_cast<int8_t>(std::nearbyint(x[k] / scale));
  }
}

const Kernels kVnni{"AVX-512 VNNI", vnni_available, kBlockProducts, 4, quantize_rows_avx512};
const Kernels kAvx2{"AVX2", avx2_available, kBlockProductsAvx2, 2, quantize_rows_scalar};

// `int8_linear`'s eager path in one call: the rows quantized (quantize_rows), multiplied by the packed weight in
// exact int32 (block_product), then each sum converted to float32 and multiplied by (row scale x column scale) and
// the bias added: the operations and their order of the torch code, each correctly rounded, with no contraction into
// fused multiply-adds (the library is built with -ffp-contract=off), so its outputs are those bits.
at::Tensor packed_linear(const Kernels& kernels, const at::Tensor& inputs, const at::Tensor& packed,
                         const at::Tensor& offsets, const at::Tensor& weight_scale,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kernels.supported(), "hf_blockwise::int8_linear: this CPU has no ", kernels.name);
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
  if (count > 0) kernels.quantize(x.data_ptr<float>(), count, features, rows.data_ptr<int8_t>(), scales.data());
  const at::Tensor sums = packed_mm(kernels, rows, packed, offsets, out_features);  // checks the weight's layout
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

at::Tensor int8_mm(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& offsets, int64_t out_features) {
  return packed_mm(kVnni, rows, packed, offsets, out_features);
}

at::Tensor int8_mm_avx2(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& offsets,
                        int64_t out_features) {
  return packed_mm(kAvx2, rows, packed, offsets, out_features);
}

at::Tensor int8_linear(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& offsets,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  return packed_linear(kVnni, inputs, packed, offsets, weight_scale, bias);
}

at::Tensor int8_linear_avx2(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& offsets,
                            const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  return packed_linear(kAvx2, inputs, packed, offsets, weight_scale, bias);
}

}  // namespace

TORCH_LIBRARY(hf_blockwise, m) {
  m.def("int8_mm(Tensor rows, Tensor packed, Tensor offsets, int out_features) -> Tensor");
  m.def("int8_linear(Tensor inputs, Tensor packed, Tensor offsets, Tensor weight_scale, Tensor? bias) -> Tensor");
  m.def("int8_mm_avx2(Tensor rows, Tensor packed, Tensor offsets, int out_features) -> Tensor");
  m.def("int8_linear_avx2(Tensor inputs, Tensor packed, Tensor offsets, Tensor weight_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_blockwise, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_mm_avx2", &int8_mm_avx2);
  m.impl("int8_linear_avx2", &int8_linear_avx2);
}
