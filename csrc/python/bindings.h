// Registration functions of the _core module, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace atom_sched {
// A cache_salt or lora_name argument: str only, as UTF-8 (bind_config.cc says why).
std::string extra_key_text(pybind11::handle value, const char* field);

void bind_config(pybind11::module_& m);
void bind_scheduler(pybind11::module_& m);
void bind_device(pybind11::module_& m);
void bind_compat(pybind11::module_& m);
// Last: makes every bound type refuse objects made by __new__ without __init__ (init_guard.cc).
void guard_uninitialised_instances(pybind11::module_& m);
}  // namespace atom_sched
