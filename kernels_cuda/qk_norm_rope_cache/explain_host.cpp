// `cookbook explain qk_norm_rope_cache` without a GPU: the tuned kernel's host policy (policy.h),
// compiled for the host, answering for the call on standard input (include/explain_host.h says the
// format; the call's keys are Call's fields, enums as their values).
#include "include/explain_host.h"
#include "qk_norm_rope_cache/policy.h"

int main() {
  using namespace cookbook::qk_norm_rope_cache;
  using namespace cookbook::qk_norm_rope_cache::tuned;
  const cookbook::HostInput in(std::cin);
  const Call call{in.dtype("dtype"),
                  in.rounding("rounding"),
                  in.integer("num_tokens"),
                  static_cast<int>(in.integer("num_q_heads")),
                  static_cast<int>(in.integer("num_kv_heads")),
                  static_cast<int>(in.integer("head_dim")),
                  static_cast<int>(in.integer("rope_dim")),
                  static_cast<Layout>(in.integer("layout")),
                  static_cast<TableDtype>(in.integer("weights")),
                  static_cast<TableDtype>(in.integer("cos_sin")),
                  static_cast<CacheDtype>(in.integer("cache")),
                  in.flag("rows_are_vectors"),
                  in.flag("tables_are_vectors"),
                  in.flag("caches_are_vectors"),
                  in.integer("num_slots")};
  const Plan chosen = plan(call, in.sms(), [&](const Kernel& kernel) {
    return in.blocks_per_sm(kernel_function(kernel), template_values(kernel), kernel.block);
  });
  std::cout << describe(chosen);
  if (chosen.rows > 0) {
    std::cout << "registers=" << in.resources(kernel_function(chosen.kernel), template_values(chosen.kernel)).registers << "\n";
  }
  return 0;
}
