// Runtime queries of a GPU build: back end, device count, warp size.
#include "atom_sched_hip.h"

#include "atom_sched_kernels.h"

namespace atom_sched::device {

const char* backend_name() noexcept { return ATOM_SCHED_BACKEND_NAME; }

int32_t device_count() noexcept {
  int n = 0;
  // Without a driver CUDA answers cudaErrorInsufficientDriver, not "no device": any error means
  // no usable device. Clear it so it is not reported by a later launch check.
  if (hipGetDeviceCount(&n) != hipSuccess) {
    (void)hipGetLastError();
    return 0;
  }
  return n;
}

int32_t warp_size() noexcept { return ATOM_SCHED_WARP_SIZE; }

}  // namespace atom_sched::device
