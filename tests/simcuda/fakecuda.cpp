// Preloaded (LD_PRELOAD) into a process running a CPU-only torch, before torch initialises: it
// registers a CUDA device guard (c10's FakeGuardImpl: device index and streams as plain numbers)
// and CUDA hooks that say one CUDA device exists. With them, torch accepts tensors whose device is
// cuda:0 (the harness's SimTensor) and autograd runs their backward on a device thread, as on a GPU.
// No kernel runs on "CUDA": every op is answered by the Python harness (tests/simcuda/sim_tensor.py).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace at {
namespace m6_simcuda {

// torch looks its CUDA hooks up in the registry by the key "CUDAHooks", hence the class name.
struct CUDAHooks : CUDAHooksInterface {
  CUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  // "Pinned" host memory is ordinary host memory here; the harness tracks which buffers were
  // asked to be pinned, to tell an asynchronous copy from one CUDA would make synchronous.
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void init() const override {}
};

}  // namespace m6_simcuda
using m6_simcuda::CUDAHooks;
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at
