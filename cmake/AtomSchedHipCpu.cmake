# ATOM_SCHED_GPU=HIP_CPU: the .hip sources, unmodified, compiled by the C++ compiler against AMD's
# header-only HIP CPU Runtime (ATOM_SCHED_HIP_CPU_DIR), which runs each block's threads as fibers
# on the host and the blocks over TBB. What HIP-CPU lacks is handled in hip/atom_sched_hip.h under
# ATOM_SCHED_HIP_CPU (warp-local shuffles, __forceinline__, launches without <<<>>>).
#
#   atom_sched_add_hip_cpu_device(<target> <warp size>)
#     a static library of the launchers, kernels compiled for that warp size (32 or 64).
#   atom_sched_add_hip_cpu_parity_tests()
#     the parity driver (tests/cpp/test_device_parity.cc) once per warp size, each a ctest.
include_guard(GLOBAL)

function(_atom_sched_hip_cpu_find)
  if(NOT ATOM_SCHED_HIP_CPU_DIR OR
     NOT EXISTS "${ATOM_SCHED_HIP_CPU_DIR}/include/hip/hip_runtime.h")
    message(FATAL_ERROR "ATOM_SCHED_GPU=HIP_CPU: no HIP CPU Runtime at "
      "ATOM_SCHED_HIP_CPU_DIR='${ATOM_SCHED_HIP_CPU_DIR}' (set it to the directory holding "
      "include/hip/hip_runtime.h)")
  endif()
  # Debian's libtbb-dev: the parallel algorithms HIP-CPU runs the blocks with.
  find_package(TBB REQUIRED)
  find_package(Threads REQUIRED)
endfunction()

function(atom_sched_add_hip_cpu_device target warp)
  if(NOT warp STREQUAL "32" AND NOT warp STREQUAL "64")
    message(FATAL_ERROR "HIP_CPU warp size must be 32 or 64, not '${warp}'")
  endif()
  _atom_sched_hip_cpu_find()
  # The .hip sources are C++ here: with LANGUAGE CXX set, CMake passes -x c++ itself (the
  # compiler does not know the extension). `#pragma unroll` is for hipcc/nvcc.
  set_source_files_properties(${ATOM_SCHED_HIP_SOURCES} PROPERTIES LANGUAGE CXX)
  add_library(${target} STATIC ${ATOM_SCHED_HIP_SOURCES})
  target_compile_options(${target} PRIVATE -Wno-unknown-pragmas)
  target_include_directories(${target} SYSTEM PUBLIC "${ATOM_SCHED_HIP_CPU_DIR}/include")
  target_include_directories(${target} PRIVATE "${ATOM_SCHED_HIP_DIR}")
  target_compile_definitions(${target} PUBLIC ATOM_SCHED_HIP_CPU=1
                             ATOM_SCHED_HIP_CPU_WARP_SIZE=${warp})
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_link_libraries(${target} PUBLIC atom_sched_device_ref TBB::tbb Threads::Threads
                        ${CMAKE_DL_LIBS})
  atom_sched_target_options(${target})
endfunction()

function(atom_sched_add_hip_cpu_parity_tests)
  set(_src "${CMAKE_SOURCE_DIR}/tests/cpp/test_device_parity.cc")
  foreach(_warp 32 64)
    if(_warp STREQUAL "${ATOM_SCHED_HIP_CPU_WARP_SIZE}")
      set(_lib atom_sched_device)
    else()
      set(_lib atom_sched_device_w${_warp})
      atom_sched_add_hip_cpu_device(${_lib} ${_warp})
    endif()
    set(_exe atom_sched_device_parity_w${_warp})
    add_executable(${_exe} "${_src}")
    target_link_libraries(${_exe} PRIVATE ${_lib})
    atom_sched_target_options(${_exe})
    add_test(NAME device_parity.warp${_warp} COMMAND ${_exe})
    set_tests_properties(device_parity.warp${_warp} PROPERTIES TIMEOUT 900 LABELS hip_cpu)
  endforeach()
endfunction()
