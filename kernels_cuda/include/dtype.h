// The activation dtypes and the rounding orders, as host code and bindings name them. Plain C++
// (no device code), so a binding compiled by the host compiler alone can include it.
#pragma once

namespace cookbook {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Where the result is rounded to the activation dtype: once at the end (kFused: FlashInfer,
// SGLang, TensorRT-LLM), or in Hugging Face's order, round(round(x * rstd) * round(w)) (kHf).
enum class Rounding : int { kFused = 0, kHf = 1 };

}  // namespace cookbook
