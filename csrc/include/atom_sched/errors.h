// Error types of atom_sched. Bad input from a caller is an InvalidArgument (Python ValueError) or
// an UnknownRequest (Python KeyError); a broken internal invariant is an InvariantViolation, which
// is a bug in atom_sched, never the caller's fault. Running out of KV blocks is not an error.
#pragma once

#include <stdexcept>
#include <string>

namespace atom_sched {

/// A caller passed a value the API does not accept. The callee's state is unchanged.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A request id that the scheduler does not know (never added, or already finished).
class UnknownRequest : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

/// An internal invariant does not hold: a bug in atom_sched.
class InvariantViolation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace atom_sched
