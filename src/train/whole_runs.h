// Internal to train/: a rank's layout of a model against the whole model's.
#pragma once

#include <cstdint>
#include <limits>

#include "loom/store.h"

namespace loom {

// Visits every element of a rank's layout (of its parameters that overlap
// `within`) in runs: fn(spec, flat offset in `local`, flat offset in `whole`
// or -1 for padding, length).
template <typename Fn>
void for_each_whole_run(const ParamLayout& local, const ParamLayout& whole, Fn fn,
                        FlatRange within = {0, std::numeric_limits<int64_t>::max()}) {
  for (const ParamSpec& p : local.params()) {
    if (p.offset >= within.end || p.offset + p.numel() <= within.begin) continue;
    const ParamSpec& w = whole.param(whole.find(p.name));
    for (int64_t i = 0; i < p.numel();) {
      int64_t run = 0;
      const int64_t g = p.global_index(i, &run);
      fn(p, p.offset + i, g < 0 ? -1 : w.offset + g, run);
      i += run;
    }
  }
}

}  // namespace loom
