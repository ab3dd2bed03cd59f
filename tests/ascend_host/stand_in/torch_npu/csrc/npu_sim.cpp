// The simulated Ascend device: PrivateUse1 tensors in CPU memory (test infrastructure, see ../README).
// Allocator, device guard, PrivateUse1 hooks, the kernels a backend must provide (empty, copy, views,
// resize, set_), a boxed CPU fallback for every other aten op, the ops that fallback cannot reach
// (convolution_overrideable and its backward, integer histc), and torch_npu's _has_compatible_shallow_copy_type.
#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <atomic>
#include <cstring>

namespace {

constexpr auto kNpu = c10::DeviceType::PrivateUse1;
thread_local c10::DeviceIndex current_device = 0;
std::atomic<int64_t> allocated{0}, peak{0}, allocations{0};
bool poison = true;  // fill new memory with 0xFF (NaN for floats): a read of uninitialised memory shows

void npu_free(void* ctx) {
  auto* header = static_cast<int64_t*>(ctx);
  allocated -= header[0];
  c10::free_cpu(ctx);
}

struct NpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // 64-byte header holds the size (for the statistics); data follows it
    void* base = c10::alloc_cpu(nbytes + 64);
    static_cast<int64_t*>(base)[0] = static_cast<int64_t>(nbytes);
    void* data = static_cast<char*>(base) + 64;
    if (poison && nbytes) std::memset(data, 0xFF, nbytes);
    int64_t now = (allocated += static_cast<int64_t>(nbytes));
    int64_t old = peak.load();
    while (now > old && !peak.compare_exchange_weak(old, now)) {}
    ++allocations;
    return {data, base, &npu_free, c10::Device(kNpu, current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
NpuAllocator npu_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &npu_allocator);  // torch.UntypedStorage(n, device="npu"), deepcopy

struct NpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() >= 0) current_device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return {kNpu, current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() == 0, "npu (simulated): device ", d.index(), " does not exist (1 device)");
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool = false) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  void setCurrentDevice(c10::DeviceIndex d) const override { current_device = d; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override { return at::detail::getDefaultCPUGenerator(); }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  c10::Device getDeviceFromPtr(void*) const override { return {kNpu, current_device}; }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

bool is_npu(const at::Tensor& t) { return t.defined() && t.device().type() == kNpu; }

// A CPU tensor over the same memory (no copy), keeping the npu storage alive.
at::Tensor cpu_alias(const at::Tensor& t) {
  if (!is_npu(t)) return t;
  c10::Storage storage = t.storage();
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [storage](void*) {}, t.options().device(at::kCPU));
}

at::Tensor npu_empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                   std::optional<at::Layout> layout, std::optional<at::Device> device,
                                   std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  const auto ks = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &npu_allocator, ks, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor npu_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout> layout, std::optional<at::Device> device,
                             std::optional<bool> pin_memory) {
  const auto ks = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &npu_allocator, ks, c10::dtype_or_default(dtype));
}

at::Tensor npu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor d = cpu_alias(dst);
  d.copy_(cpu_alias(self));
  return dst;
}

at::Tensor npu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return npu_copy_from(self, dst, false);
}

const at::Tensor& npu_resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                              std::optional<at::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& npu_set_storage(at::Tensor& self, at::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                            c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset.guard_int(__FILE__, __LINE__),
                                      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& npu_set_storage_whole(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }

at::Tensor& npu_set_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }

at::Tensor npu_view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor npu_as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                          std::optional<c10::SymInt> offset) {
  std::optional<int64_t> o;
  if (offset) o = offset->guard_int(__FILE__, __LINE__);
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), o);
}

at::Tensor npu_reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor to_npu(const at::Tensor& cpu) {
  if (!cpu.defined()) return cpu;
  at::Tensor out = npu_empty_strided(cpu.sizes(), cpu.strides(), cpu.scalar_type(), std::nullopt, std::nullopt, std::nullopt);
  cpu_alias(out).copy_(cpu);
  return out;
}

// convolution: at::convolution sends PrivateUse1 to convolution_overrideable, which the boxed fallback
// does not reach (the CPU has no kernel of that name)
at::Tensor npu_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                           bool transposed, c10::SymIntArrayRef output_padding, c10::SymInt groups) {
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) b = cpu_alias(*bias);
  return to_npu(at::convolution_symint(cpu_alias(input), cpu_alias(weight), b, stride, padding, dilation, transposed,
                                       output_padding, groups));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool transposed, c10::SymIntArrayRef output_padding,
    c10::SymInt groups, std::array<bool, 3> output_mask) {
  auto grads = at::convolution_backward_symint(cpu_alias(grad_output), cpu_alias(input), cpu_alias(weight),
                                               c10::SymIntArrayRef({weight.sym_size(0)}), stride, padding, dilation,
                                               transposed, output_padding, groups, output_mask);
  return {to_npu(std::get<0>(grads)), to_npu(std::get<1>(grads)), to_npu(std::get<2>(grads))};
}

// torch_npu's histc takes integer tensors (verl's npu_patch MoE calls it on int64); the CPU kernel does not
at::Tensor npu_histc(const at::Tensor& self, int64_t bins, const at::Scalar& min, const at::Scalar& max) {
  at::Tensor x = cpu_alias(self);
  at::Tensor out = c10::isIntegralType(x.scalar_type(), true) ? at::histc(x.to(at::kFloat), bins, min, max).to(x.scalar_type())
                                                             : at::histc(x, bins, min, max);
  return to_npu(out);
}

// `param.data = npu_tensor` (FSDP2's fully_shard, Module.to) asks aten::_has_compatible_shallow_copy_type, whose
// default (c10's TensorImpl::has_compatible_shallow_copy_type) counts only CPU/CUDA/MPS/HIP/XPU/HPU as dense, so a
// CPU parameter could not take npu data. torch_npu registers its own kernel (libtorch_npu.so of the 2.13.0 wheel:
// at_npu::native::_has_compatible_shallow_copy_type): equal key sets, or both dense on CPU or PrivateUse1.
bool npu_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto is_dense = [](c10::DispatchKeySet ks) {
    constexpr auto dense_backends =
        c10::DispatchKeySet({c10::BackendComponent::CPUBit, c10::BackendComponent::PrivateUse1Bit});
    return ks.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) && ks.has_any(dense_backends);
  };
  const auto self_ks = self.key_set(), from_ks = from.key_set();
  return self_ks == from_ks || (is_dense(self_ks) && is_dense(from_ks));
}

// Every other aten op: run the CPU kernel on copies and copy results back (torch's cpu_fallback), after
// the check a device makes: tensors of one op on one device (0-dim CPU tensors are scalars: allowed).
void npu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const auto n = args.size();
  bool seen_npu = false, seen_cpu = false;
  auto inspect = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (t.device().type() == kNpu) seen_npu = true;
    else if (t.device().is_cpu() && t.dim() > 0) seen_cpu = true;
  };
  for (size_t i = 0; i < n; ++i) {
    const auto& iv = (*stack)[stack->size() - n + i];
    if (iv.isTensor()) inspect(iv.toTensor());
    else if (iv.isTensorList()) for (const auto& t : iv.toTensorVector()) inspect(t);
  }
  const auto& name = op.schema().name();
  if (seen_npu && seen_cpu && name != "aten::index.Tensor" && name != "aten::index_put_" && name != "aten::_index_put_impl_" &&
      name != "aten::index_put") {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, npu:0 and cpu! (",
                name, ", simulated npu)");
  }
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", npu_empty_memory_format);
  m.impl("empty_strided", npu_empty_strided);
  m.impl("_copy_from", npu_copy_from);
  m.impl("_copy_from_and_resize", npu_copy_from_and_resize);
  m.impl("resize_", npu_resize_);
  m.impl("set_.source_Storage_storage_offset", npu_set_storage);
  m.impl("set_.source_Storage", npu_set_storage_whole);
  m.impl("set_.source_Tensor", npu_set_tensor);
  m.impl("view", npu_view);
  m.impl("as_strided", npu_as_strided);
  m.impl("unfold", at::native::unfold);
  m.impl("_reshape_alias", npu_reshape_alias);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("convolution_overrideable", npu_convolution);
  m.impl("convolution_backward_overrideable", npu_convolution_backward);
  m.impl("histc", npu_histc);
  m.impl("_has_compatible_shallow_copy_type", npu_has_compatible_shallow_copy_type);
}

// the same kernel for the autograd key (a bool: nothing to differentiate), so the query skips the autograd fallback
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", npu_has_compatible_shallow_copy_type);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
}

// torch.autocast("npu"): torch_npu registers AutocastPrivateUse1 kernels with CUDA's op lists; every other op
// falls through (without this, an op under autocast finds no Autocastnpu kernel)
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

namespace at::autocast {
namespace {
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define _NPU_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define _NPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define _NPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define _NPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(_NPU_LOW)
  AT_FORALL_FP32(_NPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(_NPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(_NPU_PROMOTE)
}
}  // namespace
}  // namespace at::autocast

namespace {
void register_hooks() {
  static NpuHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_hooks();
  m.def("cpu_alias", &cpu_alias, "a CPU tensor over an npu tensor's memory (no copy)");
  m.def("to_npu", &to_npu, "a copy of a CPU tensor on npu");
  m.def("current_device", []() { return static_cast<int>(current_device); });
  m.def("set_device", [](int d) {
    TORCH_CHECK(d == 0, "npu (simulated): device ", d, " does not exist (1 device)");
    current_device = static_cast<c10::DeviceIndex>(d);
  });
  m.def("memory_allocated", []() { return allocated.load(); });
  m.def("max_memory_allocated", []() { return peak.load(); });
  m.def("reset_peak_memory_stats", []() { peak = allocated.load(); });
  m.def("set_poison", [](bool on) { poison = on; });
}
