// tensor_like: what OOM needs to know about a tensor, through the tensor_traits<T> customization
// point, so a framework's own tensor type plugs in without inheriting from anything of ours.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"
#include "oom/core/error.hpp"
#include "oom/core/memory_space.hpp"

namespace oom {

/// Customization point: specialise for your tensor type T with four static functions
///   1. `data(const T&)`  -> a pointer convertible to `const void*` (the first element);
///   2. `dtype(const T&)` -> `oom::DType`;
///   3. `shape(const T&)` -> a sized range of integers (extents, outermost first; dense row-major);
///   4. `space(const T&)` -> `oom::MemorySpace` (which GPU, pinned or pageable host).
/// Optional: `bytes(const T&)` -> `oom::Bytes` when storage is not elements × element size.
///
/// A type may instead opt in from inside by declaring `using oom_tensor_tag = void;` and member
/// functions data(), dtype(), shape(), space(); the primary template then forwards to them.
///
/// **Customization**
/// @code
///   template <> struct oom::tensor_traits<my::Tensor> {
///     static void* data(const my::Tensor& t) { return t.raw(); }
///     static oom::DType dtype(const my::Tensor& t) { return to_oom(t.scalar_type()); }
///     static const std::vector<long>& shape(const my::Tensor& t) { return t.sizes(); }
///     static oom::MemorySpace space(const my::Tensor& t) {
///       return t.is_cuda() ? oom::MemorySpace::device(t.device()) : oom::MemorySpace::pageable_host();
///     }
///   };
/// @endcode
/// @see tensor_like, TensorView, tests/concepts/test_tensor.cpp
template <class T>
struct tensor_traits {};

template <class T>
  requires requires { typename T::oom_tensor_tag; }
struct tensor_traits<T> {
  static auto data(const T& t) { return t.data(); }
  static DType dtype(const T& t) { return t.dtype(); }
  static decltype(auto) shape(const T& t) { return t.shape(); }
  static MemorySpace space(const T& t) { return t.space(); }
};

/// A type OOM can read and move: it has a tensor_traits with requirements 1-4 above.
template <class T>
concept tensor_like = requires(const std::remove_cvref_t<T>& t) {
  { tensor_traits<std::remove_cvref_t<T>>::data(t) } -> std::convertible_to<const void*>;
  { tensor_traits<std::remove_cvref_t<T>>::dtype(t) } -> std::same_as<DType>;
  { tensor_traits<std::remove_cvref_t<T>>::shape(t) } -> std::ranges::sized_range;
  requires std::convertible_to<
      std::ranges::range_value_t<decltype(tensor_traits<std::remove_cvref_t<T>>::shape(t))>, std::int64_t>;
  { tensor_traits<std::remove_cvref_t<T>>::space(t) } -> std::same_as<MemorySpace>;
};

// Accessors every OOM component uses instead of touching a tensor type directly.
template <tensor_like T>
const void* data_of(const T& t) {
  return tensor_traits<std::remove_cvref_t<T>>::data(t);
}
template <tensor_like T>
DType dtype_of(const T& t) {
  return tensor_traits<std::remove_cvref_t<T>>::dtype(t);
}
template <tensor_like T>
MemorySpace space_of(const T& t) {
  return tensor_traits<std::remove_cvref_t<T>>::space(t);
}
template <tensor_like T>
std::uint64_t numel(const T& t) {
  std::uint64_t n = 1;
  for (auto d : tensor_traits<std::remove_cvref_t<T>>::shape(t)) n *= static_cast<std::uint64_t>(d);
  return n;
}
template <tensor_like T>
Bytes nbytes(const T& t) {
  using Tr = tensor_traits<std::remove_cvref_t<T>>;
  if constexpr (requires { { Tr::bytes(t) } -> std::same_as<Bytes>; })
    return Tr::bytes(t);
  else
    return bytes_of(dtype_of(t), numel(t));
}

/// OOM's own non-owning tensor view (up to 6 dimensions), itself tensor_like.
class TensorView {
 public:
  using oom_tensor_tag = void;
  static constexpr int max_rank = 6;

  TensorView() = default;
  TensorView(void* data, DType dtype, std::span<const std::int64_t> shape, MemorySpace space)
      : data_(data), dtype_(dtype), rank_(static_cast<int>(shape.size())), space_(space) {
    if (shape.size() > max_rank)
      OOM_THROW(Errc::invalid_argument, "TensorView holds at most 6 dimensions, got " + std::to_string(shape.size()));
    for (int i = 0; i < rank_; ++i) dims_[static_cast<std::size_t>(i)] = shape[static_cast<std::size_t>(i)];
  }
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape, MemorySpace space)
      : TensorView(data, dtype, std::span<const std::int64_t>(shape.begin(), shape.size()), space) {}

  [[nodiscard]] void* data() const { return data_; }
  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] std::span<const std::int64_t> shape() const { return {dims_.data(), static_cast<std::size_t>(rank_)}; }
  [[nodiscard]] MemorySpace space() const { return space_; }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::fp32;
  std::array<std::int64_t, max_rank> dims_{};
  int rank_ = 0;
  MemorySpace space_{};
};

static_assert(tensor_like<TensorView>, "TensorView must model tensor_like");

}  // namespace oom
