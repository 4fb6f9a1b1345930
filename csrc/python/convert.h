// Conversions between Python values and the core's types, shared by the binding files.
// Bad input becomes TypeError (wrong type or dtype) or ValueError (wrong shape or value).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
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

/// A read-only numpy array over memory owned by `owner` (kept alive as the array's base).
template <typename T>
py::array readonly_view(py::handle owner, const T* data, std::vector<py::ssize_t> shape) {
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = sizeof(T);
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  py::array a(py::dtype::of<T>(), std::move(shape), std::move(strides), data, owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

}  // namespace atom_sched::py_convert
