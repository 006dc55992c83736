#include <charconv>
#include <cmath>

#include "loom/config.h"

namespace loom {

size_t parse_bytes(std::string_view text) {
  auto fail = [&](std::string_view why) -> Error {
    return Error(str("invalid byte size '", text, "': ", why,
                     "; write a number with an optional unit B, KiB, MiB, GiB, TiB (1024-based) or KB, MB, GB, TB "
                     "(1000-based), e.g. \"2GiB\", or \"unlimited\""));
  };
  std::string_view t = text;
  while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
  while (!t.empty() && t.back() == ' ') t.remove_suffix(1);
  if (t == "unlimited") return kUnlimited;
  if (t.empty()) throw fail("it is empty");

  double number = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), number, std::chars_format::fixed);
  if (ec != std::errc() || end == t.data()) throw fail("it does not start with a number");
  std::string_view unit(end, static_cast<size_t>(t.data() + t.size() - end));
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);

  struct Unit {
    std::string_view name;
    double scale;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},           {"B", 1},          {"KiB", 1024.0},   {"MiB", 1024.0 * 1024},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6},
      {"GB", 1e9},       {"TB", 1e12},
  };
  const Unit* found = nullptr;
  for (const Unit& u : kUnits)
    if (u.name == unit) found = &u;
  if (!found) throw fail(str("unknown unit '", unit, "'"));
  if (number < 0) throw fail("it is negative");
  double bytes = number * found->scale;
  if (bytes != std::floor(bytes)) throw fail("it is not a whole number of bytes");
  // 2^64 is exactly representable; anything at or above it does not fit size_t.
  if (bytes >= 18446744073709551616.0) throw fail("it does not fit in 64 bits");
  return static_cast<size_t>(bytes);
}

}  // namespace loom
