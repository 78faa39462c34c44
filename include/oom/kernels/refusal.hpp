// Why a kernel launcher refused its arguments. Every launcher in include/oom/kernels/ returns
// cudaErrorInvalidValue for arguments it cannot take (docs/kernels.md, "Calls"); the reason, which
// names the launcher and the argument and, for sizes, what it got against what it needs, is kept
// per thread, as ncclGetLastError keeps NCCL's. OOM_CUDA_CHECK puts it in the error it throws, so
//   OOM_CUDA_CHECK(oom::kernels::rmsnorm_backward(..., workspace, 1024, stream));
// reports "rmsnorm_backward: workspace of 1024 bytes, needs 2097152
// (rmsnorm_backward_workspace_bytes(4096, 2048))" instead of a bare cudaErrorInvalidValue.
// Internal limits met after the checks name the part that found them ("expert GEMMs
// (row_chunked): ..."). A cudaErrorInvalidValue from cuBLAS or the driver's tensor-map encoder
// inside a launcher carries no reason: the arguments were checked first, so it is an internal
// failure and OOM_CUDA_CHECK reports it as a CUDA error.
// Host-parsable; the storage is in src/kernels/refuse.hpp.
#pragma once

#include <string>

namespace oom::kernels {

/// The reason for the last refusal on this thread, "" when there was none since it was last
/// cleared or taken. Only a launcher that returned cudaErrorInvalidValue sets it; one that
/// succeeds leaves it as it was. The pointer is valid until the thread's next refusal, clear or
/// take.
[[nodiscard]] const char* last_refusal() noexcept;

/// Forgets the reason. OOM_CUDA_CHECK does so before it evaluates its call, so the reason it
/// reports is that call's; the decoder layer and the LM ends do so on entry and after each
/// launcher that succeeds. A reason left by a refusal whose status nobody checked would otherwise
/// be blamed on a later, unrelated cudaErrorInvalidValue (oom::detail::throw_launch_error).
void clear_refusal() noexcept;

/// The reason, then forgets it.
[[nodiscard]] std::string take_refusal();

}  // namespace oom::kernels
