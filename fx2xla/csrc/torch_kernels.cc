// XLA FFI handlers that run torch's own CPU kernels (oneDNN convolutions) inside an
// XLA:CPU executable, on the buffers XLA hands them: the executable stays one asynchronous
// PJRT call, and only the op XLA:CPU is slow at leaves its code generator.
//
// Each handler wraps XLA's dense row-major buffers as torch tensors without copying, calls the
// ATen op with the dispatcher's extra layers excluded (XLA may run the handler on a thread
// where a Python dispatch mode or autograd is active; neither may see this call), and writes
// the result into XLA's output buffer.
#include <ATen/Config.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <sched.h>

#if AT_PARALLEL_OPENMP
#include <omp.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// For the length of one handler call, the dispatcher skips every layer the calling thread may
// have switched on (a Python dispatch mode, functorch transforms, vmap, autocast, tracing,
// functionalization) and autograd, so the op goes straight to its CPU kernel.
c10::DispatchKeySet skipped_layers() {
  using K = c10::DispatchKey;
  return c10::autograd_dispatch_keyset_with_ADInplaceOrView | c10::autocast_dispatch_keyset |
         c10::DispatchKeySet({K::Python, K::PythonTLSSnapshot, K::PreDispatch, K::Functionalize,
                              K::FuncTorchDynamicLayerFrontMode, K::FuncTorchDynamicLayerBackMode,
                              K::FuncTorchBatched, K::FuncTorchVmapMode, K::Batched, K::VmapMode,
                              K::Tracer});
}

std::optional<c10::ScalarType> torch_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return c10::ScalarType::Float;
    case ffi::DataType::F64: return c10::ScalarType::Double;
    case ffi::DataType::BF16: return c10::ScalarType::BFloat16;
    case ffi::DataType::F16: return c10::ScalarType::Half;
    default: return std::nullopt;
  }
}

at::Tensor as_tensor(const ffi::AnyBuffer& b, c10::ScalarType dtype) {
  auto dims = b.dimensions();
  std::vector<int64_t> sizes(dims.begin(), dims.end());
  return at::from_blob(b.untyped_data(), sizes, at::TensorOptions().dtype(dtype));
}

template <typename Attr>
std::vector<int64_t> ints(Attr span) {
  return std::vector<int64_t>(span.begin(), span.end());
}

// Runs `body`, turning a C++ exception (a torch check) into an FFI error XLA reports.
template <typename F>
ffi::Error guarded(const char* what, F&& body) {
  try {
    c10::impl::ExcludeDispatchKeyGuard plain(skipped_layers());
    body();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + e.what());
  }
}

// Batch splitting. Called from one of XLA's threads, torch's kernel would run its OpenMP team
// there: a team of its own for every XLA thread that calls one, whose workers then spin (GNU
// OpenMP waits actively for milliseconds after each region) on the cores XLA's next fusions need.
// Where the batch has several samples, the handlers instead cut it into one slice per thread of
// XLA's intra-op pool and run each slice single-threaded on XLA's own threads: no OpenMP team is
// ever started from an XLA thread.

// torch single-threaded on this thread for the scope (OpenMP's thread-count setting is per
// thread); restored after, since the caller may be a thread torch uses itself.
class SingleThreaded {
 public:
#if AT_PARALLEL_OPENMP
  SingleThreaded() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreaded() { omp_set_num_threads(saved_); }

 private:
  int saved_;
#endif
};

// How many slices to cut a batch of `n` into: one per intra-op thread where each gets two samples
// or more (bench/cpu_kernels.py: with one sample per thread, torch's own threads are as fast), else
// 1 (torch's threads); 1 where torch does not run on OpenMP (no team is started from ours then).
std::atomic<bool> slicing{true};  // fx2xla_torch_kernels_set_slicing
std::atomic<int64_t> sliced_calls{0};  // fx2xla_torch_kernels_sliced_calls

// The cores this process may run on (its affinity mask): XLA's pool may hold more threads than
// that (one per virtual device, say), and slices beyond the cores would only queue.
int64_t usable_cores() {
  static const int64_t cores = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return cores;
}

int64_t slices(int64_t n, const ffi::ThreadPool& pool) {
#if AT_PARALLEL_OPENMP
  int64_t threads = std::min(pool.num_threads(), usable_cores());
  if (!slicing.load(std::memory_order_relaxed)) return 1;
  return threads > 1 && n >= 2 * threads ? threads : 1;
#else
  return 1;
#endif
}

// Runs body(i) for i in [0, parts): the calling thread and tasks on XLA's pool claim indices
// from a shared counter, so the caller never waits for a task that has not started (the pool's
// threads may all be busy, or waiting in handlers of their own); a task that starts after every
// index is claimed returns at once. The first exception is rethrown here once all have ended.
struct SplitState {
  std::atomic<int64_t> next{0};
  int64_t parts = 0;
  const std::function<void(int64_t)>* body = nullptr;  // read only by a thread holding a claim
  std::mutex mu;
  std::condition_variable cv;
  int64_t finished = 0;
  std::exception_ptr error;

  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < parts;) {
      std::exception_ptr failed;
      try {
        c10::impl::ExcludeDispatchKeyGuard plain(skipped_layers());
        SingleThreaded one;
        (*body)(i);
      } catch (...) {
        failed = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      if (failed && !error) error = failed;
      if (++finished == parts) cv.notify_all();
    }
  }
};

void run_split(int64_t parts, ffi::ThreadPool& pool, const std::function<void(int64_t)>& body) {
  sliced_calls.fetch_add(1, std::memory_order_relaxed);
  auto state = std::make_shared<SplitState>();
  state->parts = parts;
  state->body = &body;
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([state] { state->work(); });
  state->work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->finished == parts; });
  if (state->error) std::rethrow_exception(state->error);
}

// [begin, end) of slice i of n samples cut into `parts`.
std::pair<int64_t, int64_t> slice_bounds(int64_t i, int64_t n, int64_t parts) {
  return {i * n / parts, (i + 1) * n / parts};
}

// A channels-last buffer ([N, *spatial, C], XLA's row-major) as the logical NCHW tensor torch
// sees, with channels-last strides: oneDNN then runs its channels-last kernels, as Inductor's
// layout optimization makes it for convolutions.
at::Tensor channels_last(const at::Tensor& t) {
  std::vector<int64_t> order{0, t.dim() - 1};
  for (int64_t d = 1; d < t.dim() - 1; ++d) order.push_back(d);
  return t.permute(order);
}

// `channels_last`: x, w and the result are laid out [N, *spatial, C] / [O, *kernel, I].
// `has_bias`: `bias` is the convolution's bias, added inside torch's kernel before its one
// rounding, as eager does (else a placeholder that is not read).
ffi::Error Convolution(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> stride,
                       ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation,
                       int64_t transposed, ffi::Span<const int64_t> output_padding, int64_t groups,
                       int64_t last, int64_t has_bias) {
  auto dtype = torch_dtype(x.element_type());
  if (!dtype || x.element_type() != w.element_type() || out->element_type() != x.element_type() ||
      (has_bias && bias.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("fx2xla_torch_convolution: unsupported dtypes");
  return guarded("torch convolution", [&] {
    at::Tensor xt = as_tensor(x, *dtype), wt = as_tensor(w, *dtype), ot = as_tensor(*out, *dtype);
    if (last) xt = channels_last(xt), wt = channels_last(wt), ot = channels_last(ot);
    std::optional<at::Tensor> b;
    if (has_bias) b = as_tensor(bias, *dtype);
    auto conv = [&](const at::Tensor& xs, const at::Tensor& os) {
      os.copy_(at::convolution(xs, wt, b, ints(stride), ints(padding), ints(dilation), transposed != 0,
                               ints(output_padding), groups));
    };
    int64_t n = xt.size(0), parts = slices(n, pool);
    if (parts == 1) return conv(xt, ot);
    run_split(parts, pool, [&](int64_t i) {
      auto [lo, hi] = slice_bounds(i, n, parts);
      conv(xt.slice(0, lo, hi), ot.slice(0, lo, hi));
    });
  });
}

ffi::Error ConvolutionBackward(ffi::ThreadPool pool, ffi::AnyBuffer grad, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                               ffi::Span<const int64_t> stride, ffi::Span<const int64_t> padding,
                               ffi::Span<const int64_t> dilation, int64_t transposed,
                               ffi::Span<const int64_t> output_padding, int64_t groups,
                               int64_t input_mask, int64_t weight_mask, int64_t last) {
  auto dtype = torch_dtype(x.element_type());
  if (!dtype || x.element_type() != w.element_type() || grad.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("fx2xla_torch_convolution_backward: unsupported dtypes");
  return guarded("torch convolution_backward", [&] {
    at::Tensor gt = as_tensor(grad, *dtype), xt = as_tensor(x, *dtype), wt = as_tensor(w, *dtype);
    at::Tensor dxt = as_tensor(*dx, *dtype), dwt = as_tensor(*dw, *dtype);
    if (last) {
      gt = channels_last(gt), xt = channels_last(xt), wt = channels_last(wt);
      dxt = channels_last(dxt), dwt = channels_last(dwt);
    }
    // Per slice: its input gradient into place, its weight gradient kept; the weight gradient is
    // their sum, in slice order (deterministic), accumulated in float32 for half types.
    auto backward = [&](const at::Tensor& gs, const at::Tensor& xs) {
      auto [gx, gw, gb] = at::convolution_backward(
          gs, xs, wt, std::nullopt, ints(stride), ints(padding), ints(dilation), transposed != 0,
          ints(output_padding), groups, {input_mask != 0, weight_mask != 0, false});
      return std::make_pair(gx, gw);
    };
    int64_t n = xt.size(0), parts = slices(n, pool);
    if (parts == 1) {
      auto [gx, gw] = backward(gt, xt);
      if (input_mask) dxt.copy_(gx);
      if (weight_mask) dwt.copy_(gw);
      return;
    }
    std::vector<at::Tensor> weight_grads(parts);
    run_split(parts, pool, [&](int64_t i) {
      auto [lo, hi] = slice_bounds(i, n, parts);
      auto [gx, gw] = backward(gt.slice(0, lo, hi), xt.slice(0, lo, hi));
      if (input_mask) dxt.slice(0, lo, hi).copy_(gx);
      if (weight_mask) weight_grads[i] = gw;
    });
    if (weight_mask) {
      bool half = *dtype == at::kHalf || *dtype == at::kBFloat16;
      at::Tensor total = weight_grads[0].to(half ? at::kFloat : *dtype, /*non_blocking=*/false, /*copy=*/true);
      for (int64_t i = 1; i < parts; ++i) total.add_(weight_grads[i]);
      dwt.copy_(total);
    }
  });
}

}  // namespace

// The attributes both convolution handlers take, in torch's argument order.
template <typename Binding>
auto ConvolutionAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const int64_t>>("stride")
      .template Attr<ffi::Span<const int64_t>>("padding")
      .template Attr<ffi::Span<const int64_t>>("dilation")
      .template Attr<int64_t>("transposed")
      .template Attr<ffi::Span<const int64_t>>("output_padding")
      .template Attr<int64_t>("groups");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_convolution, Convolution,
                              ConvolutionAttrs(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("channels_last")
                                  .Attr<int64_t>("has_bias"));

// A gradient whose mask is 0 is neither computed nor written (the caller drops its buffer).
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_convolution_backward, ConvolutionBackward,
                              ConvolutionAttrs(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("input_mask")
                                  .Attr<int64_t>("weight_mask")
                                  .Attr<int64_t>("channels_last"));

// Process-wide: whether the handlers cut batches into slices (see `slices`); returns the previous
// setting. Off, every call runs torch's kernel once on the whole batch, as eager does.
extern "C" int fx2xla_torch_kernels_set_slicing(int on) { return slicing.exchange(on != 0); }

// How many handler calls cut their batch into slices so far, in this process.
extern "C" int64_t fx2xla_torch_kernels_sliced_calls() { return sliced_calls.load(); }
