// The Python Scheduler object: the C++ scheduler, the mutex that serialises calls on it (the GIL
// is released during heavy calls), and the Python objects it must keep alive.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <stdexcept>

#include "atom_sched/scheduler.h"

namespace atom_sched {

struct SchedulerHandle {
  explicit SchedulerHandle(SchedulerConfig config) : core(std::move(config)) {}
  Scheduler core;
  std::mutex mu;
  pybind11::object connector;  // the Python KVConnector the core calls back into, or None
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

/// Runs f(core) with the scheduler's mutex held and the GIL released. Every call into the core
/// goes through here: a call that needs the GIL back (a Python KV connector) while another thread
/// holds the GIL and waits for the mutex would otherwise deadlock. `f` must not touch Python.
/// A KV connector callback that calls into any Scheduler, its own or another, gets a RuntimeError:
/// waiting on its own mutex would deadlock the thread, and taking another scheduler's mutex while
/// holding this one deadlocks against a thread whose callback does the reverse.
template <typename F>
auto with_core(SchedulerHandle& h, F&& f) {
  if (t_inside_a_scheduler)
    throw std::runtime_error(
        "a KV connector callback must not call into a Scheduler (its own or another)");
  pybind11::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(h.mu);
  struct Inside {
    Inside() { t_inside_a_scheduler = true; }
    ~Inside() { t_inside_a_scheduler = false; }
  } inside;
  return f(h.core);
}

}  // namespace atom_sched
