// SGLang's JIT top-k sum (TopkSumKernel<256, PDL>): out[M, K] = in[M, topk, K].sum(1), bf16.
#include "moe/topk_sum.cuh"
#include "k3marlin_internal.h"

namespace k3m {

void topk_sum(int device, const void* in, void* out, int64_t m, int64_t topk, int64_t k) {
  View i(in, kBF16, device, {m, topk, k});
  View o(out, kBF16, device, {m, k});
  sglang::TopkSumKernel<256, true>::run(&i.t, &o.t);
}

}  // namespace k3m
