// The Python Scheduler object: the C++ scheduler, the mutex that serialises calls on it (the GIL
// is released during heavy calls), and the Python objects it must keep alive.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <type_traits>

#include "atom_sched/scheduler.h"

namespace atom_sched {

/// Batch.views()' result for one batch buffer and shape, built once and returned again whenever
/// a batch in that buffer has that shape. Its arrays' base owns the batch storage only (never
/// this handle), so the cache makes no reference cycle: numpy arrays are not garbage-collector
/// containers.
struct BatchViewsCache {
  const Batch* buffer = nullptr;
  int32_t num_rows = -1, num_tokens = -1, num_spec_tokens = -1;
  uint64_t last_used = 0;  // the handle's views_clock when last returned (0: never)
  pybind11::object views;  // an atom_sched.BatchViews
};
/// Shapes kept, over both buffers: building the views costs several microseconds, and finishes
/// and admissions change the row count from step to step, mostly among a few values.
constexpr int kViewsCached = 16;

struct SchedulerHandle {
  explicit SchedulerHandle(SchedulerConfig config) : core(std::move(config)) {}
  Scheduler core;
  std::mutex mu;
  pybind11::object connector;  // the Python KVConnector the core calls back into, or None
  BatchViewsCache views[kViewsCached];  // guarded by the GIL, as views_clock
  uint64_t views_clock = 0;
  // A KeyboardInterrupt or SystemExit a callback raised during a call whose result the engine
  // must not lose; the next call on this scheduler raises it. Guarded by the GIL.
  std::optional<pybind11::error_already_set> deferred_interrupt;
};
using Handle = std::shared_ptr<SchedulerHandle>;
using SchedulerClass = pybind11::class_<SchedulerHandle, Handle>;

/// Registers KVConnector, ConnectorRequest and RemoteMatch (before the Scheduler class).
void bind_connector_types(pybind11::module_& m);
/// Adds the connector methods to the Scheduler class.
void bind_connector_methods(SchedulerClass& cls);
/// Makes the Scheduler's reference to its connector visible to the garbage collector, so that a
/// connector holding its scheduler (a cycle, as the loopback connectors build through their
/// engine) is collected (pybind11::custom_type_setup of the Scheduler class).
void connector_gc_support(PyHeapTypeObject* heap_type);

}  // namespace atom_sched

namespace atom_sched {

/// True on a thread while it is inside some scheduler's with_core(): Python runs there only in a
/// KV connector callback.
inline thread_local bool t_inside_a_scheduler = false;

/// The KeyboardInterrupt or SystemExit (any BaseException that is not an Exception) a KV connector
/// callback raised on this thread during the current core call; the callback turned it into a
/// ConnectorInterrupt for the core, which finishes the call consistently (kv_connector.h).
inline thread_local std::optional<pybind11::error_already_set> t_connector_interrupt;

/// A step of at most this many rows (and at most K+1 tokens each) is small for with_core(): its
/// core work is about what releasing and retaking the GIL costs.
inline constexpr int32_t kSmallStepRows = 64;

/// What with_core() does with such an interrupt once the core call has returned.
enum class OnInterrupt {
  kRaise,  // raise it now; the call's result, if any, is dropped
  kDefer,  // keep it for the next call on this scheduler: the result must reach the engine
};

/// Raises (and forgets) the interrupt a previous call deferred. Needs the GIL.
inline void raise_deferred_interrupt(SchedulerHandle& h) {
  if (!h.deferred_interrupt) return;
  pybind11::error_already_set e = std::move(*h.deferred_interrupt);
  h.deferred_interrupt.reset();
  throw e;
}

/// Runs f(core) with the scheduler's mutex held and the GIL released. Every call into the core
/// goes through here: a call that needs the GIL back (a Python KV connector) while another thread
/// holds the GIL and waits for the mutex would otherwise deadlock. `f` must not touch Python.
/// A KV connector callback that calls into any Scheduler, its own or another, gets a RuntimeError:
/// waiting on its own mutex would deadlock the thread, and taking another scheduler's mutex while
/// holding this one deadlocks against a thread whose callback does the reverse.
/// An interrupt deferred by the previous call is raised first, before anything changes; one
/// raised by a callback during this call is raised or deferred as `on_interrupt` says.
///
/// `small(core)`, when given, says the call's work is a few microseconds (a decode step of a few
/// rows): releasing and retaking the GIL would cost as much again. Such a call keeps the GIL if
/// it finds the mutex free and no KV connector attached (nothing in the core then takes the GIL
/// back, and no thread ever blocks on the mutex while holding the GIL, so this cannot deadlock);
/// other threads wait for it as for any short C call.
template <typename F, typename Small = std::nullptr_t>
auto with_core(SchedulerHandle& h, F&& f, OnInterrupt on_interrupt = OnInterrupt::kRaise,
               Small small = nullptr) {
  if (t_inside_a_scheduler)
    throw std::runtime_error(
        "a KV connector callback must not call into a Scheduler (its own or another)");
  raise_deferred_interrupt(h);
  struct Inside {
    Inside() { t_inside_a_scheduler = true; }
    ~Inside() { t_inside_a_scheduler = false; }
  };
  auto run = [&] {  // returns a copy, made under the lock
    if constexpr (!std::is_null_pointer_v<Small>) {
      std::unique_lock<std::mutex> lock(h.mu, std::try_to_lock);
      if (lock.owns_lock() && h.core.kv_connector() == nullptr && small(h.core)) {
        Inside inside;
        return f(h.core);
      }
    }
    pybind11::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(h.mu);
    Inside inside;
    return f(h.core);
  };
  // With the GIL held again: take this call's interrupt, if any, and raise or defer it.
  auto after = [&](bool raise_now) {
    if (!t_connector_interrupt) return;
    h.deferred_interrupt = std::move(*t_connector_interrupt);
    t_connector_interrupt.reset();
    if (raise_now) raise_deferred_interrupt(h);
  };
  try {
    if constexpr (std::is_void_v<decltype(run())>) {
      run();
      after(on_interrupt == OnInterrupt::kRaise);
    } else {
      auto result = run();
      after(on_interrupt == OnInterrupt::kRaise);
      return result;
    }
  } catch (const pybind11::error_already_set&) {
    throw;
  } catch (...) {
    after(/*raise_now=*/true);  // the interrupt rather than the error it caused
    throw;
  }
}

}  // namespace atom_sched
