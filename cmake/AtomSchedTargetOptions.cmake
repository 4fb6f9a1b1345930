# Compile and link settings shared by every atom_sched target (core, module, tests, benchmarks).
#
#   atom_sched_target_options(<target>)
#     - warnings -Wall -Wextra (GCC/Clang) or /W4 (MSVC) on the target's own sources;
#     - when ATOM_SCHED_SANITIZE is ON: AddressSanitizer + UndefinedBehaviorSanitizer, aborting on
#       the first UB report (-fno-sanitize-recover=all) so a ctest run fails instead of only
#       printing.
include_guard(GLOBAL)

set(ATOM_SCHED_SANITIZER_FLAGS
    -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)

function(atom_sched_target_options target)
  if(MSVC)
    target_compile_options(${target} PRIVATE /W4)
  else()
    target_compile_options(${target} PRIVATE -Wall -Wextra)
  endif()
  if(ATOM_SCHED_SANITIZE)
    if(MSVC)
      message(FATAL_ERROR "ATOM_SCHED_SANITIZE supports GCC and Clang only")
    endif()
    target_compile_options(${target} PRIVATE ${ATOM_SCHED_SANITIZER_FLAGS})
    target_link_options(${target} PRIVATE ${ATOM_SCHED_SANITIZER_FLAGS})
  endif()
endfunction()
