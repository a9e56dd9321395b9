// What a CUDA build of PyTorch registers as `import torch` loads libtorch_cuda, after the fake CUDA
// device where a dry run loaded one: CUDA hooks at the registry's default priority and a CUDA guard,
// in its place. As on a machine without a GPU, the hooks see none and the guard fails on every call
// (the dry run must never call it). Loaded by sitecustomize.py beside it (tests/trainer/dryrun/test_cuda_build.py).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace {

[[noreturn]] void refuse() {
  TORCH_CHECK(false, "the CUDA build's guard was called, on a machine without a GPU");
}

struct BuildGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { refuse(); }
  c10::Device getDevice() const override { refuse(); }
  void setDevice(c10::Device) const override { refuse(); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { refuse(); }
  c10::Stream exchangeStream(c10::Stream) const override { refuse(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 0; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override { refuse(); }
  void block(void*, const c10::Stream&) const override { refuse(); }
  bool queryEvent(void*) const override { refuse(); }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { refuse(); }
  void synchronizeStream(const c10::Stream&) const override { refuse(); }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, BuildGuard);

namespace at {

struct BuildHooks final : CUDAHooksInterface {
  explicit BuildHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return false; }
  DeviceIndex deviceCount() const override { return 0; }
};

C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", BuildHooks)

}  // namespace at
