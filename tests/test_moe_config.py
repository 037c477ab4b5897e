"""Launch configs: file naming, JSON loading, nearest batch size, heuristic."""

from __future__ import annotations

import json

import pytest

from k3nvfp4.kernels.moe_details import config as cfgmod
from k3nvfp4.kernels.moe_details.config import (
    MoEConfig,
    config_file_name,
    get_moe_config,
    load_moe_configs,
)


def test_file_name_sglang_style():
    assert config_file_name(896, 3584, 192, "NVIDIA_H200") == "E=896,N=192,H=3584,device_name=NVIDIA_H200,dtype=nvfp4.json"


def test_nearest_batch_size_from_env_dir(tmp_path, monkeypatch):
    a = MoEConfig(block_m=16, block_n1=32)
    b = MoEConfig(block_m=64, swap_ab=False, block_n2=128, num_warps2=8)
    (tmp_path / config_file_name(8, 64, 32, "dev")).write_text(json.dumps({"1": a.to_dict(), "256": b.to_dict()}))
    monkeypatch.setenv(cfgmod.CONFIG_DIR_ENV, str(tmp_path))
    assert get_moe_config(8, 64, 32, 2, 1, "dev") == a
    assert get_moe_config(8, 64, 32, 2, 4, "dev") == a  # nearest in log space, within 4x
    assert get_moe_config(8, 64, 32, 2, 100, "dev") == b  # 256/100 < 100/1
    assert get_moe_config(8, 64, 32, 2, 1024, "dev") == b
    # more than 4x from every tuned batch size: the heuristic, not a far-away config
    assert get_moe_config(8, 64, 32, 2, 16, "dev") == MoEConfig.heuristic(8, 64, 32, 2, 16)
    assert get_moe_config(8, 64, 32, 2, 10**6, "dev") == MoEConfig.heuristic(8, 64, 32, 2, 10**6)
    # another shape or device: heuristic
    assert get_moe_config(8, 64, 48, 2, 1, "dev") == MoEConfig.heuristic(8, 64, 48, 2, 1)
    assert load_moe_configs(8, 64, 32, "other") is None


def test_bad_files_are_named(tmp_path):
    p = tmp_path / config_file_name(8, 64, 32, "dev")
    p.write_text(json.dumps({"x": {}}))
    with pytest.raises(ValueError, match="not a batch size"):
        load_moe_configs(8, 64, 32, "dev", tmp_path)
    p.write_text(json.dumps({"4": {"block_m": 16, "bogus": 1}}))
    with pytest.raises(ValueError, match="bogus"):
        load_moe_configs(8, 64, 32, "dev", tmp_path)
    p.write_text(json.dumps({"4": {"block_m": 24}}))
    with pytest.raises(ValueError, match="block_m"):
        load_moe_configs(8, 64, 32, "dev", tmp_path)


def test_config_validation():
    with pytest.raises(ValueError, match="block_k1"):
        MoEConfig(block_k1=16)
    with pytest.raises(ValueError, match="num_stages2"):
        MoEConfig(num_stages2=0)
    assert MoEConfig.from_dict(MoEConfig(split_k2=4).to_dict()) == MoEConfig(split_k2=4)


def test_heuristic_rules():
    decode = MoEConfig.heuristic(896, 3584, 192, 16, 1, arch=90)  # K3 TP16 at batch 1: 16 pairs
    assert decode.block_m == 16 and decode.swap_ab
    assert decode.split_k1 > 1  # 16 blocks x 3 column tiles: split over H to put bytes in flight
    assert 192 % decode.block_n1 == 0  # no padding rows (I = 192)
    prefill = MoEConfig.heuristic(56, 3584, 3072, 16, 16384, arch=90, num_global_experts=896)
    assert prefill.atomic_reduce  # fp32 [M*k, H] would be 3.8 GB
    assert not MoEConfig.heuristic(896, 3584, 192, 16, 64, arch=90).atomic_reduce
    # Small shapes get a config too (the interpreter tests run them).
    tiny = MoEConfig.heuristic(4, 48, 16, 2, 64, arch=90)
    assert tiny.block_m in (16, 32) and tiny.swap_ab


def test_heuristic_is_expert_parallel_aware():
    """Under EP the ids range over all 896 experts and only 56 (EP16) / 28 (EP32) are local: at
    M = 1 an EP rank expects ~1 local pair, not 16 (so few programs that it splits K to keep
    bytes in flight), and at M = 256 ~4.6 (EP16) / 2.3 (EP32) pairs per local expert, not 73 /
    146 (16-token blocks, not 32)."""
    for E in (56, 28):
        ep = MoEConfig.heuristic(E, 3584, 3072, 16, 1, arch=90, num_global_experts=896)
        blind = MoEConfig.heuristic(E, 3584, 3072, 16, 1, arch=90)  # as if every pair were local
        assert ep.split_k1 > 1 and ep.split_k2 > 1, ep
        assert blind.split_k1 == 1 and blind.split_k2 == 1, blind
        ep = MoEConfig.heuristic(E, 3584, 3072, 16, 256, arch=90, num_global_experts=896)
        blind = MoEConfig.heuristic(E, 3584, 3072, 16, 256, arch=90)
        assert ep.block_m == 16 and blind.block_m == 32, (ep, blind)
    # The same global routing on a full replica (E = E_global) is the TP heuristic.
    assert MoEConfig.heuristic(896, 3584, 192, 16, 64, arch=90, num_global_experts=896) == \
        MoEConfig.heuristic(896, 3584, 192, 16, 64, arch=90)
    # get_moe_config hands it through when no tuned file exists.
    assert get_moe_config(56, 3584, 3072, 16, 1024, "no-such-device", arch=90, num_global_experts=896) == \
        MoEConfig.heuristic(56, 3584, 3072, 16, 1024, arch=90, num_global_experts=896)


def test_fused_moe_passes_the_global_expert_count(monkeypatch):
    """fused_moe_nvfp4(num_global_experts=...) reaches the config lookup; a count below the local
    experts is refused with the argument's name."""
    import torch

    from k3nvfp4.kernels import moe
    from k3nvfp4.kernels.testing import random_nvfp4_moe_weights, random_routing

    seen = {}

    class Stop(Exception):
        pass

    def fake(E, H, I, k, M, **kw):
        seen.update(E=E, M=M, **kw)
        raise Stop

    monkeypatch.setattr(moe, "get_moe_config", fake)
    w = random_nvfp4_moe_weights(4, 64, 32)
    tw, ids = random_routing(3, 2, 4, num_global_experts=16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(Stop):
        moe.fused_moe_nvfp4(x, w, tw, ids, num_global_experts=16)
    assert seen["num_global_experts"] == 16 and seen["E"] == 4
    with pytest.raises(ValueError, match="num_global_experts=2"):
        moe.fused_moe_nvfp4(x, w, tw, ids, num_global_experts=2)
