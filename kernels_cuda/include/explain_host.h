// `cookbook explain` without a GPU: what a host program around an op's policy (<op>/policy.h)
// needs to answer for one call. It reads the call and the GPU from standard input, one
// `key=value` per line, and the kernels' resources from nvcc's report, one per line:
//   kernel <function> <template values, comma-separated> <registers> <static shared bytes>
// and gives the policy a kernel's resident blocks per SM through CUDA's occupancy calculator
// (cuda_occupancy.h: the calculation the driver's occupancy query makes, in a header). Host only:
// compiled by the host compiler with the CUDA toolkit's include folder, run on any machine.
#pragma once

#include <cuda_occupancy.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "include/dtype.h"

namespace cookbook {

struct KernelResources {
  int registers = 0;
  int shared_bytes = 0;
};

class HostInput {
 public:
  explicit HostInput(std::istream& in) {
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("kernel ", 0) == 0) {
        std::istringstream words(line.substr(7));
        std::string function, values;
        KernelResources resources;
        words >> function >> values >> resources.registers >> resources.shared_bytes;
        kernels_[function + " " + values] = resources;
      } else if (const auto eq = line.find('='); eq != std::string::npos) {
        values_[line.substr(0, eq)] = line.substr(eq + 1);
      }
    }
  }

  const std::string& text(const std::string& key) const {
    const auto found = values_.find(key);
    if (found == values_.end()) fail("missing input " + key);
    return found->second;
  }
  int64_t integer(const std::string& key) const { return std::stoll(text(key)); }
  bool flag(const std::string& key) const { return text(key) == "true"; }
  DType dtype(const std::string& key) const { return static_cast<DType>(integer(key)); }
  Rounding rounding(const std::string& key) const { return static_cast<Rounding>(integer(key)); }

  // The GPU, as the driver describes it (cudaDeviceProp's fields of the same names).
  cudaOccDeviceProp gpu() const {
    cudaOccDeviceProp gpu;
    gpu.computeMajor = static_cast<int>(integer("gpu.major"));
    gpu.computeMinor = static_cast<int>(integer("gpu.minor"));
    gpu.maxThreadsPerBlock = static_cast<int>(integer("gpu.max_threads_per_block"));
    gpu.maxThreadsPerMultiprocessor = static_cast<int>(integer("gpu.max_threads_per_sm"));
    gpu.regsPerBlock = static_cast<int>(integer("gpu.registers_per_block"));
    gpu.regsPerMultiprocessor = static_cast<int>(integer("gpu.registers_per_sm"));
    gpu.warpSize = static_cast<int>(integer("gpu.warp_size"));
    gpu.sharedMemPerBlock = static_cast<size_t>(integer("gpu.shared_bytes_per_block"));
    gpu.sharedMemPerMultiprocessor = static_cast<size_t>(integer("gpu.shared_bytes_per_sm"));
    gpu.numSms = static_cast<int>(integer("gpu.sms"));
    gpu.sharedMemPerBlockOptin = static_cast<size_t>(integer("gpu.shared_bytes_per_block_optin"));
    gpu.reservedSharedMemPerBlock = static_cast<size_t>(integer("gpu.reserved_shared_bytes_per_block"));
    return gpu;
  }
  int sms() const { return static_cast<int>(integer("gpu.sms")); }

  const KernelResources& resources(const std::string& function, const std::string& values) const {
    const auto found = kernels_.find(function + " " + values);
    if (found == kernels_.end()) fail("nvcc's report has no kernel " + function + "<" + values + ">");
    return found->second;
  }

  // Resident blocks per SM of `function<values>` launched with `block` threads and
  // `dynamic_shared_bytes` (what cudaOccupancyMaxActiveBlocksPerMultiprocessor answers on a GPU).
  int blocks_per_sm(const std::string& function, const std::string& values, int block, int dynamic_shared_bytes = 0) const {
    const KernelResources& kernel = resources(function, values);
    cudaOccFuncAttributes attributes;
    attributes.maxThreadsPerBlock = block;  // __launch_bounds__ never below the block it launches with
    attributes.numRegs = kernel.registers;
    attributes.sharedSizeBytes = static_cast<size_t>(kernel.shared_bytes);
    attributes.partitionedGCConfig = PARTITIONED_GC_OFF;
    attributes.shmemLimitConfig = FUNC_SHMEM_LIMIT_DEFAULT;
    attributes.maxDynamicSharedSizeBytes = static_cast<size_t>(dynamic_shared_bytes);
    attributes.numBlockBarriers = 1;
    const cudaOccDeviceProp device = gpu();
    const cudaOccDeviceState state;
    cudaOccResult result{};
    if (cudaOccMaxActiveBlocksPerMultiprocessor(&result, &device, &attributes, &state, block,
                                                static_cast<size_t>(dynamic_shared_bytes)) != CUDA_OCC_SUCCESS) {
      fail("the occupancy calculator refused " + function + "<" + values + ">");
    }
    return result.activeBlocksPerMultiprocessor;
  }

  [[noreturn]] static void fail(const std::string& why) {
    std::cout << "error=" << why << "\n";
    std::exit(2);
  }

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, KernelResources> kernels_;
};

}  // namespace cookbook
