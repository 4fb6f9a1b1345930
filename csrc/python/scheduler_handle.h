// The Python Scheduler object: the C++ scheduler, the mutex that serialises calls on it (the GIL
// is released during heavy calls), and the Python objects it must keep alive.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>

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

}  // namespace atom_sched

namespace atom_sched {

/// Runs f(core) with the scheduler's mutex held and the GIL released. Every call into the core
/// goes through here: a call that needs the GIL back (a Python KV connector) while another thread
/// holds the GIL and waits for the mutex would otherwise deadlock. `f` must not touch Python.
template <typename F>
auto with_core(SchedulerHandle& h, F&& f) {
  pybind11::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(h.mu);
  return f(h.core);
}

}  // namespace atom_sched
