#include <algorithm>
#include <climits>
#include <cmath>

#include "loom/memory.h"
#include "memory/chunk_sizes.h"

namespace loom {

namespace {

// The largest group's element count: a group is converted to fp32 as a whole
// when it is acquired under bf16/f16.
int64_t largest_group(const ParamLayout& layout) {
  int64_t n = 0;
  for (int g = 0; g < layout.num_groups(); ++g) {
    const auto [b, e] = layout.group_range(g);
    n = std::max(n, e - b);
  }
  return n;
}

// The most chunks any one group spans.
int64_t chunks_per_group(const ChunkLayout& chunks) {
  size_t n = 1;
  for (int g = 0; g < chunks.params().num_groups(); ++g) n = std::max(n, chunks.chunks_of_group(g).size());
  return static_cast<int64_t>(n);
}

std::string need_line(const char* tier, int64_t state, int64_t working, int64_t activations, int64_t budget) {
  std::string line = str(tier, " needs ", format_bytes(double(state + working + activations)), " (model state ",
                         format_bytes(double(state)), ", working buffers ", format_bytes(double(working)));
  if (activations > 0) line += str(", activations and frozen weights ", format_bytes(double(activations)));
  return line + str(") but its budget is ", format_bytes(double(budget)));
}

}  // namespace

ChunkPlacement static_placement(int num_chunks, double offload_param_frac, double offload_optim_frac, bool nvme) {
  const Tier off = nvme ? Tier::nvme : Tier::host;
  ChunkPlacement p;
  const auto place = [&](std::vector<Tier>& tiers, double frac) {
    const int offloaded = static_cast<int>(std::lround(frac * num_chunks));
    for (int c = 0; c < num_chunks; ++c) tiers.push_back(c >= num_chunks - offloaded ? off : Tier::device);
  };
  place(p.param, offload_param_frac);
  place(p.optim, offload_optim_frac);
  return p;
}

MemoryNeeds memory_needs(const ChunkLayout& chunks, const ChunkPlacement& placement, DType precision,
                         const MemoryOptions& opts) {
  const int64_t S = chunks.shard_numel(), C = chunks.chunk_numel(), w = int64_t(dtype_size(precision));
  const bool reuse = opts.micro_batches == 1;
  MemoryNeeds n;
  bool any_nvme_param = false, any_nvme_optim = false, any_off_device_param = false;
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    const Tier pt = placement.param[static_cast<size_t>(c)], ot = placement.optim[static_cast<size_t>(c)];
    n.model_state[pt] += S * w;
    n.model_state[ot] += optim_payload_bytes(S);
    // Gradient shards of their own (gradient accumulation) live where the
    // update reads them: on the device, or on the host for host and NVMe
    // optimizer state; they accumulate in fp32.
    if (!reuse) n.model_state[ot == Tier::device ? Tier::device : Tier::host] += S * 4;
    any_nvme_param |= pt == Tier::nvme;
    any_nvme_optim |= ot == Tier::nvme;
    any_off_device_param |= pt != Tier::device;
  }
  // Device: the chunks gathered for the acquired group, one more (two groups
  // are acquired at once around the output head) and the prefetched ones, their shards staged from
  // the host, the gradient chunks accumulating (the token table's, held from
  // the head's backward to the embedding's, the current and the one being
  // reduced) with their reduced shards, and the fp32 copies of two groups
  // under bf16/f16.
  const int64_t gathered = chunks_per_group(chunks) + 1 + opts.prefetch;
  const bool staged = any_off_device_param || chunks.ranks() > 1;
  const int64_t staging = chunks.ranks() > 1 ? S : 0;  // the shard copied to the device for the gather
  n.device_working = (staged ? gathered * (C + staging) * w : 0) + 3 * (C + staging) * 4;
  if (precision != DType::f32) n.device_working += 2 * largest_group(chunks.params()) * 4;
  // Host: one shard's state staged at a time (initialization, the update of
  // a chunk whose state is elsewhere, checkpoints), and NVMe reads ahead and
  // writes behind.
  n.host_working = 5 * S * 4;
  if (any_nvme_param) n.host_working += 2 * (gathered + 2) * round_up(S * w, int64_t(kIoAlign));
  // The update holds the chunk it updates, one read ahead and one write
  // behind.
  if (any_nvme_optim) n.host_working += 3 * optim_payload_bytes(S);
  return n;
}

void check_budgets(const MemoryNeeds& needs, int64_t device_activations, const TierBytes& budgets,
                   const MemoryOptions& opts) {
  std::vector<std::string> over;
  const int64_t device = needs.model_state[Tier::device] + needs.device_working + device_activations;
  if (device > budgets[Tier::device])
    over.push_back(need_line("the device", needs.model_state[Tier::device], needs.device_working, device_activations,
                             budgets[Tier::device]) +
                   " (memory.device_budget)");
  const int64_t host = needs.model_state[Tier::host] + needs.host_working;
  if (host > budgets[Tier::host])
    over.push_back(need_line("the host", needs.model_state[Tier::host], needs.host_working, 0, budgets[Tier::host]) +
                   " (memory.host_budget)");
  if (needs.model_state[Tier::nvme] > budgets[Tier::nvme])
    over.push_back(str("NVMe needs ", format_bytes(double(needs.model_state[Tier::nvme])), " but its budget is ",
                       format_bytes(double(budgets[Tier::nvme]))));
  if (over.empty()) return;
  std::string msg = str("memory.policy = \"", memory_policy_name(opts.policy), "\" cannot fit this model: ");
  for (size_t i = 0; i < over.size(); ++i) msg += (i ? "; " : "") + over[i];
  const int64_t state = needs.model_state[Tier::device] + needs.model_state[Tier::host] + needs.model_state[Tier::nvme];
  msg += str(". The model state is ", format_bytes(double(state)), " in all");
  const int64_t device_and_host = budgets[Tier::device] >= INT64_MAX - budgets[Tier::host]
                                      ? INT64_MAX
                                      : budgets[Tier::device] + budgets[Tier::host];
  if (needs.model_state[Tier::nvme] == 0 && state > device_and_host)
    msg += str(", more than the device and host budgets hold together (", format_bytes(double(budgets[Tier::device])),
               " + ", format_bytes(double(budgets[Tier::host])), ")");
  std::vector<std::string> fixes;
  if (opts.nvme_dir.empty()) fixes.push_back("set memory.nvme_dir to a directory on a fast disk to place state on NVMe");
  if (opts.policy == MemoryPolicy::fixed)
    fixes.push_back("raise memory.offload_param_frac / memory.offload_optim_frac or try memory.policy = \"auto\"");
  fixes.push_back(device_activations > 0 ? "lower train.micro_batch_size or raise the budgets" : "raise the budgets");
  msg += "; ";
  for (size_t i = 0; i < fixes.size(); ++i) msg += (i == 0 ? "" : i + 1 == fixes.size() ? ", or " : ", ") + fixes[i];
  throw Error(msg);
}

int64_t chunk_capacity(int64_t chunk_bytes, DType precision, int ranks) {
  const int64_t w = static_cast<int64_t>(dtype_size(precision));
  return round_up((chunk_bytes + w - 1) / w, ranks * kChunkShardAlign);
}

MemoryPlan plan_memory(const ParamLayout& layout, const MemoryOptions& opts, DType precision, int ranks,
                       int64_t device_activations, const TierBytes& budgets) {
  validate(opts);
  LOOM_CHECK(opts.policy != MemoryPolicy::none, "plan_memory needs a placement policy");
  if (precision != DType::f32 && precision != DType::bf16 && precision != DType::f16)
    throw Error(str("chunks hold working parameters in f32, bf16 or f16, not ", dtype_name(precision)));
  const int64_t step = ranks * kChunkShardAlign;
  MemoryPlan plan;
  if (opts.chunk_bytes > 0) {
    plan.search.chunk_numel = chunk_capacity(opts.chunk_bytes, precision, ranks);
    plan.search.candidates = 1;
  } else {
    // Up to twice the smallest capacity: larger chunks waste less at the
    // edges but move and gather at a coarser grain.
    int64_t largest = 0;
    for (const ParamSpec& p : layout.params()) largest = std::max(largest, p.numel());
    plan.search = search_chunk_numel(layout, ranks, 2 * round_up(std::max<int64_t>(largest, 1), step));
  }
  const ChunkLayout chunks(layout, plan.search.chunk_numel, ranks);
  plan.search.wasted_numel = chunks.wasted_numel();
  const int n = chunks.num_chunks();
  const bool nvme = !opts.nvme_dir.empty();
  if (opts.policy == MemoryPolicy::fixed) {
    plan.placement = static_placement(n, opts.offload_param_frac, opts.offload_optim_frac, nvme);
  } else {
    // auto warms up with everything off the device, on the host while it
    // fits; optimizer state goes to NVMe first (it is touched once per step),
    // from the last chunk back, then parameters.
    plan.placement.param.assign(static_cast<size_t>(n), Tier::host);
    plan.placement.optim.assign(static_cast<size_t>(n), Tier::host);
    const auto host_over = [&] {
      const MemoryNeeds needs = memory_needs(chunks, plan.placement, precision, opts);
      return needs.model_state[Tier::host] + needs.host_working > budgets[Tier::host];
    };
    for (std::vector<Tier>* kind : {&plan.placement.optim, &plan.placement.param})
      for (int c = n - 1; nvme && c >= 0 && host_over(); --c) (*kind)[static_cast<size_t>(c)] = Tier::nvme;
  }
  plan.needs = memory_needs(chunks, plan.placement, precision, opts);
  check_budgets(plan.needs, device_activations, budgets, opts);
  return plan;
}

}  // namespace loom
