// One specialization of SGLang's marlin MoE GEMM host entry (moe_wna16_marlin_gemm) for bf16
// activations and NVFP4 weights, compiled with -DK3M_IS_EP=0|1 -DK3M_ZERO_INACTIVE=0|1.
//
// SGLang's get_marlin_kernel<...> references every kernel of every weight format (u4, u8, fp8,
// act-order, MXFP4, NVFP4), which is what makes SGLang's own JIT module large. Here it is
// explicitly specialized (before marlin_mm instantiates it) to SGLang's own NVFP4_GET_IF list,
// so the same selection code (determine_exec_config, is_valid_config, the launch in marlin_mm)
// runs over exactly the NVFP4 kernels SGLang would pick from, and nothing else is compiled.
#include "gemm/marlin_moe/moe_wna16_marlin.cuh"
#include "k3marlin_internal.h"

#ifndef K3M_IS_EP
#error "compile with -DK3M_IS_EP=0|1 -DK3M_ZERO_INACTIVE=0|1"
#endif

#define K3M_EP_B (K3M_IS_EP != 0)
#define K3M_ZERO_B (K3M_ZERO_INACTIVE != 0)
#define K3M_SORTED_B (K3M_IS_EP == 0)

namespace sglang::device::marlin_moe {

template <typename scalar_t, bool kIsEP, bool kHasBias, bool kExpertIdsAreSorted, bool kZeroInactiveOutput,
          bool kHasInactivePrefixCount>
MarlinFuncPtr k3m_nvfp4_kernel(const host::ScalarType q_type, int thread_m_blocks, int thread_n_blocks,
                               int thread_k_blocks, bool m_block_size_8, bool has_act_order, bool has_zp,
                               int group_blocks, int num_threads, bool is_zp_float) {
  (void)has_act_order;
  (void)has_zp;
  auto kernel = MarlinDefault;
  if (false) {
  }
  NVFP4_GET_IF(host::kFE2M1f)
  return kernel;
}

template <>
MarlinFuncPtr get_marlin_kernel<bf16_t, K3M_EP_B, false, K3M_SORTED_B, K3M_ZERO_B, K3M_SORTED_B>(
    const host::ScalarType q_type, int thread_m_blocks, int thread_n_blocks, int thread_k_blocks,
    bool m_block_size_8, bool has_act_order, bool has_zp, int group_blocks, int num_threads, bool is_zp_float) {
  if (has_act_order || has_zp) return MarlinDefault;  // NVFP4 has neither
  return k3m_nvfp4_kernel<bf16_t, K3M_EP_B, false, K3M_SORTED_B, K3M_ZERO_B, K3M_SORTED_B>(
      q_type, thread_m_blocks, thread_n_blocks, thread_k_blocks, m_block_size_8, has_act_order, has_zp,
      group_blocks, num_threads, is_zp_float);
}

}  // namespace sglang::device::marlin_moe

#define K3M_CAT2(a, b, c) gemm_ep##a##_z##b
#define K3M_NAME(a, b) K3M_CAT2(a, b, _)

namespace k3m {

void K3M_NAME(K3M_IS_EP, K3M_ZERO_INACTIVE)(const GemmArgs& g) {
  const int d = g.device;
  const int64_t groups = g.size_k / 16;  // NVFP4: one e4m3 scale per 16 weights along K
  View a(g.a, kBF16, d, {g.size_m, g.size_k});
  View c(g.c, kBF16, d, {g.size_m * g.top_k, g.size_n});
  View b_q(g.b_q, kI32, d, {g.num_experts, g.size_k / 16, g.size_n * 2});
  View bias(nullptr, kBF16, d, {0});
  View scales(g.b_scales, kE4M3, d, {g.num_experts, groups, g.size_n});
  View global_scale(g.global_scale, kBF16, d, {g.num_experts});
  View zeros(nullptr, kBF16, d, {0});
  View g_idx(nullptr, kI32, d, {0});
  View perm(nullptr, kI32, d, {0});
  View workspace(g.workspace, kI32, d, {g.workspace_numel});
  View sorted(g.sorted_ids, kI32, d, {g.sorted_numel});
  View experts(g.expert_ids, kI32, d, {g.expert_ids_numel});
  View num_post(g.num_post, kI32, d, {g.num_post_numel});
  View topk_w(g.topk_weights, kF32, d, {g.size_m * g.top_k});
  View a_tmp(nullptr, kBF16, d, {0});
  View c_tmp(g.c_tmp, kF32, d, {g.c_tmp_numel});
  sglang::moe_wna16_marlin_gemm<sglang::bf16_t, K3M_EP_B, false, K3M_SORTED_B, K3M_ZERO_B, K3M_SORTED_B>(
      &a.t, &c.t, &b_q.t, &bias.t, &scales.t, &global_scale.t, &zeros.t, &g_idx.t, &perm.t, &workspace.t,
      &sorted.t, &experts.t, &num_post.t, &topk_w.t, &a_tmp.t, &c_tmp.t, g.moe_block_size, g.top_k,
      g.mul_topk_weights, K3M_EP_B, sglang::host::kFE2M1f.id(), g.size_m, g.size_n, g.size_k,
      /*has_act_order=*/false, /*has_bias=*/false, /*is_k_full=*/true, /*has_zp=*/false, groups,
      /*group_size=*/16, g.use_atomic_add, g.use_fp32_reduce, /*is_zp_float=*/false);
}

}  // namespace k3m
