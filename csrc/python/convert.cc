#include "convert.h"

#include <cstring>
#include <type_traits>

namespace atom_sched::py_convert {

namespace {

std::string type_name(py::handle obj) {
  return py::str(py::type::of(obj).attr("__name__")).cast<std::string>();
}

// Byte strings are not token lists: bytes, bytearray and a memoryview of bytes are refused alike
// (a memoryview over ints, e.g. of an int32 array, is an array like any other).
bool is_byte_string(py::handle obj) {
  if (PyBytes_Check(obj.ptr()) || PyByteArray_Check(obj.ptr())) return true;
  if (!PyMemoryView_Check(obj.ptr())) return false;
  const char* fmt = PyMemoryView_GET_BUFFER(obj.ptr())->format;
  const std::string f = fmt == nullptr ? "B" : fmt;
  return f == "B" || f == "b" || f == "c" || f == "@B" || f == "@b" || f == "@c";
}

// Token containers: arrays (numpy, or anything numpy converts by protocol: torch CPU tensors,
// memoryviews) and lists, tuples and ranges. One-shot iterables (generators), sets, dicts,
// scalars and strings are refused with TypeError before numpy can turn them into 0-D objects.
void check_container(py::handle obj, const char* what) {
  PyObject* o = obj.ptr();
  if (PyUnicode_Check(o) || is_byte_string(obj))
    throw py::type_error(std::string(what) + " must be a sequence of ints or an array, got " +
                         type_name(obj));
  if (PyList_Check(o) || PyTuple_Check(o) || PyRange_Check(o) || PyMemoryView_Check(o)) return;
  if (py::isinstance<py::array>(obj) || py::hasattr(obj, "__array__") ||
      py::hasattr(obj, "__array_interface__") || py::hasattr(obj, "__dlpack__"))
    return;
  throw py::type_error(std::string(what) + " must be a list, tuple or array of ints, got " +
                       type_name(obj));
}

// A numpy array for `obj`: itself if it is one, else numpy.asarray(obj).
py::array as_array(py::handle obj, const char* what) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  check_container(obj, what);
  try {
    return py::module_::import("numpy").attr("asarray")(obj);
  } catch (py::error_already_set& e) {
    throw py::type_error(std::string(what) + " must be a sequence of ints or an array, got " +
                         type_name(obj) + " (" + e.what() + ")");
  }
}

// A flat list, tuple or range of Python ints (anything with __index__) converted directly:
// numpy would guess a dtype (object or float64 for values past 64 bits), so the value's own
// range decides: beyond int32 is a ValueError naming it, a non-integer a TypeError. Returns false
// (nothing read) for a nested sequence, which goes through numpy as a 2-D array.
bool copy_flat_sequence(py::handle obj, const char* what, std::vector<int32_t>& out) {
  py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  const size_t n = py::len(seq);
  if (n == 0) return false;
  if (PyRange_Check(obj.ptr()) == 0) {
    py::handle first = PySequence_Fast_GET_ITEM(py::tuple(seq).ptr(), 0);
    if (PyList_Check(first.ptr()) || PyTuple_Check(first.ptr()) ||
        py::isinstance<py::array>(first))
      return false;
  }
  out.resize(n);
  size_t i = 0;
  for (py::handle item : seq) {
    PyObject* idx = PyNumber_Index(item.ptr());
    if (idx == nullptr) {
      PyErr_Clear();
      throw py::type_error(std::string(what) + " must hold integers, got " + type_name(item));
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (overflow != 0 || v < INT32_MIN || v > INT32_MAX)
      throw py::value_error(std::string(what) + " value " + py::str(item).cast<std::string>() +
                            " is outside int32");
    out[i++] = static_cast<int32_t>(v);
  }
  return true;
}

template <typename Wide>
void copy_checked(const py::array& a, const char* what, int32_t* out, size_t n) {
  auto wide = py::array_t<Wide, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!wide) throw py::error_already_set();
  const Wide* src = wide.data();
  for (size_t i = 0; i < n; ++i) {
    const bool ok = std::is_signed_v<Wide>
                        ? (src[i] >= INT32_MIN && src[i] <= static_cast<Wide>(INT32_MAX))
                        : src[i] <= static_cast<Wide>(INT32_MAX);
    if (!ok)
      throw py::value_error(std::string(what) + " value " + std::to_string(src[i]) +
                            " is outside int32");
    out[i] = static_cast<int32_t>(src[i]);
  }
}

void check_ndim_is(int got, int ndim, const char* what) {
  const bool ok = ndim == 0 ? (got == 1 || got == 2) : got == ndim;
  if (!ok)
    throw py::value_error(std::string(what) + " must be " +
                          (ndim == 0 ? std::string("1-D or 2-D") : std::to_string(ndim) + "-D") +
                          ", got " + std::to_string(got) + "-D");
}

void check_ndim(const py::array& a, int ndim, const char* what) {
  check_ndim_is(static_cast<int>(a.ndim()), ndim, what);
}

}  // namespace

Int32Input::Int32Input(py::handle obj, const char* what, int ndim) {
  // Messages are built only when something is wrong: the common call (a C-contiguous int32
  // array of a few rows) allocates nothing.
  if (!py::isinstance<py::array>(obj)) {
    check_container(obj, what);
    if ((PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr()) || PyRange_Check(obj.ptr())) &&
        copy_flat_sequence(obj, what, copy_)) {
      check_ndim_is(1, ndim, what);
      ndim_ = 1;
      shape_[0] = static_cast<py::ssize_t>(copy_.size());
      size_ = copy_.size();
      data_ = copy_.data();
      return;
    }
  }
  py::array a = as_array(obj, what);
  check_ndim(a, ndim, what);
  ndim_ = static_cast<int>(a.ndim());
  for (int i = 0; i < ndim_; ++i) shape_[i] = a.shape(i);
  size_ = static_cast<size_t>(a.size());
  if (size_ == 0) return;  // an empty list arrives as float64; emptiness is the core's to judge
  // Always a private copy: the core reads these values with the GIL released, so a buffer the
  // caller (or another thread) can still write must not be what is validated and then stored.
  int32_t* dst = small_.data();
  if (size_ > small_.size()) {
    copy_.resize(size_);
    dst = copy_.data();
  }
  data_ = dst;
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(what) + " must hold integers, got dtype " +
                         py::str(a.dtype()).cast<std::string>());
  if (a.dtype().is(py::dtype::of<int32_t>()) &&
      (a.flags() & py::array::c_style) == py::array::c_style) {
    std::memcpy(dst, a.data(), size_ * sizeof(int32_t));
    return;
  }
  if (kind == 'u')
    copy_checked<uint64_t>(a, what, dst, size_);
  else
    copy_checked<int64_t>(a, what, dst, size_);
}

Float32Input::Float32Input(py::handle obj, const char* what) {
  py::array a = as_array(obj, what);
  check_ndim(a, 0, what);
  ndim_ = static_cast<int>(a.ndim());
  for (int i = 0; i < ndim_; ++i) shape_[i] = a.shape(i);
  size_ = static_cast<size_t>(a.size());
  if (size_ == 0) return;
  if (a.dtype().kind() != 'f')
    throw py::type_error(std::string(what) + " must hold floats, got dtype " +
                         py::str(a.dtype()).cast<std::string>());
  auto f32 = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!f32) throw py::error_already_set();
  keep_ = f32;
  data_ = f32.data();
}

}  // namespace atom_sched::py_convert
