// cuda_pipeline_primitives.h for the sim: CUDA's C++ forms of cp.async with the same group
// semantics as the PTX (a copy lands in shared memory only when a wait covers its group; until
// then the destination holds poison). NVIDIA's header copies at once on its host path, which would
// hide a kernel that reads its tile before waiting. Found ahead of NVIDIA's (the sim's include
// directories come first); NVRTC builds use NVIDIA's.
#pragma once
namespace cupaged_sim {
namespace ptx {
inline void pipeline_memcpy_async(int line, void* dst_shared, const void* src_global, size_t size_and_align,
                                  size_t zfill = 0) {
  if (size_and_align != 4 && size_and_align != 8 && size_and_align != 16)
    fail(E_MEMORY, line, "__pipeline_memcpy_async: size_and_align must be 4, 8 or 16, got %zu", size_and_align);
  if (zfill > size_and_align) fail(E_MEMORY, line, "__pipeline_memcpy_async: zfill %zu > size %zu", zfill, size_and_align);
  cp_async(to_shared(dst_shared, line), reinterpret_cast<uintptr_t>(src_global), unsigned(size_and_align),
           (long long)(size_and_align - zfill), line, "__pipeline_memcpy_async");
}
}  // namespace ptx
}  // namespace cupaged_sim
#define __pipeline_memcpy_async(...) ::cupaged_sim::ptx::pipeline_memcpy_async(__LINE__, __VA_ARGS__)
inline void __pipeline_commit() { ::cupaged_sim::ptx::cp_async_commit(); }
inline void __pipeline_wait_prior(size_t prior) { ::cupaged_sim::ptx::cp_async_wait(prior); }
