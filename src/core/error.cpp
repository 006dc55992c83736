#include <cstdio>
#include <cstdlib>

#include "loom/core.h"

namespace loom {

namespace {
thread_local int t_rank = -1;
}

std::string joined(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) (out += i ? separator : "") += items[i];
  return out;
}

int current_rank() { return t_rank; }
void set_current_rank(int rank) { t_rank = rank; }

namespace detail {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "loom: internal check failed at %s:%d (rank %d): %s%s%s\n", file, line, t_rank, cond,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace detail
}  // namespace loom
