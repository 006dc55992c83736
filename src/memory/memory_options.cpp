#include <cmath>
#include <system_error>

#include "loom/memory.h"

namespace loom {

const char* memory_policy_name(MemoryPolicy p) {
  switch (p) {
    case MemoryPolicy::none: return "none";
    case MemoryPolicy::fixed: return "static";
    case MemoryPolicy::automatic: return "auto";
  }
  LOOM_CHECK(false, "unknown memory policy ", static_cast<int>(p));
}

MemoryPolicy parse_memory_policy(const std::string& name) {
  for (MemoryPolicy p : {MemoryPolicy::none, MemoryPolicy::fixed, MemoryPolicy::automatic})
    if (name == memory_policy_name(p)) return p;
  throw Error(str("memory.policy = \"", name, "\" is not a policy; use \"none\", \"static\" or \"auto\""));
}

namespace {

void check_fraction(const char* field, double frac, MemoryPolicy policy) {
  if (!std::isfinite(frac) || frac < 0.0 || frac > 1.0)
    throw Error(str(field, " = ", frac, " must be a fraction in [0, 1]"));
  if (frac > 0.0 && policy != MemoryPolicy::fixed)
    throw Error(str(field, " = ", frac, " with memory.policy = \"", memory_policy_name(policy),
                    "\": the fractions only apply to memory.policy = \"static\"; set the policy to \"static\" or the "
                    "fraction to 0"));
}

}  // namespace

void validate(const MemoryOptions& opts) {
  check_fraction("memory.offload_param_frac", opts.offload_param_frac, opts.policy);
  check_fraction("memory.offload_optim_frac", opts.offload_optim_frac, opts.policy);
  if (opts.chunk_bytes < 0)
    throw Error(str("memory.chunk_bytes = ", opts.chunk_bytes, " must be >= 0 (0 searches the chunk size)"));
  if (opts.prefetch < 0) throw Error(str("memory.prefetch = ", opts.prefetch, " must be >= 0 (0 fetches on use)"));
  if (opts.micro_batches < 1)
    throw Error(str("memory: micro_batches = ", opts.micro_batches,
                    " must be >= 1 (it is train.batch_size / (train.micro_batch_size x data-parallel ranks))"));
  if (!opts.nvme_dir.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_directory(opts.nvme_dir, ec))
      throw Error(str("memory.nvme_dir = ", opts.nvme_dir,
                      " does not exist or is not a directory; create it on the NVMe "
                      "drive or leave memory.nvme_dir empty to offload to host memory"));
  }
}

const char* tensor_state_name(TensorState s) {
  switch (s) {
    case TensorState::free: return "free";
    case TensorState::compute: return "compute";
    case TensorState::hold: return "hold";
    case TensorState::hold_after_backward: return "hold_after_backward";
    case TensorState::ready_for_reduce: return "ready_for_reduce";
  }
  LOOM_CHECK(false, "unknown tensor state ", static_cast<int>(s));
}

}  // namespace loom
