// A consumer's own CUDA translation unit: must compile as C++20 (a concept below) with OOM's
// CUDA-facing headers included.
#include <concepts>

#include <oom/core/cuda_check.hpp>
#include <oom/model/segment.hpp>

template <class T>
concept small_scalar = std::floating_point<T> && sizeof(T) <= 4;

template <small_scalar T>
__global__ void fill(T* out, T value, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value;
}

int consumer_kernel_launches() {
  // Not launched (the package test also runs where there is no GPU); taking its address is
  // enough to instantiate and compile it.
  auto kernel = &fill<float>;
  return kernel != nullptr ? 1 : 0;
}
