// What host code shares with the kernels and with `cookbook explain`: the hardware sizes both
// name, the dtypes' names, and Description, the `key=value` lines a tuned kernel's plan for one
// call is told in. Plain C++ (no CUDA or torch header), so an op's host policy (<op>/policy.h)
// compiles with the host compiler alone, on a machine without the CUDA toolkit.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "include/dtype.h"

namespace cookbook {

constexpr int kWarpSize = 32;
constexpr int kVecBytes = 16;  // widest plain load/store per thread (LDG.128 / STG.128)

constexpr int element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// The storage type of a dtype as the compiler names it in a kernel's template arguments.
constexpr const char* storage_name(DType dtype) {
  return dtype == DType::kFloat32 ? "float" : dtype == DType::kFloat16 ? "__half" : "__nv_bfloat16";
}

constexpr const char* rounding_name(Rounding rounding) {
  return rounding == Rounding::kFused ? "Rounding::kFused" : "Rounding::kHf";
}

// One fact per line, `key=value`: what `cookbook.explain` reads back, on a GPU (through the tuned
// extension's explain op) and off one (through the same policy compiled for the host).
struct Description {
  std::string text;

  Description& add(const char* key, const std::string& value) {
    text += key;
    text += '=';
    text += value;
    text += '\n';
    return *this;
  }
  Description& add(const char* key, const char* value) { return add(key, std::string(value)); }
  Description& add(const char* key, bool value) { return add(key, value ? "true" : "false"); }
  template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>>>
  Description& add(const char* key, Int value) {
    return add(key, std::to_string(value));
  }
};

}  // namespace cookbook
