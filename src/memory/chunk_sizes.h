// Sizes shared by the placement estimate and the manager. Internal to
// src/memory.
#pragma once

#include <cstdint>

namespace loom {

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }
// A chunk shard's optimizer payload: fp32 master weights, m and v.
inline int64_t optim_payload_bytes(int64_t shard) { return 3 * 4 * shard; }

}  // namespace loom
