// oom-layer-check: runs one Qwen3-MoE decoder layer (oom/model/cuda_decoder_layer.hpp) forward and
// backward on the GPU on given weights and inputs, and writes everything it computed, so a script
// can compare it with another implementation (scripts/compare_decoder_layer.py: transformers).
//
//   oom-layer-check --config config.json --in in.safetensors --out out.safetensors [--layer N]
//
// in.safetensors holds the layer's weights under their Hugging Face names
// (model.layers.N.self_attn.q_proj.weight, ..., model.layers.N.mlp.experts.E.down_proj.weight;
// BF16, or F32 rounded to bf16 here), `input` (T, H) and `grad_output` (T, H) (BF16 or F32).
// out.safetensors (written atomically) holds, all F32: `output` (T, H), `grad_input` (T, H),
// `grad.<name>` for every parameter, and the routing: `routing.weights` (T, k) F32 and
// `routing.expert_ids` (T, k) I32.
//
// The weights are uploaded the way the runtime holds them: one device block per state segment,
// its tensors back to back in ModelSpec's order, bound with bind_decoder_layer_params.
//
// Exit status: 0 written, 1 an error (named), 2 bad arguments or no GPU.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/cli_numbers.hpp"
#include "common/output_path.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/core/numeric.hpp"
#include "oom/cuda/device.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/model/cuda_decoder_layer.hpp"
#include "oom/model/model_spec.hpp"

namespace {

using namespace oom;

constexpr const char* kUsage =
    "usage: oom-layer-check --config config.json --in in.safetensors --out out.safetensors [--layer N]\n"
    "  --config PATH  the model's config.json (model_type qwen3_moe)\n"
    "  --in PATH      the layer's weights (HF names), `input` (T, H) and `grad_output` (T, H)\n"
    "  --out PATH     written: output, grad_input, grad.<hf name> per parameter, routing.* (all F32 but ids)\n"
    "  --layer N      which decoder layer's weights to read (default 0)\n";

struct UsageError {
  std::string what;
};

struct Options {
  std::string config, in, out;
  int layer = 0;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError{a + " needs a value"};
      return argv[++i];
    };
    if (a == "--config") o.config = oom::examples::path_argument(a, value());
    else if (a == "--in") o.in = oom::examples::path_argument(a, value());
    else if (a == "--out") o.out = oom::examples::path_argument(a, value());
    else if (a == "--layer") o.layer = oom::examples::parse_int_count(a, value(), /*allow_zero=*/true);  // stoi took " -1" and "2x"
    else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      throw UsageError{"unknown argument " + a};
    }
  }
  if (o.config.empty() || o.in.empty() || o.out.empty()) throw UsageError{"--config, --in and --out are required"};
  oom::examples::require_output_file("--out", o.out);
  oom::examples::refuse_overlapping_paths({{"--out", o.out}}, {{"--config", o.config}, {"--in", o.in}});
  return o;
}

/// One cudaMalloc'd buffer, freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0) OOM_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  template <class T = void>
  [[nodiscard]] T* get() const {
    return static_cast<T*>(ptr_);
  }
  [[nodiscard]] std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// A file tensor's elements as bf16 (BF16 copied, F32 rounded); anything else is refused by name.
void to_bf16(const SafetensorsFile& file, const std::string& name, DType dtype, std::span<const std::byte> bytes, bf16* out,
             std::uint64_t elements) {
  if (dtype == DType::bf16) {
    std::memcpy(out, bytes.data(), elements * sizeof(bf16));
  } else if (dtype == DType::fp32) {
    for (std::uint64_t i = 0; i < elements; ++i) {
      float f;
      std::memcpy(&f, bytes.data() + i * sizeof(float), sizeof(float));
      out[i] = oom::to_bf16(f);
    }
  } else {
    throw Error(Errc::parse, fmt::format("{}: tensor '{}' is {}; expected BF16 or F32", file.source(), name,
                                         safetensors_dtype_name(dtype)));
  }
}

/// `name` of shape (rows, cols), as bf16.
std::vector<bf16> read_matrix(const SafetensorsFile& file, const std::string& name, std::uint64_t cols, std::uint64_t* rows) {
  const SafetensorsTensor& t = file.at(name);
  if (t.shape.size() != 2 || t.shape[1] != cols)
    throw Error(Errc::parse, fmt::format("{}: tensor '{}' has shape [{}]; expected [T, {}] (T tokens, hidden size {})",
                                         file.source(), name, fmt::join(t.shape, ", "), cols, cols));
  if (*rows != 0 && t.shape[0] != *rows)
    throw Error(Errc::parse, fmt::format("{}: tensor '{}' has {} rows; 'input' has {}", file.source(), name, t.shape[0], *rows));
  *rows = t.shape[0];
  std::vector<bf16> v(t.elements());
  to_bf16(file, name, t.dtype, t.data, v.data(), v.size());
  return v;
}

std::vector<float> download_bf16(const bf16* d, std::size_t n) {
  std::vector<bf16> h(n);
  OOM_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (std::size_t i = 0; i < n; ++i) f[i] = oom::to_float(h[i]);
  return f;
}

template <class T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> h(n);
  OOM_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <class T>
SafetensorsEntry entry(std::string name, DType dtype, std::vector<std::uint64_t> shape, const std::vector<T>& data) {
  return SafetensorsEntry::view(std::move(name), dtype, std::move(shape),
                                std::as_bytes(std::span<const T>(data.data(), data.size())));
}

int run(const Options& o) {
  const ModelSpec spec = ModelSpec::from_file(o.config);
  const SafetensorsFile file = SafetensorsFile::open(o.in);
  const auto H = spec.hidden_size();

  std::uint64_t T = 0;
  const std::vector<bf16> x_host = read_matrix(file, "input", H, &T);
  const std::vector<bf16> dy_host = read_matrix(file, "grad_output", H, &T);
  model::DecoderLayerShape shape = model::DecoderLayerShape::from_spec(spec, o.layer, static_cast<std::int64_t>(T));
  // One layer's output and gradients, as transformers' decoder layer gives them: the
  // load-balancing loss, a term of the model's loss over every layer, is not part of them.
  shape.router_aux_loss_coef = 0;
  std::printf("layer %d: T=%lld H=%lld heads %lld/%lld x %lld, %lld experts top-%lld, I=%lld, norm_topk_prob=%d\n", o.layer,
              static_cast<long long>(shape.tokens), static_cast<long long>(shape.hidden), static_cast<long long>(shape.heads_q),
              static_cast<long long>(shape.heads_kv), static_cast<long long>(shape.head_dim),
              static_cast<long long>(shape.experts), static_cast<long long>(shape.top_k),
              static_cast<long long>(shape.intermediate), shape.norm_topk_prob ? 1 : 0);

  // Weights: one device block per segment (bf16), gradients likewise (fp32, zeroed).
  const auto segs = spec.layer_segments(o.layer);
  std::vector<DeviceBuffer> weight_blocks, grad_blocks;
  std::vector<const bf16*> weight_bases;
  std::vector<float*> grad_bases;
  for (const StateSegment& seg : segs) {
    const std::uint64_t n = seg.parameters();
    std::vector<bf16> host(n);
    std::uint64_t offset = 0;
    for (const TensorSpec& t : seg.tensors) {
      DType dtype = DType::bf16;
      const auto bytes = file.tensor_bytes(t, &dtype);  // names file, tensor and shapes when absent or misshapen
      to_bf16(file, t.name, dtype, bytes, host.data() + offset, t.elements());
      offset += t.elements();
    }
    weight_blocks.emplace_back(n * sizeof(bf16));
    OOM_CUDA_CHECK(cudaMemcpy(weight_blocks.back().get(), host.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
    weight_bases.push_back(weight_blocks.back().get<const bf16>());
    grad_blocks.emplace_back(n * sizeof(float));
    OOM_CUDA_CHECK(cudaMemset(grad_blocks.back().get(), 0, n * sizeof(float)));
    grad_bases.push_back(grad_blocks.back().get<float>());
  }
  const model::DecoderLayerParams params = model::bind_decoder_layer_params(spec, o.layer, weight_bases);
  const model::DecoderLayerGrads grads = model::bind_decoder_layer_grads(spec, o.layer, grad_bases);

  const std::size_t act = T * H;
  DeviceBuffer x(act * sizeof(bf16)), dy(act * sizeof(bf16)), y(act * sizeof(bf16)), dx(act * sizeof(bf16));
  OOM_CUDA_CHECK(cudaMemcpy(x.get(), x_host.data(), act * sizeof(bf16), cudaMemcpyHostToDevice));
  OOM_CUDA_CHECK(cudaMemcpy(dy.get(), dy_host.data(), act * sizeof(bf16), cudaMemcpyHostToDevice));
  std::vector<std::int32_t> pos_host(T);
  for (std::uint64_t t = 0; t < T; ++t) pos_host[t] = static_cast<std::int32_t>(t);
  DeviceBuffer positions(T * sizeof(std::int32_t));
  OOM_CUDA_CHECK(cudaMemcpy(positions.get(), pos_host.data(), T * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  cudaStream_t stream = nullptr;
  OOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas = nullptr;
  OOM_CUBLAS_CHECK(cublasCreate(&blas));
  struct Cleanup {
    cudaStream_t s;
    cublasHandle_t b;
    ~Cleanup() {
      cublasDestroy(b);
      cudaStreamDestroy(s);
    }
  } cleanup{stream, blas};
  kernels::ExpertGemmStreams expert_streams;
  const model::DecoderLayerContext ctx{stream, blas, &expert_streams};

  const std::size_t saved_bytes = model::decoder_layer_saved_bytes(shape);
  const std::size_t ws_bytes = model::decoder_layer_workspace_bytes(shape, expert_streams);
  std::printf("saved %zu bytes, workspace %zu bytes\n", saved_bytes, ws_bytes);
  DeviceBuffer saved(saved_bytes), workspace(ws_bytes);

  cudaEvent_t ev[3];
  for (auto& e : ev) OOM_CUDA_CHECK(cudaEventCreate(&e));
  OOM_CUDA_CHECK(cudaEventRecord(ev[0], stream));
  model::decoder_layer_forward(ctx, shape, params, positions.get<std::int32_t>(), x.get<bf16>(), y.get<bf16>(), saved.get(),
                               saved_bytes, workspace.get(), ws_bytes);
  OOM_CUDA_CHECK(cudaEventRecord(ev[1], stream));
  model::decoder_layer_backward(ctx, shape, params, positions.get<std::int32_t>(), x.get<bf16>(), dy.get<bf16>(), saved.get(),
                                saved_bytes, dx.get<bf16>(), grads, workspace.get(), ws_bytes);
  OOM_CUDA_CHECK(cudaEventRecord(ev[2], stream));
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  OOM_CUDA_CHECK(cudaGetLastError());
  float fwd_ms = 0, bwd_ms = 0;
  OOM_CUDA_CHECK(cudaEventElapsedTime(&fwd_ms, ev[0], ev[1]));
  OOM_CUDA_CHECK(cudaEventElapsedTime(&bwd_ms, ev[1], ev[2]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::printf("forward %.3f ms, backward %.3f ms (first call: includes cuBLAS/stream setup)\n", fwd_ms, bwd_ms);

  // Everything back to the host, then one atomic write.
  const std::vector<float> y_host = download_bf16(y.get<bf16>(), act);
  const std::vector<float> dx_host = download_bf16(dx.get<bf16>(), act);
  const model::DecoderLayerRouting routing = model::decoder_layer_routing(shape, saved.get());
  const std::size_t tk = T * static_cast<std::size_t>(shape.top_k);
  const std::vector<std::int32_t> ids = download(routing.expert_ids, tk);
  const std::vector<float> weights = download(routing.weights, tk);
  std::vector<std::vector<float>> grad_host;
  for (std::size_t i = 0; i < segs.size(); ++i) grad_host.push_back(download(grad_bases[i], segs[i].parameters()));

  std::vector<SafetensorsEntry> out;
  out.push_back(entry("output", DType::fp32, {T, H}, y_host));
  out.push_back(entry("grad_input", DType::fp32, {T, H}, dx_host));
  out.push_back(entry("routing.expert_ids", DType::int32, {T, static_cast<std::uint64_t>(shape.top_k)}, ids));
  out.push_back(entry("routing.weights", DType::fp32, {T, static_cast<std::uint64_t>(shape.top_k)}, weights));
  for (std::size_t i = 0; i < segs.size(); ++i) {
    std::uint64_t offset = 0;
    for (const TensorSpec& t : segs[i].tensors) {
      out.push_back(SafetensorsEntry::view("grad." + t.name, DType::fp32, t.shape,
                                           std::as_bytes(std::span<const float>(grad_host[i].data() + offset, t.elements()))));
      offset += t.elements();
    }
  }
  write_safetensors(o.out, std::move(out));
  std::printf("wrote %s\n", o.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "oom-layer-check: %s\n%s", e.what.c_str(), kUsage);
    return 2;
  } catch (const oom::Error& e) {  // a flag's value refused (examples/common)
    std::fprintf(stderr, "oom-layer-check: %s\n%s", e.message().c_str(), kUsage);
    return 2;
  }
  if (oom::cuda::device_count() == 0) {
    std::fprintf(stderr, "oom-layer-check: no GPU available (%s)\n", oom::cuda::no_device_reason().c_str());
    return 2;
  }
  try {
    return run(o);
  } catch (const oom::Error& e) {
    std::fprintf(stderr, "oom-layer-check: %s\n", oom::user_message(e).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oom-layer-check: %s\n", e.what());
  }
  return 1;
}
