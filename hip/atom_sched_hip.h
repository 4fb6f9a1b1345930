// Portability header of the device kernels: the kernels are written with HIP names; under nvcc
// this header maps them to CUDA. Only what the kernels use is mapped. Warp size and warp
// shuffles are wrapped because HIP 5.2 has no __shfl_*_sync and CUDA 13 has no mask-less
// __shfl_up, and AMD CDNA wavefronts are 64 lanes where NVIDIA warps are 32.
//
// Three back ends: nvcc (-x cu), hipcc (AMD), and HIP-CPU (ATOM_SCHED_HIP_CPU: g++ with AMD's
// header-only HIP CPU Runtime, which runs the kernels' threads as fibers on the host; CI uses it
// to execute the real kernels against the references, docs/device.md).
//
// Include this only from .hip sources.
#pragma once

#if defined(ATOM_SCHED_HIP_CPU)
// ---- HIP-CPU (g++; every block's threads are fibers on one host thread) ------------------------
// Workarounds, for this back end only (the kernels are compiled unmodified):
//  * its __shfl* are block-wide barriers (every fiber of the block yields in turn), so a shuffle
//    in a warp-uniform branch (block_scan2's warp 0) desynchronises the block's barriers: the
//    shuffles here exchange through a per-thread scratch and wait only for the calling warp;
//  * __forceinline__ expands to nothing without NDEBUG (multiple definitions at -O0), and
//    __device__/__global__ carry g++'s `simd` attribute (vector clones, warnings): plain here;
//  * no <<<>>> under g++ (detail::launch uses hipLaunchKernelGGL), no graphs, no stream capture;
//  * its null stream does not keep launch order: launches go to a stream of our own and complete
//    before the launcher returns (detail::launch, hip_cpu::ordered_stream);
//  * warpSize is a constexpr 64 there; ATOM_SCHED_WARP_SIZE (32 or 64) is chosen by the build
//    (ATOM_SCHED_HIP_CPU_WARP_SIZE), so both NVIDIA's and AMD's lane counts are exercised.
#include <hip/hip_runtime.h>

#undef __forceinline__
#define __forceinline__ inline
#undef __device__
#define __device__
#undef __global__
#define __global__ __attribute__((flatten))  // without g++'s `simd` (no vector clones of a kernel)

#define ATOM_SCHED_PLATFORM_HIP_CPU 1
#define ATOM_SCHED_BACKEND_NAME "hip-cpu"

#if !defined(ATOM_SCHED_HIP_CPU_WARP_SIZE)
#define ATOM_SCHED_HIP_CPU_WARP_SIZE 64
#endif
#define ATOM_SCHED_WARP_SIZE ATOM_SCHED_HIP_CPU_WARP_SIZE
static_assert(ATOM_SCHED_WARP_SIZE == 32 || ATOM_SCHED_WARP_SIZE == 64,
              "ATOM_SCHED_HIP_CPU_WARP_SIZE must be 32 or 64");

namespace atom_sched::device::detail::hip_cpu {

inline constexpr unsigned kMaxBlockThreads = 1024;

/// This thread's index in its block (HIP-CPU: the fiber's id).
inline unsigned thread_id() noexcept { return id(::hip::detail::Fiber::this_fiber()); }

/// A barrier among the calling warp's lanes only: each lane yields to the next lane of its own
/// warp, so the lanes pass it in turn and the rest of the block is not involved (HIP-CPU's own
/// barrier walks every fiber of the block). Every lane of the warp must reach it.
inline void warp_barrier() noexcept {
  using ::hip::detail::Fiber;
  using ::hip::detail::Tile;
  const unsigned threads = count(Tile::this_tile().dimensions());  // found by ADL
  const unsigned self = thread_id();
  const unsigned base = self / ATOM_SCHED_WARP_SIZE * ATOM_SCHED_WARP_SIZE;
  const unsigned lanes =
      threads - base < ATOM_SCHED_WARP_SIZE ? threads - base : ATOM_SCHED_WARP_SIZE;
  if (lanes <= 1) return;
  ::hip::detail::this_tile::has_barrier = true;  // the block runs as fibers from now on
  Fiber::yield(Tile::fibers()[base + (self - base + 1) % lanes]);
}

/// One word per thread of the block (fibers of a block share their host thread).
template <typename T>
inline T* scratch() noexcept {
  thread_local T words[kMaxBlockThreads];
  return words;
}

/// The value of lane `src` of the calling warp (src outside the warp: the caller's own value).
template <typename T>
inline T shuffle_from(T v, long src) noexcept {
  const unsigned self = thread_id();
  const unsigned base = self / ATOM_SCHED_WARP_SIZE * ATOM_SCHED_WARP_SIZE;
  T* s = scratch<T>();
  s[self] = v;
  warp_barrier();
  const T r = (src >= 0 && src < ATOM_SCHED_WARP_SIZE) ? s[base + src] : v;
  warp_barrier();  // nobody overwrites its word before every lane has read
  return r;
}

}  // namespace atom_sched::device::detail::hip_cpu

template <typename T>
__device__ __forceinline__ T atom_shfl_up(T v, unsigned delta) {
  const long lane = atom_sched::device::detail::hip_cpu::thread_id() % ATOM_SCHED_WARP_SIZE;
  return atom_sched::device::detail::hip_cpu::shuffle_from(v, lane - static_cast<long>(delta));
}
template <typename T>
__device__ __forceinline__ T atom_shfl_down(T v, unsigned delta) {
  const long lane = atom_sched::device::detail::hip_cpu::thread_id() % ATOM_SCHED_WARP_SIZE;
  return atom_sched::device::detail::hip_cpu::shuffle_from(v, lane + static_cast<long>(delta));
}
template <typename T>
__device__ __forceinline__ T atom_shfl(T v, int lane) {
  return atom_sched::device::detail::hip_cpu::shuffle_from(v, lane);
}

#elif defined(__CUDACC__) && !defined(__HIP__)
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

// The wavefront size of the target being compiled, from the architecture predicates (as ggml's
// HIP header does): GFX9 (GCN5 and CDNA: gfx90a, gfx940, gfx942) and older are wave64, RDNA
// (GFX10 and later) wave32. __AMDGCN_WAVEFRONT_SIZE is deprecated (ROCm 7) and no longer
// predefined by recent clang; where it is, it must agree (RDNA built with -mwavefrontsize64 is
// refused rather than scanned with the wrong lane count). The host pass has no target: device
// code parsed there never runs, and the host-side warp_size() asks the device (runtime.hip).
// (The host pass predefines __AMDGCN__ too: __HIP_DEVICE_COMPILE__ marks the device pass.)
#if !defined(__HIP_DEVICE_COMPILE__)
#define ATOM_SCHED_WARP_SIZE 64
#elif defined(__GFX9__) || defined(__GFX8__) || defined(__GFX7__) || defined(__GFX6__)
#define ATOM_SCHED_WARP_SIZE 64
#else
#define ATOM_SCHED_WARP_SIZE 32
#endif
#if defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN_WAVEFRONT_SIZE)
#if defined(__has_warning)
#if __has_warning("-Wdeprecated-pragma")
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-pragma"
#define ATOM_SCHED_POP_DIAGNOSTIC 1
#endif
#endif
static_assert(ATOM_SCHED_WARP_SIZE == __AMDGCN_WAVEFRONT_SIZE,
              "the architecture's wavefront size and the compiler's disagree (wave64 on RDNA?)");
#if defined(ATOM_SCHED_POP_DIAGNOSTIC)
#pragma clang diagnostic pop
#undef ATOM_SCHED_POP_DIAGNOSTIC
#endif
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

#if defined(ATOM_SCHED_PLATFORM_HIP_CPU)
namespace hip_cpu {

/// The stream every launch of a caller without a stream goes to. HIP-CPU's null stream does not
/// keep launch order: its processor drains the null stream from two places at once (the
/// std::async task of wait_all_streams_ and the parallel loop over every stream, the null one
/// included), so when the host pauses between two launches (a loaded machine), the second kernel
/// can run concurrently with, or before, the first: build_inputs read apply_plan's meta and
/// row scans half-written (the parity driver's `errors: kernel 40`, docs/device.md). A created
/// stream is drained by one task at a time, in order. Created once, never destroyed (the runtime
/// outlives every launch).
inline hipStream_t ordered_stream() noexcept {
  static const hipStream_t s = [] {
    hipStream_t x = nullptr;
    if (hipStreamCreate(&x) != hipSuccess) x = nullptr;
    (void)hipGetLastError();
    return x;
  }();
  return s;
}

}  // namespace hip_cpu
#endif

/// Launches `kernel<<<grid, block, 0, stream>>>(args...)` and checks the launch error.
template <typename Kernel, typename... Args>
Status launch(const char* name, Kernel kernel, unsigned grid, unsigned block, void* stream,
              Args... args) {
  // Clear a stale error left by an earlier, unrelated call so it is not blamed on this launch.
  (void)hipGetLastError();
#if defined(ATOM_SCHED_PLATFORM_HIP_CPU)
  // HIP-CPU: on an ordered stream (never the null stream, see ordered_stream), and complete when
  // the launcher returns: "device" memory is host memory here, read and written by host code
  // (the parity driver, torch's CPU tensors) that no HIP-CPU stream orders. So a launch also
  // never overlaps the previous one, whatever stream the caller passed.
  const hipStream_t s = stream != nullptr ? static_cast<hipStream_t>(stream)
                                          : hip_cpu::ordered_stream();
  hipLaunchKernelGGL(kernel, dim3(grid), dim3(block), 0, s, args...);
  if (Status st = check_launch(name); !st.ok()) return st;
  const hipError_t e = s != nullptr ? hipStreamSynchronize(s) : hipDeviceSynchronize();
  if (e == hipSuccess) return {};
  return make_status(StatusCode::kLaunchFailed, "%s: synchronize failed: %s", name,
                     hipGetErrorString(e));
#else
  kernel<<<grid, block, 0, static_cast<hipStream_t>(stream)>>>(args...);
  return check_launch(name);
#endif
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
