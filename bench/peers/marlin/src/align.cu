// SGLang's CUDA routing-alignment host entries: MoeAlignBlockSizeKernel (moe_align_kernel.cu)
// and AlignSingleTokenKernel (align_single_token.cuh, the M == 1 decode path), int32 ids.
#include "moe/moe_align_kernel.cu"
#include "moe/align_single_token.cuh"
#include "k3marlin_internal.h"

namespace k3m {

void align_block_size(int device, const void* topk_ids, int64_t numel, int64_t num_buckets, int64_t block_size,
                      void* sorted_ids, int64_t sorted_numel, void* expert_ids, int64_t expert_ids_numel,
                      void* num_post, int64_t num_post_numel, void* cumsum, int64_t cumsum_numel,
                      bool write_inactive_prefix_count) {
  View ids(topk_ids, kI32, device, {numel});
  View s(sorted_ids, kI32, device, {sorted_numel});
  View e(expert_ids, kI32, device, {expert_ids_numel});
  View n(num_post, kI32, device, {num_post_numel});
  View c(cumsum, kI32, device, {cumsum_numel});
  // pad_sorted_token_ids = true, as moe_align_block_size in SGLang passes it.
  if (write_inactive_prefix_count) {
    sglang::MoeAlignBlockSizeKernel<int32_t, true, false, false>::run(&ids.t, num_buckets, block_size, &s.t, &e.t,
                                                                      &n.t, &c.t, true);
  } else {
    sglang::MoeAlignBlockSizeKernel<int32_t, false, false, false>::run(&ids.t, num_buckets, block_size, &s.t, &e.t,
                                                                       &n.t, &c.t, true);
  }
}

void align_single_token(int device, const void* topk_ids, int64_t topk, int64_t block_size, void* sorted_ids,
                        int64_t sorted_numel, void* expert_ids, int64_t expert_ids_numel, void* num_post,
                        int64_t num_post_numel, bool write_inactive_prefix_count) {
  View ids(topk_ids, kI32, device, {1, topk});
  View s(sorted_ids, kI32, device, {sorted_numel});
  View e(expert_ids, kI32, device, {expert_ids_numel});
  View n(num_post, kI32, device, {num_post_numel});
  // kUsePDL = true: SGLang's is_arch_support_pdl() on sm_90.
  if (write_inactive_prefix_count) {
    sglang::AlignSingleTokenKernel<true, true>::run(&ids.t, &s.t, &e.t, &n.t, block_size);
  } else {
    sglang::AlignSingleTokenKernel<true, false>::run(&ids.t, &s.t, &e.t, &n.t, block_size);
  }
}

}  // namespace k3m
