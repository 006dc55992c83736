#include "loom/io.h"

namespace loom {

namespace {
constexpr struct {
  DType dtype;
  const char* tag;
} kTags[] = {
    {DType::f32, "F32"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},
    {DType::i32, "I32"}, {DType::i64, "I64"},   {DType::u8, "U8"}, {DType::i8, "I8"},
};
}  // namespace

const char* safetensors_dtype_name(DType dt) {
  for (const auto& t : kTags)
    if (t.dtype == dt) return t.tag;
  LOOM_CHECK(false, "dtype ", static_cast<int>(dt), " has no safetensors tag");
  return "";
}

DType parse_safetensors_dtype(std::string_view tag) {
  for (const auto& t : kTags)
    if (t.tag == tag) return t.dtype;
  throw Error(str("unsupported safetensors dtype '", tag, "': loom reads F32, BF16, F16, I32, I64, U8 and I8"));
}

}  // namespace loom
