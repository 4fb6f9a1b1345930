// The atom_sched._core module: exception types, block_hash, and the registration of every binding
// file (bind_*.cc).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "atom_sched/errors.h"
#include "atom_sched/xxhash64.h"
#include "bindings.h"

namespace py = pybind11;

namespace {

// Python integer (anything with __index__) as an exact Python int; TypeError otherwise.
py::int_ as_index(py::handle obj, const char* what) {
  PyObject* idx = PyNumber_Index(obj.ptr());
  if (idx == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be an int, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  return py::reinterpret_steal<py::int_>(idx);
}

uint64_t block_hash_py(const py::sequence& token_ids, const py::object& parent) {
  std::vector<int32_t> tokens;
  tokens.reserve(py::len(token_ids));
  for (py::handle item : token_ids) {
    py::int_ v = as_index(item, "token id");
    int overflow = 0;
    const long long t = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0 || t < 0 || t > INT32_MAX) {
      throw py::value_error("token id " + std::string(py::str(v)) + " is outside [0, 2**31)");
    }
    tokens.push_back(static_cast<int32_t>(t));
  }
  std::optional<uint64_t> p;
  if (!parent.is_none()) {
    py::int_ v = as_index(parent, "parent");
    const unsigned long long u = PyLong_AsUnsignedLongLong(v.ptr());  // fails if < 0 or >= 2**64
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error("parent " + std::string(py::str(v)) + " is outside [0, 2**64)");
    }
    p = u;
  }
  return atom_sched::block_hash(tokens, p);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "atom_sched C++ core: scheduler, paged KV block pool and prefix cache";
  // InvalidArgument derives from std::invalid_argument and so reaches Python as ValueError.
  py::register_exception<atom_sched::InvariantViolation>(m, "InvariantError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const atom_sched::UnknownRequest& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });
  m.def("block_hash", &block_hash_py, py::arg("token_ids"), py::arg("parent") = py::none(),
        "ATOM's chained KV-block hash: xxHash64 (seed 0) over the parent hash as 8 little-endian\n"
        "bytes (if given), then each token id as a little-endian int64.");
  m.def(
      "hash_namespace",
      [](const py::object& lora_name, const py::object& cache_salt) {
        return atom_sched::hash_namespace(atom_sched::extra_key_text(lora_name, "lora_name"),
                                          atom_sched::extra_key_text(cache_salt, "cache_salt"));
      },
      py::kw_only(), py::arg("lora_name") = py::str(""), py::arg("cache_salt") = py::str(""),
      "The parent of block 0's hash for a request with these extra keys (SamplingParams'\n"
      "lora_name and cache_salt), or None for neither: block_hash(block0, hash_namespace(...)).");
  atom_sched::bind_config(m);
  atom_sched::bind_scheduler(m);
  atom_sched::bind_device(m);
  atom_sched::bind_compat(m);
  atom_sched::guard_uninitialised_instances(m);
}
