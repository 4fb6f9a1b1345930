// ATOM's engine step in C (compat_atom.h): raw CPython calls, because these run once per request
// per step and a pybind11 conversion per object would cost more than the whole C++ scheduler.
#include <pybind11/numpy.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "compat_atom.h"

namespace py = pybind11;

namespace atom_sched {
namespace {

py::object steal(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

void check_output_type(PyTypeObject* t) {
  // Filled slot by slot as a tuple: a tuple subclass with no fields of its own (a NamedTuple).
  if (!PyType_IsSubtype(t, &PyTuple_Type) || t->tp_basicsize != PyTuple_Type.tp_basicsize ||
      t->tp_itemsize != PyTuple_Type.tp_itemsize || t->tp_dictoffset != 0)
    throw py::type_error("output_type must be a NamedTuple class (a tuple subclass with no "
                         "instance dict)");
}

PyObject* token_list(const int32_t* tokens, int32_t n) {
  PyObject* l = PyList_New(n);
  if (l == nullptr) return nullptr;
  for (int32_t j = 0; j < n; ++j) {
    PyObject* t = PyLong_FromLong(tokens[j]);
    if (t == nullptr) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, j, t);
  }
  return l;
}

// Entry i as output_type(id, tokens, finished, reason, None, cached); `id` is borrowed.
PyObject* stream_output(PyTypeObject* type, const StepOutput& so, int32_t i, PyObject* id) {
  const int32_t lo = so.token_offsets[i], hi = so.token_offsets[i + 1];
  PyObject* o = type->tp_alloc(type, 6);
  if (o == nullptr) return nullptr;
  py::object guard = py::reinterpret_steal<py::object>(o);
  const FinishReason why = so.finish_reasons[i];
  PyObject* tokens = token_list(so.new_tokens.data() + lo, hi - lo);
  if (tokens == nullptr) return nullptr;
  Py_INCREF(id);
  PyTuple_SET_ITEM(o, 0, id);
  PyTuple_SET_ITEM(o, 1, tokens);
  PyObject* finished = why != FinishReason::kNone ? Py_True : Py_False;
  Py_INCREF(finished);
  PyTuple_SET_ITEM(o, 2, finished);
  if (why == FinishReason::kNone) {
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(o, 3, Py_None);
  } else {
    const std::string s = finish_reason_string(why, so.stop_tokens[i]);
    PyObject* reason = PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
    if (reason == nullptr) return nullptr;
    PyTuple_SET_ITEM(o, 3, reason);
  }
  Py_INCREF(Py_None);
  PyTuple_SET_ITEM(o, 4, Py_None);
  PyObject* cached = PyLong_FromLong(so.prefix_hit_tokens[i]);
  if (cached == nullptr) return nullptr;
  PyTuple_SET_ITEM(o, 5, cached);
  return guard.release().ptr();
}

// ScheduledBatchOutput.token_ids (one sequence of token ids per row) as an int32 [rows, width]
// array padded with 0, and the rows' lengths: a row longer than `width` keeps its first `width`
// tokens and its true length (for the caller to refuse it by name).
py::tuple token_rows(py::handle rows, int32_t width) {
  if (width < 1) throw py::value_error("width must be >= 1");
  const py::object seq = steal(PySequence_Fast(rows.ptr(), "token rows must be a sequence"));
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  py::array_t<int32_t> tokens({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(width)});
  py::array_t<int32_t> lens(n);
  int32_t* out = tokens.mutable_data();
  int32_t* len = lens.mutable_data();
  std::fill_n(out, n * width, 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const py::object row = steal(PySequence_Fast(items[i], "each token row must be a sequence"));
    const Py_ssize_t m = PySequence_Fast_GET_SIZE(row.ptr());
    PyObject** toks = PySequence_Fast_ITEMS(row.ptr());
    for (Py_ssize_t j = 0; j < std::min<Py_ssize_t>(m, width); ++j) {
      const py::object index = steal(PyNumber_Index(toks[j]));  // TypeError for a non-integer
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (overflow != 0 || v < std::numeric_limits<int32_t>::min() ||
          v > std::numeric_limits<int32_t>::max())
        throw py::value_error("token [" + std::to_string(i) + ", " + std::to_string(j) + "] = " +
                              py::str(index).cast<std::string>() + " is not an int32");
      out[i * width + j] = static_cast<int32_t>(v);
    }
    len[i] = static_cast<int32_t>(std::min<Py_ssize_t>(m, std::numeric_limits<int32_t>::max()));
  }
  return py::make_tuple(tokens, lens);
}

}  // namespace

py::list atom_stream_items(const StepOutput& so, py::handle output_type) {
  if (!PyType_Check(output_type.ptr())) throw py::type_error("output_type must be a class");
  auto* type = reinterpret_cast<PyTypeObject*>(output_type.ptr());
  check_output_type(type);
  Py_ssize_t count = 0;
  for (int32_t i = 0; i < so.size(); ++i) count += so.token_offsets[i + 1] > so.token_offsets[i];
  py::list items(count);
  Py_ssize_t k = 0;
  for (int32_t i = 0; i < so.size(); ++i) {
    if (so.token_offsets[i + 1] == so.token_offsets[i]) continue;  // a finish only: not streamed
    const py::object id = steal(PyLong_FromLongLong(so.req_ids[i]));
    const py::object output = steal(stream_output(type, so, i, id.ptr()));
    PyObject* pair = PyTuple_New(2);
    if (pair == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(pair, 0, id.inc_ref().ptr());
    PyTuple_SET_ITEM(pair, 1, output.inc_ref().ptr());
    PyList_SET_ITEM(items.ptr(), k++, pair);
  }
  return items;
}

void bind_compat(py::module_& m) {
  m.def("_token_rows", &token_rows, py::arg("rows"), py::arg("width"),
        "compat.atom: token rows (sequences of ints) as an int32 [rows, width] array padded "
        "with 0 (a longer row cut at `width`), and the rows' true lengths.");
}

}  // namespace atom_sched
