// KV connectors written in Python: the KVConnector base class (a pybind11 trampoline the C++
// scheduler calls back into, taking the GIL), the ConnectorRequest it receives, the RemoteMatch it
// answers, and the Scheduler methods that attach a connector and take its transfer reports.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "atom_sched/kv_connector.h"
#include "scheduler_handle.h"

namespace atom_sched {

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

// What Python sees of a request: copies, since the core's spans live only for the call.
struct PyConnectorRequest {
  int64_t request_id;
  std::vector<int32_t> token_ids;
  int32_t num_prompt_tokens;
  std::vector<int32_t> block_ids;
  int32_t num_cached_tokens;
  std::vector<int32_t> draft_token_ids;
  std::optional<std::string> finish_reason;
};

PyConnectorRequest copy_of(const ConnectorRequest& r) {
  std::optional<std::string> reason;
  if (r.finish_reason != FinishReason::kNone)
    reason = finish_reason_string(r.finish_reason, r.stop_token);
  return {r.id,
          {r.token_ids.begin(), r.token_ids.end()},
          r.num_prompt_tokens,
          {r.block_ids.begin(), r.block_ids.end()},
          r.num_cached_tokens,
          {r.draft_token_ids.begin(), r.draft_token_ids.end()},
          std::move(reason)};
}

// "Type: message", first line only: reasons and connector errors reach clients, which must not
// see the server's traceback or file paths.
std::string one_line(const py::error_already_set& e) {
  std::string msg = py::str(e.value()).cast<std::string>();
  msg = msg.substr(0, msg.find('\n'));
  return py::str(e.type().attr("__name__")).cast<std::string>() + (msg.empty() ? "" : ": " + msg);
}

// Forwards each call to the Python subclass. A Python exception becomes a std::runtime_error
// carrying its message (built while the GIL is held), which the core turns into a rejected
// request or a connector error. KeyboardInterrupt and SystemExit (any BaseException that is not an
// Exception) fail no request: the core gets a ConnectorInterrupt, and with_core() raises the
// Python exception itself once the core call has finished consistently.
class PyKvConnector : public KvConnector {
 public:
  bool is_producer() const override {
    py::gil_scoped_acquire gil;
    return call("is_producer").cast<bool>();
  }

  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& r) override {
    py::gil_scoped_acquire gil;
    py::object res = call("get_num_new_matched_tokens", copy_of(r));
    if (py::isinstance<RemoteMatch>(res)) return res.cast<RemoteMatch>();
    // ATOM's and vLLM's shape: (num_tokens, load_async); vLLM's "cannot tell yet": None or
    // (None, _).
    RemoteMatch m;
    const bool pair = py::isinstance<py::tuple>(res) && py::len(res) == 2;
    if (res.is_none() || (pair && res.cast<py::tuple>()[0].is_none())) {
      m.retry_later = true;
      return m;
    }
    if (!pair)
      throw std::runtime_error("get_num_new_matched_tokens must return a RemoteMatch, "
                               "(num_tokens, load_async) or None");
    auto t = res.cast<py::tuple>();
    m.num_tokens = t[0].cast<int32_t>();
    m.load_async = t[1].cast<bool>();
    return m;
  }

  void update_state_after_alloc(const ConnectorRequest& r) override {
    py::gil_scoped_acquire gil;
    call("update_state_after_alloc", copy_of(r));
  }

  bool request_finished(const ConnectorRequest& r) override {
    py::gil_scoped_acquire gil;
    py::object res = call("request_finished", copy_of(r));
    return !res.is_none() && res.cast<bool>();
  }

 private:
  template <typename... Args>
  py::object call(const char* name, Args&&... args) const {
    py::function f = py::get_override(static_cast<const KvConnector*>(this), name);
    if (!f) throw std::runtime_error(std::string("the KVConnector does not implement ") + name);
    try {
      return f(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      if (e.matches(PyExc_Exception)) throw std::runtime_error(one_line(e));
      if (!t_connector_interrupt) t_connector_interrupt = std::move(e);  // the first one wins
      throw ConnectorInterrupt();
    }
  }
};

}  // namespace

void bind_connector_types(py::module_& m) {
  py::class_<PyConnectorRequest>(m, "ConnectorRequest",
                                 "What a KV connector sees of a request (copies).")
      .def_readonly("request_id", &PyConnectorRequest::request_id)
      .def_readonly("token_ids", &PyConnectorRequest::token_ids)
      .def_readonly("num_prompt_tokens", &PyConnectorRequest::num_prompt_tokens)
      .def_readonly("block_ids", &PyConnectorRequest::block_ids)
      .def_readonly("num_cached_tokens", &PyConnectorRequest::num_cached_tokens)
      .def_readonly("draft_token_ids", &PyConnectorRequest::draft_token_ids)
      .def_readonly("finish_reason", &PyConnectorRequest::finish_reason)
      .def_property_readonly("prompt_token_ids",
                             [](const PyConnectorRequest& r) {
                               return std::vector<int32_t>(
                                   r.token_ids.begin(), r.token_ids.begin() + r.num_prompt_tokens);
                             })
      .def("__repr__", [](const PyConnectorRequest& r) {
        return "ConnectorRequest(request_id=" + std::to_string(r.request_id) +
               ", tokens=" + std::to_string(r.token_ids.size()) +
               ", blocks=" + std::to_string(r.block_ids.size()) + ")";
      });

  py::class_<RemoteMatch>(m, "RemoteMatch", "A KV connector's answer for a waiting request.")
      .def(py::init([](int32_t num_tokens, bool load_async, int32_t first_token,
                       std::vector<int32_t> draft_tokens, bool retry_later) {
             RemoteMatch r;
             r.num_tokens = num_tokens;
             r.load_async = load_async;
             r.first_token = first_token;
             r.draft_tokens = std::move(draft_tokens);
             r.retry_later = retry_later;
             r.validate();  // ValueError here, not a rejected request later
             return r;
           }),
           py::kw_only(), "num_tokens"_a = 0, "load_async"_a = false, "first_token"_a = -1,
           "draft_tokens"_a = std::vector<int32_t>{}, "retry_later"_a = false)
      .def_readwrite("num_tokens", &RemoteMatch::num_tokens)
      .def_readwrite("load_async", &RemoteMatch::load_async)
      .def_readwrite("retry_later", &RemoteMatch::retry_later)
      // The token ids are checked when set as on construction (ValueError, value unchanged).
      .def_property(
          "first_token", [](const RemoteMatch& r) { return r.first_token; },
          [](RemoteMatch& r, int32_t t) {
            RemoteMatch c;
            c.first_token = t;
            c.validate();
            r.first_token = t;
          })
      .def_property(
          "draft_tokens", [](const RemoteMatch& r) { return r.draft_tokens; },
          [](RemoteMatch& r, std::vector<int32_t> d) {
            RemoteMatch c;
            c.draft_tokens = std::move(d);
            c.validate();
            r.draft_tokens = std::move(c.draft_tokens);
          });

  py::class_<KvConnector, PyKvConnector, std::shared_ptr<KvConnector>>(
      m, "KVConnector",
      "Base class of scheduler-side KV connectors (ATOM's KVConnectorSchedulerBase). Subclass it\n"
      "and implement is_producer(), get_num_new_matched_tokens(request) -> RemoteMatch,\n"
      "(num_tokens, load_async) or None (cannot tell yet), update_state_after_alloc(request) and\n"
      "request_finished(request) -> bool (True keeps the blocks until finished_sending).")
      .def(py::init<>());
}

void connector_gc_support(PyHeapTypeObject* heap_type) {
  PyTypeObject* type = &heap_type->ht_type;
  type->tp_flags |= Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
    Py_VISIT(Py_TYPE(self));
    if (py::detail::is_holder_constructed(self)) {
      auto& h = py::cast<SchedulerHandle&>(py::handle(self));
      Py_VISIT(h.connector.ptr());
    }
    return 0;
  };
  // Only an unreachable Scheduler is cleared, so no other thread can be inside it.
  type->tp_clear = [](PyObject* self) -> int {
    if (py::detail::is_holder_constructed(self)) {
      auto& h = py::cast<SchedulerHandle&>(py::handle(self));
      h.core.set_kv_connector(nullptr);
      h.connector = py::object();
    }
    return 0;
  };
}

void bind_connector_methods(SchedulerClass& cls) {
  cls.def(
         "set_kv_connector",
         [](SchedulerHandle& h, py::object connector) {
           std::shared_ptr<KvConnector> core_side;
           if (!connector.is_none()) {
             if (!py::isinstance<KvConnector>(connector))
               throw py::type_error("set_kv_connector expects a KVConnector or None");
             core_side = connector.cast<std::shared_ptr<KvConnector>>();
           }
           with_core(h, [&](Scheduler& c) { c.set_kv_connector(core_side); });
           h.connector = connector;  // keeps the Python object (and its overrides) alive
         },
         "connector"_a)
      .def_property_readonly("kv_connector",
                             [](SchedulerHandle& h) -> py::object {
                               return h.connector ? h.connector : py::none();
                             })
      .def(
          "update_from_kv_xfer_finished",
          [](SchedulerHandle& h, std::vector<int64_t> sending, std::vector<int64_t> recving) {
            with_core(h, [&](Scheduler& c) { c.update_from_kv_xfer_finished(sending, recving); });
          },
          "finished_sending"_a = std::vector<int64_t>{},
          "finished_recving"_a = std::vector<int64_t>{})
      .def("take_connector_errors",
           [](SchedulerHandle& h) {
             return with_core(h, [](Scheduler& c) { return c.take_connector_errors(); });
           })
      .def(
          "count_admittable_head_prefills",
          [](SchedulerHandle& h, int32_t limit) {
            return with_core(h,
                             [&](Scheduler& c) { return c.count_admittable_head_prefills(limit); });
          },
          "limit"_a);
}

}  // namespace atom_sched
