// Internal declarations shared by the translation units of libk3marlin (not exported).
// Our code only: each *.cu beside this file includes SGLang's own marlin / align / sum
// sources from the installed sglang package at build time (bench/peers/marlin/build.py).
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>

namespace k3m {

// A DLTensor with its own shape/stride storage (contiguous, row-major), so that SGLang's
// tvm::ffi::TensorView-taking host functions can be called with raw pointers.
struct View {
  DLTensor t{};
  int64_t shape[4]{};
  int64_t strides[4]{};

  View(const void* data, DLDataType dtype, int device, std::initializer_list<int64_t> dims) {
    int n = 0;
    for (int64_t d : dims) shape[n++] = d;
    int64_t s = 1;
    for (int i = n - 1; i >= 0; --i) {
      strides[i] = s;
      s *= shape[i] > 0 ? shape[i] : 1;
    }
    t.data = const_cast<void*>(data);
    t.device = DLDevice{kDLCUDA, device};
    t.ndim = n;
    t.dtype = dtype;
    t.shape = shape;
    t.strides = strides;
    t.byte_offset = 0;
  }
};

constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kE4M3{kDLFloat8_e4m3fn, 8, 1};

// Arguments of one moe_wna16_marlin_gemm call (bf16 activations, NVFP4 weights), already checked.
struct GemmArgs {
  int device;
  const void* a;            // bf16 [size_m, size_k]
  void* c;                  // bf16 [size_m * top_k, size_n]
  const void* b_q;          // int32 [E, size_k / 16, size_n * 2] (marlin-repacked e2m1)
  const void* b_scales;     // e4m3 [E, size_k / 16, size_n] (marlin-permuted, processed)
  const void* global_scale; // bf16 [E] (processed)
  void* workspace;          // int32 [workspace_numel], zeroed
  int64_t workspace_numel;
  const void* sorted_ids;   // int32 [sorted_numel]
  int64_t sorted_numel;
  const void* expert_ids;   // int32 [expert_ids_numel]
  int64_t expert_ids_numel;
  const void* num_post;     // int32 [num_post_numel]
  int64_t num_post_numel;
  const void* topk_weights; // float32 [size_m, top_k] (GEMM1) or [size_m] (GEMM2, top_k == 1)
  void* c_tmp;              // float32 [c_tmp_numel] (may be empty)
  int64_t c_tmp_numel;
  int64_t num_experts, moe_block_size, top_k, size_m, size_n, size_k;
  bool mul_topk_weights, use_atomic_add, use_fp32_reduce;
};

// One per instantiated specialization: (kIsEP, kZeroInactiveOutput); sorted ids and the
// inactive-prefix count are on exactly when EP is off, as fused_marlin_moe passes them.
void gemm_ep0_z0(const GemmArgs& g);
void gemm_ep0_z1(const GemmArgs& g);
void gemm_ep1_z0(const GemmArgs& g);
void gemm_ep1_z1(const GemmArgs& g);

void repack_fp4(int device, const void* in, void* out, int64_t size_k, int64_t size_n);

void align_block_size(int device, const void* topk_ids, int64_t numel, int64_t num_buckets, int64_t block_size,
                      void* sorted_ids, int64_t sorted_numel, void* expert_ids, int64_t expert_ids_numel,
                      void* num_post, int64_t num_post_numel, void* cumsum, int64_t cumsum_numel,
                      bool write_inactive_prefix_count);
void align_single_token(int device, const void* topk_ids, int64_t topk, int64_t block_size, void* sorted_ids,
                        int64_t sorted_numel, void* expert_ids, int64_t expert_ids_numel, void* num_post,
                        int64_t num_post_numel, bool write_inactive_prefix_count);

void topk_sum(int device, const void* in, void* out, int64_t m, int64_t topk, int64_t k);

}  // namespace k3m
