// Portability header of the device kernels: the kernels are written with HIP names; under nvcc
// this header maps them to CUDA. Only what the kernels use is mapped. Warp size and warp
// shuffles are wrapped because HIP 5.2 has no __shfl_*_sync and CUDA 13 has no mask-less
// __shfl_up, and AMD CDNA wavefronts are 64 lanes where NVIDIA warps are 32.
//
// Include this only from .hip sources (nvcc compiles them as CUDA with -x cu, hipcc as HIP).
#pragma once

#if defined(__CUDACC__) && !defined(__HIP__)
// ---- nvcc: HIP names -> CUDA --------------------------------------------------------------------
#include <cuda_runtime.h>

#define ATOM_SCHED_PLATFORM_CUDA 1
#define ATOM_SCHED_BACKEND_NAME "cuda"

using hipError_t = cudaError_t;
using hipStream_t = cudaStream_t;
inline constexpr hipError_t hipSuccess = cudaSuccess;

inline hipError_t hipGetLastError() { return cudaGetLastError(); }
inline hipError_t hipPeekAtLastError() { return cudaPeekAtLastError(); }
inline const char* hipGetErrorString(hipError_t e) { return cudaGetErrorString(e); }
inline hipError_t hipGetDeviceCount(int* n) { return cudaGetDeviceCount(n); }

#define ATOM_SCHED_WARP_SIZE 32

template <typename T>
__device__ __forceinline__ T atom_shfl_up(T v, unsigned delta) {
  return __shfl_up_sync(0xffffffffu, v, delta);
}
template <typename T>
__device__ __forceinline__ T atom_shfl_down(T v, unsigned delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
template <typename T>
__device__ __forceinline__ T atom_shfl(T v, int lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}

#elif defined(__HIP__) || defined(__HIPCC__)
// ---- hipcc (AMD) --------------------------------------------------------------------------------
#include <hip/hip_runtime.h>

#define ATOM_SCHED_PLATFORM_HIP 1
#define ATOM_SCHED_BACKEND_NAME "hip"

// The wavefront size of the architecture being compiled (64 on gfx90a/gfx940). The host pass has
// no target; it only needs a value for launch geometry, and every CDNA target is wave64.
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define ATOM_SCHED_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define ATOM_SCHED_WARP_SIZE 64
#endif

template <typename T>
__device__ __forceinline__ T atom_shfl_up(T v, unsigned delta) {
  return __shfl_up(v, delta);
}
template <typename T>
__device__ __forceinline__ T atom_shfl_down(T v, unsigned delta) {
  return __shfl_down(v, delta);
}
template <typename T>
__device__ __forceinline__ T atom_shfl(T v, int lane) {
  return __shfl(v, lane);
}

#else
#error "atom_sched_hip.h: unknown GPU platform: compile .hip sources with nvcc (-x cu) or hipcc"
#endif

#include <cstdint>

#include "atom_sched_kernels.h"

namespace atom_sched::device::detail {

/// Status of the launch just made: the runtime's launch error (configuration, no device, ...).
/// Every launcher goes through this, so a failed launch is always reported, never ignored.
inline Status check_launch(const char* kernel) {
  const hipError_t e = hipGetLastError();
  if (e == hipSuccess) return {};
  return make_status(StatusCode::kLaunchFailed, "%s: launch failed: %s", kernel,
                     hipGetErrorString(e));
}

/// Launches `kernel<<<grid, block, 0, stream>>>(args...)` and checks the launch error.
template <typename Kernel, typename... Args>
Status launch(const char* name, Kernel kernel, unsigned grid, unsigned block, void* stream,
              Args... args) {
  // Clear a stale error left by an earlier, unrelated call so it is not blamed on this launch.
  (void)hipGetLastError();
  kernel<<<grid, block, 0, static_cast<hipStream_t>(stream)>>>(args...);
  return check_launch(name);
}

/// Inclusive scan of `v` across one warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
  for (int d = 1; d < ATOM_SCHED_WARP_SIZE; d <<= 1) {
    const T u = atom_shfl_up(v, static_cast<unsigned>(d));
    if (lane >= d) v += u;
  }
  return v;
}

/// Maximum of `v` across one warp (every lane gets it).
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int d = ATOM_SCHED_WARP_SIZE / 2; d > 0; d >>= 1) {
    const T u = atom_shfl_down(v, static_cast<unsigned>(d));
    v = u > v ? u : v;
  }
  return atom_shfl(v, 0);
}

}  // namespace atom_sched::device::detail
