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

int32_t warp_size() noexcept {
#if defined(ATOM_SCHED_PLATFORM_HIP)
  // The current device's wavefront size (64 on CDNA, 32 on RDNA): the host pass cannot know the
  // target. Without a device, the CDNA value the module is built for (gfx90a, gfx940).
  int device = 0, lanes = 0;
  if (hipGetDevice(&device) == hipSuccess &&
      hipDeviceGetAttribute(&lanes, hipDeviceAttributeWarpSize, device) == hipSuccess &&
      lanes > 0)
    return lanes;
  (void)hipGetLastError();
  return ATOM_SCHED_WARP_SIZE;
#else
  // CUDA: 32 on every NVIDIA GPU; HIP-CPU: the warp size the kernels were built for.
  return ATOM_SCHED_WARP_SIZE;
#endif
}

}  // namespace atom_sched::device
