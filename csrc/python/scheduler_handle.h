// The Python Scheduler object: the C++ scheduler, the mutex that serialises calls on it (the GIL
// is released during heavy calls), and the Python objects it must keep alive.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "atom_sched/scheduler.h"

namespace atom_sched {

struct SchedulerHandle {
  explicit SchedulerHandle(SchedulerConfig config) : core(std::move(config)) {}
  Scheduler core;
  std::mutex mu;
  std::atomic<std::thread::id> holder{};  // the thread inside with_core(), if any
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
/// A KV connector callback that calls back into its scheduler gets a RuntimeError (the mutex is
/// not recursive: waiting on it would deadlock the thread).
template <typename F>
auto with_core(SchedulerHandle& h, F&& f) {
  if (h.holder.load() == std::this_thread::get_id())
    throw std::runtime_error("a KV connector callback must not call back into its Scheduler");
  pybind11::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(h.mu);
  struct Holding {
    SchedulerHandle& h;
    explicit Holding(SchedulerHandle& handle) : h(handle) {
      h.holder.store(std::this_thread::get_id());
    }
    ~Holding() { h.holder.store(std::thread::id{}); }
  } holding(h);
  return f(h.core);
}

}  // namespace atom_sched
