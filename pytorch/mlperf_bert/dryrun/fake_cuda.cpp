// A CUDA device that exists only for type, shape and device checks: loaded into PyTorch
// before any CUDA tensor is made, so that FakeTensorMode can run the trainer on
// 'cuda' tensors that hold no data. It registers a device guard that does nothing and CUDA
// hooks that report one device. No kernel ever runs on it: every op on a 'cuda' tensor must
// stay inside FakeTensorMode, which computes the result's metadata only.
//
// A CUDA build of PyTorch (a GPU machine's) registers its own hooks and guard when `import torch`
// loads libtorch_cuda, after this library. The hooks here are registered at a higher priority:
// the registry keeps them and skips the real ones, printing "Higher priority item already
// registered, skipping registration of CUDAHooks" (two at one priority would end the process).
// The real guard takes this one's place; the dry run never calls it (FakeTensorMode runs no
// kernel that would set a device), with or without a GPU.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);

namespace at {

struct FakeCudaHooks final : CUDAHooksInterface {
  explicit FakeCudaHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  bool hasCUDA() const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
  int getNumGPUs() const override { return 1; }
  void deviceSynchronize(DeviceIndex) const override {}
};

C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, FakeCudaHooks)

}  // namespace at
