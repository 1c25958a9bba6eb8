// The `npu` device twin: a PrivateUse1 backend whose memory is host RAM but whose tensors are not
// CPU tensors. Placement is real (a CPU tensor and an npu tensor in one op fail, as on an Ascend
// device), every device byte goes through a counting allocator (per device, with a peak), and the
// kernels are the CPU's, reached through PyTorch's CPU fallback. A test double: never shipped.
//
// Written after PyTorch's open-registration reference backend (test/cpp_extensions/
// open_registration_extension); only what the rldock runtime touches is implemented.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace npu_twin {

// --- devices ------------------------------------------------------------------------------------

// Like torch_npu, the process sees only ASCEND_RT_VISIBLE_DEVICES (Ray and the device plugin set
// it per worker); without it, the twin is an 8-device node.
c10::DeviceIndex visible_device_count() {
  static const c10::DeviceIndex count = [] {
    const char* visible = std::getenv("ASCEND_RT_VISIBLE_DEVICES");
    if (visible == nullptr || *visible == '\0') {
      return static_cast<c10::DeviceIndex>(8);
    }
    c10::DeviceIndex n = 1;
    for (const char* c = visible; *c; ++c) {
      n += (*c == ',');
    }
    return n;
  }();
  return count;
}

thread_local c10::DeviceIndex current_device = 0;

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < visible_device_count(), "npu twin: invalid device index ", int(index),
              " (this process sees ", int(visible_device_count()), " devices)");
}

// --- memory -------------------------------------------------------------------------------------

struct Counters {
  int64_t allocated = 0;
  int64_t peak = 0;
};

struct Ledger {
  std::mutex mutex;
  std::unordered_map<void*, std::pair<c10::DeviceIndex, size_t>> device_blocks;
  std::unordered_map<void*, size_t> pinned_blocks;
  std::vector<Counters> per_device = std::vector<Counters>(64);
  int64_t pinned_bytes = 0;
};

Ledger& ledger() {
  static Ledger* instance = new Ledger();  // never destroyed: deleters may run at interpreter exit
  return *instance;
}

void device_delete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  auto& l = ledger();
  {
    std::lock_guard<std::mutex> lock(l.mutex);
    auto it = l.device_blocks.find(ptr);
    TORCH_INTERNAL_ASSERT(it != l.device_blocks.end(), "npu twin: freeing an unknown device pointer");
    l.per_device[it->second.first].allocated -= static_cast<int64_t>(it->second.second);
    l.device_blocks.erase(it);
  }
  std::free(ptr);
}

struct DeviceAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex index = current_device;
    check_index(index);
    void* data = nbytes ? std::malloc(nbytes) : nullptr;
    TORCH_CHECK(nbytes == 0 || data != nullptr, "npu twin: out of memory allocating ", nbytes, " bytes");
    if (data != nullptr) {
      auto& l = ledger();
      std::lock_guard<std::mutex> lock(l.mutex);
      l.device_blocks[data] = {index, nbytes};
      auto& c = l.per_device[index];
      c.allocated += static_cast<int64_t>(nbytes);
      c.peak = std::max(c.peak, c.allocated);
    }
    return {data, data, &device_delete, c10::Device(c10::DeviceType::PrivateUse1, index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &device_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

void pinned_delete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  auto& l = ledger();
  {
    std::lock_guard<std::mutex> lock(l.mutex);
    auto it = l.pinned_blocks.find(ptr);
    TORCH_INTERNAL_ASSERT(it != l.pinned_blocks.end(), "npu twin: freeing an unknown pinned pointer");
    l.pinned_bytes -= static_cast<int64_t>(it->second);
    l.pinned_blocks.erase(it);
  }
  std::free(ptr);
}

// Page-locked host memory stand-in: ordinary RAM, but recognised by `is_pinned()` and counted.
struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? std::malloc(nbytes) : nullptr;
    TORCH_CHECK(nbytes == 0 || data != nullptr, "npu twin: out of pinned memory allocating ", nbytes, " bytes");
    if (data != nullptr) {
      auto& l = ledger();
      std::lock_guard<std::mutex> lock(l.mutex);
      l.pinned_blocks[data] = nbytes;
      l.pinned_bytes += static_cast<int64_t>(nbytes);
    }
    return {data, data, &pinned_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

DeviceAllocator device_allocator;
PinnedAllocator pinned_allocator;

// --- device guard and hooks ---------------------------------------------------------------------

// One stream per device (the default one): the twin computes synchronously, so every stream
// ordering a program asks for already holds. Streams and events exist in Python (torch.npu).
struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType static_type = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return static_type; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(static_type, current_device); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return visible_device_count(); }
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void synchronizeStream(const c10::Stream&) const override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return visible_device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return visible_device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device;
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool isPinnedPtr(const void* data) const override {
    auto& l = ledger();
    std::lock_guard<std::mutex> lock(l.mutex);
    return l.pinned_blocks.count(const_cast<void*>(data)) > 0;
  }
  c10::Device getDeviceFromPtr(void* data) const override {
    auto& l = ledger();
    std::lock_guard<std::mutex> lock(l.mutex);
    auto it = l.device_blocks.find(data);
    TORCH_CHECK(it != l.device_blocks.end(), "npu twin: not a device pointer");
    return c10::Device(c10::DeviceType::PrivateUse1, it->second.first);
  }
  // storage.resize_(n): how the swap frees and restores device memory.
  // Always through the allocator, even for 0 bytes, so the storage keeps its device (as the
  // CUDA and NPU allocators do) and a later resize allocates on that same device.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    const c10::DeviceGuard guard(impl->device());
    c10::DataPtr fresh = device_allocator.allocate(newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// --- operators ----------------------------------------------------------------------------------

// A view of a twin tensor's bytes as a CPU tensor (same memory), for the kernels.
at::Tensor as_cpu(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  const auto d = c10::device_or_default(device);
  TORCH_CHECK(d.is_privateuseone(), "npu twin: empty on ", d);
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only dense CPU tensors can be pinned");
  const c10::DeviceGuard guard(d);
  return at::detail::empty_generic(size, &device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  const auto d = c10::device_or_default(device);
  TORCH_CHECK(d.is_privateuseone(), "npu twin: empty_strided on ", d);
  const c10::DeviceGuard guard(d);
  return at::detail::empty_strided_generic(size, stride, &device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, storage_offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

// Host <-> device and device <-> device copies: the one place bytes cross the boundary.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor dst_cpu = dst.is_cpu() ? dst : as_cpu(dst);
  const at::Tensor src_cpu = self.is_cpu() ? self : as_cpu(self);
  at::native::copy_(dst_cpu, src_cpu, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  const c10::DeviceGuard guard(dst.device());  // a grown storage is allocated on dst's device
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::native::_local_scalar_dense_cpu(as_cpu(self));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }

at::Tensor& set_source_storage_offset(at::Tensor& result, at::Storage storage, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::cpu::set_(result, storage, offset, size, stride);
}

// Ops that accept host tensors beside device tensors on real accelerators (CUDA and torch_npu
// alike): advanced indexing with host index tensors.
bool accepts_host_tensors(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> names = {"aten::index", "aten::index_put_", "aten::index_put",
                                                        "aten::_index_put_impl_"};
  return names.count(name.name) > 0;
}

void note_device(const at::Tensor& t, std::optional<c10::Device>& device, std::optional<c10::Device>& host_seen) {
  if (!t.defined()) {
    return;
  }
  if (t.is_cpu()) {
    if (t.dim() != 0) {  // a 0-dim host tensor is a scalar, which accelerator kernels accept
      host_seen = t.device();
    }
    return;
  }
  if (device && *device != t.device()) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                *device, " and ", t.device(), "!");
  }
  device = t.device();
}

// Every other operator: the device check an accelerator kernel makes, then the CPU kernel.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto num_args = schema.arguments().size();
  if (!accepts_host_tensors(schema.operator_name())) {
    std::optional<c10::Device> device;
    std::optional<c10::Device> host_seen;
    const auto args = torch::jit::last(*stack, num_args);
    for (const auto& arg : args) {
      if (arg.isTensor()) {
        note_device(arg.toTensor(), device, host_seen);
      } else if (arg.isTensorList()) {
        for (const at::Tensor& t : arg.toTensorList().vec()) {
          note_device(t, device, host_seen);
        }
      } else if (arg.isOptionalTensorList()) {
        for (const std::optional<at::Tensor> t : arg.toOptionalTensorList()) {
          if (t.has_value()) {
            note_device(*t, device, host_seen);
          }
        }
      }
    }
    if (device && host_seen) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                  *device, " and cpu! (in ", schema.operator_name(), ")");
    }
  }
  at::native::cpu_fallback(op, stack);
}

// `module.to("npu")` swaps each parameter's data in place only when the host and device tensors are
// shallow-copy compatible; otherwise it makes a new Parameter per module and breaks tied weights
// (an embedding shared with the LM head). torch_npu answers yes for dense npu/CPU pairs, as CUDA
// does in core; so does the twin.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense_here = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.device().is_cpu() || t.device().is_privateuseone());
  };
  return dense_here(self) && dense_here(from);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("view", view);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// --- Python entry points (torch.npu's memory and device functions) ------------------------------

void install() {
  static bool done = false;
  if (done) {
    return;
  }
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &device_allocator);
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  done = true;
}

int64_t memory_allocated(int64_t index) {
  check_index(index);
  auto& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.per_device[index].allocated;
}

int64_t max_memory_allocated(int64_t index) {
  check_index(index);
  auto& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.per_device[index].peak;
}

void reset_peak_memory_stats(int64_t index) {
  check_index(index);
  auto& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  l.per_device[index].peak = l.per_device[index].allocated;
}

int64_t pinned_bytes() {
  auto& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.pinned_bytes;
}

void bind_hccl_twin(pybind11::module& m);  // hccl_twin.cpp

}  // namespace npu_twin

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  npu_twin::bind_hccl_twin(m);
  m.def("install", &npu_twin::install, "register the allocator and hooks (once)");
  m.def("device_count", [] { return static_cast<int>(npu_twin::visible_device_count()); });
  m.def("current_device", [] { return static_cast<int>(npu_twin::current_device); });
  m.def("set_device", [](int64_t index) {
    npu_twin::check_index(index);
    npu_twin::current_device = static_cast<c10::DeviceIndex>(index);
  });
  m.def("memory_allocated", &npu_twin::memory_allocated);
  m.def("max_memory_allocated", &npu_twin::max_memory_allocated);
  m.def("reset_peak_memory_stats", &npu_twin::reset_peak_memory_stats);
  m.def("pinned_bytes", &npu_twin::pinned_bytes);
}
