// SGLang's gptq_marlin_repack host entry, called on one expert matrix (4-bit, no act-order perm).
#include "gemm/marlin/gptq_marlin_repack.cuh"
#include "k3marlin_internal.h"

namespace k3m {

void repack_fp4(int device, const void* in, void* out, int64_t size_k, int64_t size_n) {
  View b(in, kI32, device, {size_k / 8, size_n});  // [K / pack_factor, N], pack_factor 8
  View perm(nullptr, kI32, device, {0});
  View o(out, kI32, device, {size_k / 16, size_n * 2});  // [K / tile, N * tile / pack_factor]
  sglang::gptq_marlin_repack(&b.t, &perm.t, &o.t, size_k, size_n, 4);
}

}  // namespace k3m
