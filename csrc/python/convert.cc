#include "convert.h"

namespace atom_sched::py_convert {

namespace {

std::string type_name(py::handle obj) {
  return py::str(py::type::of(obj).attr("__name__")).cast<std::string>();
}

// A numpy array for `obj`: itself if it is one, else numpy.asarray(obj) (lists, tuples, CPU
// torch tensors). Strings are refused up front: they are sequences, but never of token ids.
py::array as_array(py::handle obj, const std::string& what) {
  if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr()))
    throw py::type_error(what + " must be a sequence of ints or an array, got " + type_name(obj));
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  try {
    return py::module_::import("numpy").attr("asarray")(obj);
  } catch (py::error_already_set& e) {
    throw py::type_error(what + " must be a sequence of ints or an array, got " + type_name(obj) +
                         " (" + e.what() + ")");
  }
}

void check_ndim(const py::array& a, int ndim, const std::string& what) {
  const int got = static_cast<int>(a.ndim());
  const bool ok = ndim == 0 ? (got == 1 || got == 2) : got == ndim;
  if (!ok)
    throw py::value_error(what + " must be " +
                          (ndim == 0 ? std::string("1-D or 2-D") : std::to_string(ndim) + "-D") +
                          ", got " + std::to_string(got) + "-D");
}

}  // namespace

Int32Input::Int32Input(py::handle obj, const char* what_c, int ndim) {
  const std::string what(what_c);
  py::array a = as_array(obj, what);
  check_ndim(a, ndim, what);
  ndim_ = static_cast<int>(a.ndim());
  for (int i = 0; i < ndim_; ++i) shape_[i] = a.shape(i);
  size_ = static_cast<size_t>(a.size());
  if (size_ == 0) return;  // an empty list arrives as float64; emptiness is the core's to judge
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(what + " must hold integers, got dtype " +
                         py::str(a.dtype()).cast<std::string>());
  if (a.dtype().is(py::dtype::of<int32_t>()) &&
      (a.flags() & py::array::c_style) == py::array::c_style) {
    keep_ = a;
    data_ = static_cast<const int32_t*>(a.data());
    return;
  }
  auto wide = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!wide) throw py::error_already_set();
  copy_.resize(size_);
  const int64_t* src = wide.data();
  for (size_t i = 0; i < size_; ++i) {
    if (src[i] < INT32_MIN || src[i] > INT32_MAX)
      throw py::value_error(what + " value " + std::to_string(src[i]) + " is outside int32");
    copy_[i] = static_cast<int32_t>(src[i]);
  }
  data_ = copy_.data();
}

Float32Input::Float32Input(py::handle obj, const char* what_c) {
  const std::string what(what_c);
  py::array a = as_array(obj, what);
  check_ndim(a, 0, what);
  ndim_ = static_cast<int>(a.ndim());
  for (int i = 0; i < ndim_; ++i) shape_[i] = a.shape(i);
  size_ = static_cast<size_t>(a.size());
  if (size_ == 0) return;
  if (a.dtype().kind() != 'f')
    throw py::type_error(what + " must hold floats, got dtype " +
                         py::str(a.dtype()).cast<std::string>());
  auto f32 = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!f32) throw py::error_already_set();
  keep_ = f32;
  data_ = f32.data();
}

}  // namespace atom_sched::py_convert
