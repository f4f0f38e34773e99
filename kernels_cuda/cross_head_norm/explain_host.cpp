// `cookbook explain cross_head_norm` without a GPU: the tuned kernel's host policy (policy.h),
// compiled for the host, answering for the call on standard input (include/explain_host.h says the
// format). The staged kernel's room for a row is the GPU's per-CTA shared memory opt-in limit less
// the kernel's static shared memory (from nvcc's report), on sm_90 and later, as the launcher asks
// the driver.
#include "cross_head_norm/policy.h"
#include "include/explain_host.h"

int main() {
  using namespace cookbook::cross_head_norm::tuned;
  const cookbook::HostInput in(std::cin);
  const cookbook::DType dtype = in.dtype("dtype");
  const cookbook::Rounding rounding = in.rounding("rounding");
  Kernel staged{KernelName::kStagedRow, dtype, rounding};
  const int64_t staged_room = in.integer("gpu.shared_bytes_per_block_optin") -
                              in.resources(kernel_function(staged), template_values(staged)).shared_bytes;
  const Call call{dtype,
                  rounding,
                  in.integer("num_tokens"),
                  static_cast<int>(in.integer("q_hidden")),
                  static_cast<int>(in.integer("k_hidden")),
                  in.flag("rows_are_vectors"),
                  in.flag("weights_are_vectors"),
                  in.flag("rows_share_token_stride"),
                  in.integer("gpu.major") >= 9 ? staged_room : 0};
  const Plan chosen = plan(call, in.sms(), [&](const Kernel& kernel) {
    return in.blocks_per_sm(kernel_function(kernel), template_values(kernel), kernel.block);
  });
  std::cout << describe(chosen);
  if (chosen.rows > 0) {
    std::cout << "registers=" << in.resources(kernel_function(chosen.kernel), template_values(chosen.kernel)).registers << "\n";
  }
  return 0;
}
