"""k3nvfp4.kernels.testing: the random problems the other tests, the tuner and the A/B build on."""

from __future__ import annotations

import pytest
import torch

from k3nvfp4.kernels import formats, testing


def test_kimi_routing_local_range_is_the_global_routing_renumbered():
    tw, gids = testing.kimi_routing(40, 6, 32, seed=2)
    assert tw.dtype == torch.float32 and gids.dtype == torch.int32 and gids.shape == (40, 6)
    assert all(len(set(r.tolist())) == 6 for r in gids)  # distinct experts per token
    torch.testing.assert_close(tw.sum(-1), torch.ones(40))
    ltw, lids = testing.kimi_routing(40, 6, 32, local_experts=range(8, 16), seed=2)
    assert torch.equal(ltw, tw)  # weights are the global routing's, whichever rank looks
    expect = torch.where((gids >= 8) & (gids < 16), gids - 8, torch.full_like(gids, -1))
    assert torch.equal(lids, expect) and (lids >= 0).any() and (lids == -1).any()
    with pytest.raises(ValueError, match="top_k=33"):
        testing.kimi_routing(4, 33, 32)


def test_sigmoid_topk_routing_hand_computed():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # expert 2 wins selection, its weight stays its score
    tw, ids = testing.sigmoid_topk_routing(logits, bias, 2)
    s = torch.sigmoid(logits[0])
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(tw, (torch.stack([s[2], s[1]]) / (s[2] + s[1]))[None])
    _, local = testing.sigmoid_topk_routing(logits, bias, 2, local_experts=range(1, 2))
    assert local.tolist() == [[-1, 0]]


def test_random_weights_block_scale_kinds():
    pow2 = testing.random_nvfp4_moe_weights(2, 32, 16, seed=1)
    uni = testing.random_nvfp4_moe_weights(2, 32, 16, seed=1, block_scales="uniform")
    pow2_bits = pow2.to_modelopt().w13_scale.view(torch.uint8)
    uni_scale = uni.to_modelopt().w13_scale
    assert int((pow2_bits & 0x7).sum()) == 0  # E4M3 mantissa bits 0: powers of two
    v = formats.e4m3_to_float(uni_scale)
    assert (uni_scale.view(torch.uint8) & 0x7).any() and float(v.min()) >= 0.5 and float(v.max()) <= 2.0
    assert not torch.equal(uni.w13_scale_2[:, 0], uni.w13_scale_2[:, 1])  # gate != up
    with pytest.raises(ValueError, match="block_scales"):
        testing.random_nvfp4_moe_weights(2, 32, 16, block_scales="e8m0")
