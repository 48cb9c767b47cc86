// XLA FFI handlers that run torch's own CPU kernels (oneDNN convolutions) inside an
// XLA:CPU executable, on the buffers XLA hands them: the executable stays one asynchronous
// PJRT call, and only the op XLA:CPU is slow at leaves its code generator.
//
// Each handler wraps XLA's dense row-major buffers as torch tensors without copying, calls the
// ATen op with the dispatcher's extra layers excluded (XLA may run the handler on a thread
// where a Python dispatch mode or autograd is active; neither may see this call), and writes
// the result into XLA's output buffer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <exception>
#include <optional>
#include <vector>

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
ffi::Error Convolution(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Span<const int64_t> stride, ffi::Span<const int64_t> padding,
                       ffi::Span<const int64_t> dilation, int64_t transposed,
                       ffi::Span<const int64_t> output_padding, int64_t groups, int64_t last,
                       int64_t has_bias) {
  auto dtype = torch_dtype(x.element_type());
  if (!dtype || x.element_type() != w.element_type() || out->element_type() != x.element_type() ||
      (has_bias && bias.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("fx2xla_torch_convolution: unsupported dtypes");
  return guarded("torch convolution", [&] {
    at::Tensor xt = as_tensor(x, *dtype), wt = as_tensor(w, *dtype), ot = as_tensor(*out, *dtype);
    if (last) xt = channels_last(xt), wt = channels_last(wt), ot = channels_last(ot);
    std::optional<at::Tensor> b;
    if (has_bias) b = as_tensor(bias, *dtype);
    at::Tensor result = at::convolution(xt, wt, b, ints(stride), ints(padding), ints(dilation),
                                        transposed != 0, ints(output_padding), groups);
    ot.copy_(result);
  });
}

ffi::Error ConvolutionBackward(ffi::AnyBuffer grad, ffi::AnyBuffer x, ffi::AnyBuffer w,
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
    auto [gx, gw, gb] = at::convolution_backward(
        gt, xt, wt, std::nullopt, ints(stride), ints(padding), ints(dilation), transposed != 0,
        ints(output_padding), groups, {input_mask != 0, weight_mask != 0, false});
    if (input_mask) dxt.copy_(gx);
    if (weight_mask) dwt.copy_(gw);
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
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("channels_last")
                                  .Attr<int64_t>("has_bias"));

// A gradient whose mask is 0 is neither computed nor written (the caller drops its buffer).
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_convolution_backward, ConvolutionBackward,
                              ConvolutionAttrs(ffi::Ffi::Bind()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("input_mask")
                                  .Attr<int64_t>("weight_mask")
                                  .Attr<int64_t>("channels_last"));
