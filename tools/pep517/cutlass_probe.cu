// Compiles only if the CUTLASS / CuTe headers CMake found work with this nvcc and the kernels' C++
// standard (target flashmla_cutlass_probe, built on request: tests/python/test_install.py).
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

__global__ void flashmla_cutlass_probe(float* out) {
  using namespace cute;
  auto layout = make_layout(make_shape(Int<4>{}, Int<8>{}));
  Tensor t = make_tensor(make_gmem_ptr(out), layout);
  t(threadIdx.x % 4, threadIdx.x / 4 % 8) = static_cast<float>(cutlass::bfloat16_t(1.5f));
}
