// Small helpers shared by the scheduler's source files (scheduler*.cc). Not a public header.
#pragma once

#include <cstdint>
#include <string>

#include "atom_sched/errors.h"

namespace atom_sched::detail {

inline int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

inline void check(bool ok, const std::string& what) {
  if (!ok) throw InvariantViolation("Scheduler: " + what);
}

inline std::string id_str(int64_t id) { return std::to_string(id); }

}  // namespace atom_sched::detail
