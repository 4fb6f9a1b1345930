// Objects made by `Cls.__new__(Cls)` without `__init__` hold uninitialised C++ memory (pybind11
// allocates the value lazily and never constructs it). Reading one would crash or return garbage,
// so every bound type of the module refuses such an object with a TypeError: its attribute
// lookups and assignments (a setter writes into the unconstructed value: a std::vector member
// crashed) and the slots Python calls directly (len, repr, iter, [], ==, hash) first ask whether
// pybind11 registered the instance, which it does when any constructor, `__setstate__` (pickle)
// or a C++ return made it. Subclasses defined in Python (connectors) are left to pybind11's own
// "__init__ must be called" check.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "bindings.h"

namespace atom_sched {

namespace py = pybind11;

namespace {

struct Slots {
  getattrofunc getattro;
  setattrofunc setattro;
  reprfunc repr;
  reprfunc str;
  lenfunc mp_length;
  lenfunc sq_length;
  getiterfunc iter;
  binaryfunc subscript;
  richcmpfunc richcompare;
  hashfunc hash;
};

// The original slots by bound type, in a small open-addressed table: every attribute lookup on
// every bound object passes through a wrapper here, so finding its type's slots must cost a few
// instructions (a std::unordered_map lookup hashed with a division). Written at module import,
// read under the GIL.
class SlotTable {
 public:
  [[nodiscard]] const Slots* find(PyTypeObject* t) const {
    for (size_t i = index(t);; i = (i + 1) % kCapacity) {
      if (keys_[i] == t) return &slots_[i];
      if (keys_[i] == nullptr) return nullptr;
    }
  }
  void insert(PyTypeObject* t, const Slots& s) {
    if (++size_ >= kCapacity) throw std::runtime_error("init_guard: too many bound types");
    size_t i = index(t);
    while (keys_[i] != nullptr) i = (i + 1) % kCapacity;
    keys_[i] = t;
    slots_[i] = s;
  }

 private:
  static constexpr size_t kCapacity = 128;  // a power of two, far above the module's types
  static size_t index(PyTypeObject* t) {
    return (reinterpret_cast<uintptr_t>(t) >> 4) % kCapacity;
  }
  PyTypeObject* keys_[kCapacity] = {};
  Slots slots_[kCapacity] = {};
  size_t size_ = 0;
};

SlotTable& originals() {
  static auto* table = new SlotTable();  // lives as long as the module
  return *table;
}

// The original slots of the exact bound type of `self`, or nullptr for a Python subclass.
const Slots* slots_of(PyObject* self) { return originals().find(Py_TYPE(self)); }

bool initialised(PyObject* self) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  return inst->get_value_and_holder().instance_registered();
}

// Nonzero (and a TypeError set) if `self` is an exact bound type's object never initialised.
int refuse_uninitialised(PyObject* self) {
  if (initialised(self) || slots_of(self) == nullptr) return 0;
  PyErr_Format(PyExc_TypeError,
               "%s object is not initialised (made by __new__ without __init__); "
               "construct it with %s(...)",
               Py_TYPE(self)->tp_name, Py_TYPE(self)->tp_name);
  return 1;
}

// The original slot of the nearest bound type in self's MRO (subclasses inherit the wrappers).
const Slots& base_slots(PyObject* self) {
  for (PyTypeObject* t = Py_TYPE(self); t != nullptr; t = t->tp_base) {
    if (const Slots* s = originals().find(t)) return *s;
  }
  // Unreachable: the wrappers are ours.
  static const Slots generic = [] {
    Slots g{};
    g.getattro = PyObject_GenericGetAttr;
    g.setattro = PyObject_GenericSetAttr;
    return g;
  }();
  return generic;
}

bool name_allowed(PyObject* name) {
  // What pickle, copy and construction need on an object that is not initialised yet.
  for (const char* ok : {"__init__", "__setstate__", "__class__"})
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, ok) == 0) return true;
  return false;
}

PyObject* guarded_getattro(PyObject* self, PyObject* name) {
  if (!initialised(self) && !name_allowed(name) && refuse_uninitialised(self)) return nullptr;
  return base_slots(self).getattro(self, name);
}
int guarded_setattro(PyObject* self, PyObject* name, PyObject* value) {
  if (refuse_uninitialised(self)) return -1;
  return base_slots(self).setattro(self, name, value);
}
PyObject* guarded_repr(PyObject* self) {
  return refuse_uninitialised(self) ? nullptr : base_slots(self).repr(self);
}
PyObject* guarded_str(PyObject* self) {
  return refuse_uninitialised(self) ? nullptr : base_slots(self).str(self);
}
Py_ssize_t guarded_mp_length(PyObject* self) {
  return refuse_uninitialised(self) ? -1 : base_slots(self).mp_length(self);
}
Py_ssize_t guarded_sq_length(PyObject* self) {
  return refuse_uninitialised(self) ? -1 : base_slots(self).sq_length(self);
}
PyObject* guarded_iter(PyObject* self) {
  return refuse_uninitialised(self) ? nullptr : base_slots(self).iter(self);
}
PyObject* guarded_subscript(PyObject* self, PyObject* key) {
  return refuse_uninitialised(self) ? nullptr : base_slots(self).subscript(self, key);
}
PyObject* guarded_richcompare(PyObject* self, PyObject* other, int op) {
  return refuse_uninitialised(self) ? nullptr : base_slots(self).richcompare(self, other, op);
}
Py_hash_t guarded_hash(PyObject* self) {
  return refuse_uninitialised(self) ? -1 : base_slots(self).hash(self);
}

void guard_type(PyTypeObject* t) {
  Slots s{t->tp_getattro, t->tp_setattro, t->tp_repr, t->tp_str, nullptr, nullptr,
          t->tp_iter,      nullptr,         t->tp_richcompare, t->tp_hash};
  if (t->tp_as_mapping != nullptr) {
    s.mp_length = t->tp_as_mapping->mp_length;
    s.subscript = t->tp_as_mapping->mp_subscript;
  }
  if (t->tp_as_sequence != nullptr) s.sq_length = t->tp_as_sequence->sq_length;
  originals().insert(t, s);
  t->tp_getattro = guarded_getattro;
  if (s.setattro != nullptr) t->tp_setattro = guarded_setattro;
  if (s.repr != nullptr) t->tp_repr = guarded_repr;
  if (s.str != nullptr) t->tp_str = guarded_str;
  if (s.iter != nullptr) t->tp_iter = guarded_iter;
  if (s.richcompare != nullptr) t->tp_richcompare = guarded_richcompare;
  if (s.hash != nullptr && s.hash != PyObject_HashNotImplemented) t->tp_hash = guarded_hash;
  if (s.mp_length != nullptr) t->tp_as_mapping->mp_length = guarded_mp_length;
  if (s.subscript != nullptr) t->tp_as_mapping->mp_subscript = guarded_subscript;
  if (s.sq_length != nullptr) t->tp_as_sequence->sq_length = guarded_sq_length;
  PyType_Modified(t);
}

}  // namespace

void guard_uninitialised_instances(py::module_& m) {
  for (auto item : m.attr("__dict__").cast<py::dict>()) {
    py::handle v = item.second;
    if (!PyType_Check(v.ptr())) continue;
    auto* t = reinterpret_cast<PyTypeObject*>(v.ptr());
    if (py::detail::get_type_info(t) == nullptr || originals().find(t) != nullptr) continue;
    guard_type(t);
  }
}

}  // namespace atom_sched
