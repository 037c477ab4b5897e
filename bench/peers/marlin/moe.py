"""SGLang 0.5.23's NVFP4 marlin MoE forward (fused_marlin_moe), on libk3marlin, without sglang.

One call does what ``fused_experts_none_to_marlin`` -> ``fused_marlin_moe`` does on an H200 for
bf16 activations and NVFP4 weights (``MarlinMoEWeights``), in the same order, with the same
buffer sizes and flags:

  1. block size: the smallest of 8, 16, 32, 48, 64 with M * top_k / E / block < 0.9 (else 64);
  2. alignment: M == 1 without EP -> SGLang's moe_align_single_token (CUDA); otherwise SGLang's
     CUDA moe_align_block_size over global_experts + 1 buckets, with the inactive-prefix count
     exactly when EP is off. Two substitutions, both SGLang's own CUDA align kernel in place of
     a kernel the GPU machine cannot run: (a) SGLang takes a single-CTA Triton kernel
     (moe_align_small_numel, sglang Python) when M * top_k <= 64 and more than 64 buckets,
     i.e. TP16 M = 4 and EP16 M <= 4; (b) with EP it calls sgl_kernel's compiled align
     (sgl_kernel is not on the GPU machine). ``align_path`` says which ran;
  3. a fresh zeroed int32 workspace of SMs x 4 (marlin_make_workspace(max_blocks_per_sm=4),
     per call, as SGLang's runner does so CUDA graphs never share its locks);
  4. GEMM1 (moe_wna16_marlin_gemm: gate/up, N = 2I, K = H, top_k rows per token, fp32 reduce,
     atomic-add reduce on sm >= 90 as SGLang enables it for bf16);
  5. the SiTU activation as a separate kernel (activation.py: SGLang's separate Triton kernel);
  6. GEMM2 (down, N = H, K = I, one row per route, router weights applied, inactive rows zeroed);
  7. the top-k sum. SGLang sums with sgl_kernel's moe_sum_reduce (routed_scaling_factor 1);
     that compiled kernel is absent, so SGLang's own CUDA JIT moe_topk_sum (the one its MXFP4
     path uses: same sum, ~1.5 us vs ~5.7 us by SGLang's comment) runs: this favours marlin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .activation import situ_and_mul_into
from .lib import MarlinLib
from .prepare import MarlinMoEWeights

from ..marlin_sass import moe_block_size  # fused_marlin_moe's block_size_m loop (one copy)

SMALL_NUMEL_LIMIT = 64  # sglang moe_align_small_numel: the Triton path's limit
CUDA_SMALL_BATCH_MAX_BUCKETS = 64


def align_path(tokens: int, top_k: int, global_experts: int, is_ep: bool) -> tuple[str, str]:
    """(what SGLang runs, what runs here) for the routing alignment."""
    numel = tokens * top_k
    if tokens == 1 and top_k <= 32 and not is_ep:
        return "moe_align_single_token (CUDA JIT)", "moe_align_single_token (CUDA JIT)"
    if numel <= SMALL_NUMEL_LIMIT and global_experts + 1 > CUDA_SMALL_BATCH_MAX_BUCKETS:
        return "moe_align_small_numel (Triton, sglang)", "moe_align_block_size (CUDA JIT) in its place"
    if is_ep:
        return "moe_align_block_size (sgl_kernel)", "moe_align_block_size (CUDA JIT) in its place"
    return "moe_align_block_size (CUDA JIT)", "moe_align_block_size (CUDA JIT)"


@dataclass
class Aligned:
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_post: torch.Tensor
    block_size: int


class MarlinMoE:
    """fused_marlin_moe for one layer's prepared experts. ``global_experts``: the routed experts of
    the model (EP: ids are local in [0, E) or -1, as SGLang's dispatcher maps them)."""

    def __init__(self, lib: MarlinLib, weights: MarlinMoEWeights, global_experts: int,
                 situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0):
        self.lib, self.w = lib, weights
        self.global_experts = global_experts
        self.is_ep = global_experts != weights.num_experts
        self.beta, self.linear_beta = situ_beta, situ_linear_beta
        dev = weights.w13.device
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # SGLang: use_atomic_add for fp16, or capability major >= 9 (not MXFP4); bf16 here.
        self.use_atomic_add = torch.cuda.get_device_capability(dev)[0] >= 9

    def align(self, topk_ids: torch.Tensor, block: int) -> Aligned:
        M, top_k = topk_ids.shape
        dev = topk_ids.device
        if M == 1 and top_k <= 32 and not self.is_ep:
            sorted_ids = torch.empty(top_k * block, dtype=torch.int32, device=dev)
            expert_ids = torch.empty(top_k, dtype=torch.int32, device=dev)
            num_post = torch.empty(2, dtype=torch.int32, device=dev)
            self.lib.align_single_token(topk_ids, block, sorted_ids, expert_ids, num_post, True)
            return Aligned(sorted_ids, expert_ids, num_post, block)
        numel, buckets = topk_ids.numel(), self.global_experts + 1
        padded = numel * block if numel < buckets else numel + buckets * (block - 1)
        padded = (padded + 3) // 4 * 4
        sorted_ids = torch.empty(padded, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(-(-padded // block), dtype=torch.int32, device=dev)
        prefix = not self.is_ep
        num_post = torch.empty(2 if prefix else 1, dtype=torch.int32, device=dev)
        cumsum = torch.empty(buckets + 1, dtype=torch.int32, device=dev)
        self.lib.align_block_size(topk_ids.contiguous(), buckets, block, sorted_ids, expert_ids, num_post, cumsum,
                                  prefix)
        return Aligned(sorted_ids, expert_ids, num_post, block)

    def _gemm(self, a, c, b_q, scales, gscale, workspace, al: Aligned, topk_weights, *, top_k, size_m, size_n,
              size_k, mul_topk_weights, zero_inactive_output):
        c_tmp_numel = 0
        if not self.use_atomic_add:  # use_fp32_reduce without atomics: SGLang's c_tmp size
            c_tmp_numel = min(size_n * al.sorted_ids.numel(), self.sms * 4 * al.block_size * 256)
            c_tmp_numel *= 2 if al.block_size == 8 else 1
        c_tmp = torch.empty(c_tmp_numel, dtype=torch.float32, device=a.device)
        self.lib.marlin_gemm(a, c, b_q, scales, gscale, workspace, al.sorted_ids, al.expert_ids, al.num_post,
                             topk_weights, c_tmp, moe_block_size=al.block_size, top_k=top_k, size_m=size_m,
                             size_n=size_n, size_k=size_k, mul_topk_weights=mul_topk_weights, is_ep=self.is_ep,
                             zero_inactive_output=zero_inactive_output, use_atomic_add=self.use_atomic_add,
                             use_fp32_reduce=True)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x bf16 [M, H], topk_weights float32 [M, top_k], topk_ids int32 [M, top_k] -> bf16 [M, H]."""
        w = self.w
        M, H = x.shape
        I, E = w.intermediate_size, w.num_experts
        top_k = topk_ids.shape[1]
        if x.dtype != torch.bfloat16 or H != w.hidden_size:
            raise ValueError(f"x: expected bf16 [M, {w.hidden_size}], got {x.dtype} {tuple(x.shape)}")
        if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_ids must be int32 and topk_weights float32, got {topk_ids.dtype}, {topk_weights.dtype}")
        block = moe_block_size(M, top_k, E)
        al = self.align(topk_ids, block)
        workspace = torch.zeros(self.sms * 4, dtype=torch.int32, device=x.device)
        cache13 = torch.empty(M * top_k * max(2 * I, H), dtype=x.dtype, device=x.device)
        cache1 = cache13[: M * top_k * 2 * I].view(-1, 2 * I)
        cache2 = torch.empty(M * top_k, I, dtype=x.dtype, device=x.device)
        cache3 = cache13[: M * top_k * H].view(-1, H)
        self._gemm(x.contiguous(), cache1, w.w13, w.w13_scale, w.w13_global_scale, workspace, al, topk_weights,
                   top_k=top_k, size_m=M, size_n=2 * I, size_k=H, mul_topk_weights=False, zero_inactive_output=False)
        situ_and_mul_into(cache2, cache1, self.beta, self.linear_beta)
        self._gemm(cache2, cache3, w.w2, w.w2_scale, w.w2_global_scale, workspace, al, topk_weights, top_k=1,
                   size_m=M * top_k, size_n=H, size_k=I, mul_topk_weights=True, zero_inactive_output=True)
        out = torch.empty_like(x) if out is None else out
        self.lib.topk_sum(cache3.view(M, top_k, H), out)
        return out
