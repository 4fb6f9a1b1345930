// Conversions between Python values and the core's types, shared by the binding files.
// Bad input becomes TypeError (wrong type or dtype) or ValueError (wrong shape or value).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace atom_sched::py_convert {

namespace py = pybind11;

/// An int32 copy of a Python integer sequence or integer array (values outside int32 are a
/// ValueError; containers that are not lists, tuples, ranges or arrays a TypeError).
class Int32Input {
 public:
  /// `ndim` 1 or 2; 0 accepts either. Empty `what` is used in messages.
  Int32Input(py::handle obj, const char* what, int ndim = 1);
  // span() may point into the object itself (small_): neither copied nor moved.
  Int32Input(const Int32Input&) = delete;
  Int32Input& operator=(const Int32Input&) = delete;
  [[nodiscard]] std::span<const int32_t> span() const { return {data_, size_}; }
  [[nodiscard]] int ndim() const { return ndim_; }
  [[nodiscard]] py::ssize_t dim(int i) const { return shape_[i]; }

 private:
  // The caller's values, copied before anything reads them: in small_ when they fit (a decode
  // step's outputs for a few rows), else in copy_.
  std::array<int32_t, 64> small_;
  std::vector<int32_t> copy_;
  const int32_t* data_ = nullptr;
  size_t size_ = 0;
  int ndim_ = 0;
  py::ssize_t shape_[2] = {0, 0};
};

/// A float32 view of a float array (any float dtype is converted). TypeError for other dtypes.
class Float32Input {
 public:
  Float32Input(py::handle obj, const char* what);
  [[nodiscard]] std::span<const float> span() const { return {data_, size_}; }
  [[nodiscard]] int ndim() const { return ndim_; }
  [[nodiscard]] py::ssize_t dim(int i) const { return shape_[i]; }

 private:
  py::array keep_;
  const float* data_ = nullptr;
  size_t size_ = 0;
  int ndim_ = 0;
  py::ssize_t shape_[2] = {0, 0};
};

/// A read-only numpy array over memory owned by `owner` (kept alive as the array's base), of 1 or
/// 2 dimensions. Made with numpy's C API directly: views are made every step, and pybind11's
/// array constructor allocates its shape and strides.
template <typename T>
py::array readonly_view(py::handle owner, const T* data, std::initializer_list<py::ssize_t> shape) {
  constexpr size_t kMaxDims = 2;
  if (shape.size() == 0 || shape.size() > kMaxDims) pybind11::pybind11_fail("readonly_view: ndim");
  Py_intptr_t dims[kMaxDims], strides[kMaxDims];
  const int nd = static_cast<int>(shape.size());
  std::copy(shape.begin(), shape.end(), dims);
  Py_intptr_t stride = sizeof(T);
  for (int i = nd; i-- > 0;) {
    strides[i] = stride;
    stride *= dims[i];
  }
  auto& api = py::detail::npy_api::get();
  PyObject* a = api.PyArray_NewFromDescr_(api.PyArray_Type_, py::dtype::of<T>().release().ptr(),
                                          nd, dims, strides, const_cast<T*>(data), 0, nullptr);
  if (a == nullptr) throw py::error_already_set();
  auto array = py::reinterpret_steal<py::array>(a);
  if (api.PyArray_SetBaseObject_(a, owner.inc_ref().ptr()) != 0) throw py::error_already_set();
  // An empty vector's data() may be null, and numpy then allocates a writeable buffer.
  py::detail::array_proxy(a)->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return array;
}

}  // namespace atom_sched::py_convert
