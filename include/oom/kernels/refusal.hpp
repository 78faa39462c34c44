// Why a kernel launcher refused its arguments. Every launcher in include/oom/kernels/ returns
// cudaErrorInvalidValue for arguments it cannot take (docs/kernels.md, "Calls"); the reason, which
// names the launcher and the argument and, for sizes, what it got against what it needs, is kept
// per thread, as ncclGetLastError keeps NCCL's. OOM_CUDA_CHECK puts it in the error it throws, so
//   OOM_CUDA_CHECK(oom::kernels::rmsnorm_backward(..., workspace, 1024, stream));
// reports "rmsnorm_backward: workspace of 1024 bytes, needs 2097152
// (rmsnorm_backward_workspace_bytes(4096, 2048))" instead of a bare cudaErrorInvalidValue.
// Host-parsable; the storage lives in src/cuda/check.cpp.
#pragma once

#include <string>

namespace oom::kernels {

/// The reason for the last refusal on this thread, "" when there was none since it was last
/// cleared or taken. Only a launcher that returned cudaErrorInvalidValue sets it; one that
/// succeeds leaves it as it was.
[[nodiscard]] const char* last_refusal() noexcept;

/// Forgets the reason. OOM_CUDA_CHECK does so before it evaluates its call, so the reason it
/// reports is that call's. detail::throw_launch_error (the layers' checks, after the call) cannot:
/// a reason left by a refusal whose status nobody checked would be blamed on a later, unrelated
/// cudaErrorInvalidValue there. The library checks every status it gets.
void clear_refusal() noexcept;

/// The reason, then forgets it.
[[nodiscard]] std::string take_refusal();

}  // namespace oom::kernels
