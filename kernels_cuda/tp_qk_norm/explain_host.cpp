// `cookbook explain tp_qk_norm` without a GPU: the tuned kernel's host policy (policy.h), compiled
// for the host, answering for one chunk of a call on standard input (include/explain_host.h says
// the format; the call's keys are Call's fields: the world size, the chunk's tokens, the shard
// widths). A persistent kernel's resident CTAs per SM come from CUDA's occupancy calculator, as the
// launcher asks the driver (no dynamic shared memory: the walk's is static).
#include "include/explain_host.h"
#include "tp_qk_norm/policy.h"

int main() {
  using namespace cookbook::tp_qk_norm::tuned;
  const cookbook::HostInput in(std::cin);
  const Call call{in.dtype("dtype"),
                  in.rounding("rounding"),
                  static_cast<int>(in.integer("world")),
                  in.integer("num_tokens"),
                  static_cast<int>(in.integer("q_hidden")),
                  static_cast<int>(in.integer("k_hidden")),
                  in.flag("vector_aligned")};
  const Plan chosen = plan(call, in.sms(), [&](const Kernel& kernel) {
    return in.blocks_per_sm(kernel_function(kernel), template_values(kernel), kernel.block);
  });
  std::cout << describe(chosen);
  std::cout << "registers=" << in.resources(kernel_function(chosen.kernel), template_values(chosen.kernel)).registers << "\n";
  return 0;
}
