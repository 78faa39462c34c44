// Without OOM_ENABLE_NVTX the scope macro compiles to nothing and pulls in no CUDA header.
#include <doctest/doctest.h>

#include "oom/core/memory_space.hpp"
#include "oom/core/nvtx.hpp"

#if OOM_NVTX_ACTIVE
#error "host tests are built without OOM_ENABLE_NVTX; the NVTX scope must compile away"
#endif

TEST_CASE("an NVTX scope in host-only code is free") {
  static_assert(!oom::nvtx_enabled);
  int work = 0;
  {
    OOM_NVTX_SCOPE("host work");
    ++work;
  }
  CHECK(work == 1);
}

TEST_CASE("memory spaces say where bytes live") {
  using oom::MemorySpace;
  CHECK(MemorySpace::device(2).is_device());
  CHECK(MemorySpace::device(2).device_index == 2);
  CHECK(MemorySpace::pinned_host().is_dma_capable());
  CHECK_FALSE(MemorySpace::pageable_host().is_dma_capable());
  CHECK(MemorySpace::device(0) != MemorySpace::device(1));
  CHECK(oom::to_string(MemorySpace::device(3)) == "cuda:3");
}
