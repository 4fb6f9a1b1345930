// Small helpers shared by the scheduler's source files (scheduler*.cc). Not a public header.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>

#include "atom_sched/errors.h"

namespace atom_sched::detail {

inline int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

inline void check(bool ok, const std::string& what) {
  if (!ok) throw InvariantViolation("Scheduler: " + what);
}

inline std::string id_str(int64_t id) { return std::to_string(id); }

// Calls fn(i) for each i < n with marks[i] != 0, in order, reading the marks eight at a time:
// the passes that flag rows vectorise, and a step flags few (marks holds n rounded up to 8).
template <class Fn>
[[gnu::always_inline]] inline void for_each_marked(const uint8_t* marks, int32_t n, Fn&& fn) {
  static_assert(std::endian::native == std::endian::little, "byte i of a word is mark i0 + i");
  const auto word_at = [&](int32_t i0) {
    uint64_t word;
    std::memcpy(&word, marks + i0, sizeof word);
    return word;
  };
  int32_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8)
    for (uint64_t word = word_at(i0); word != 0; word &= word - 1)
      fn(i0 + __builtin_ctzll(word) / 8);
  if (i0 == n) return;
  for (uint64_t word = word_at(i0) & (~uint64_t{0} >> (8 * (i0 + 8 - n))); word != 0;
       word &= word - 1)  // the last bytes before n
    fn(i0 + __builtin_ctzll(word) / 8);
}

}  // namespace atom_sched::detail
