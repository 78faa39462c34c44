// OOM_NVTX_SCOPE("name"): an NVTX range for Nsight Systems over the enclosing scope. Compiles to
// nothing unless OOM_ENABLE_NVTX is defined to 1 and the CUDA toolkit's nvtx3 headers are found
// (oom::cuda defines it when configured with OOM_ENABLE_NVTX=ON).
#pragma once

#if defined(OOM_ENABLE_NVTX) && OOM_ENABLE_NVTX && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define OOM_NVTX_ACTIVE 1
#else
#define OOM_NVTX_ACTIVE 0
#endif

namespace oom {

inline constexpr bool nvtx_enabled = OOM_NVTX_ACTIVE != 0;

#if OOM_NVTX_ACTIVE
class NvtxScope {
 public:
  explicit NvtxScope(const char* name) { nvtxRangePushA(name); }
  ~NvtxScope() { nvtxRangePop(); }
  NvtxScope(const NvtxScope&) = delete;
  NvtxScope& operator=(const NvtxScope&) = delete;
};
#endif

}  // namespace oom

#define OOM_CONCAT_INNER(a, b) a##b
#define OOM_CONCAT(a, b) OOM_CONCAT_INNER(a, b)
#if OOM_NVTX_ACTIVE
#define OOM_NVTX_SCOPE(name) ::oom::NvtxScope OOM_CONCAT(oom_nvtx_scope_, __LINE__){name}
#else
#define OOM_NVTX_SCOPE(name) static_cast<void>(0)
#endif
