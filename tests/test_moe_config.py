"""Launch configs: file naming, JSON loading, nearest batch size, heuristic."""

from __future__ import annotations

import json

import pytest

from k3nvfp4.kernels.moe_details import config as cfgmod
from k3nvfp4.kernels.moe_details.config import (
    MoEConfig,
    config_file_name,
    get_moe_config,
    heuristic_moe_config,
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
    assert get_moe_config(8, 64, 32, 2, 16, "dev") == heuristic_moe_config(8, 64, 32, 2, 16)
    assert get_moe_config(8, 64, 32, 2, 10**6, "dev") == heuristic_moe_config(8, 64, 32, 2, 10**6)
    # another shape or device: heuristic
    assert get_moe_config(8, 64, 48, 2, 1, "dev") == heuristic_moe_config(8, 64, 48, 2, 1)
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
    decode = heuristic_moe_config(896, 3584, 192, 16, 1)  # K3 TP16 at batch 1: 16 pairs
    assert decode.block_m == 16 and decode.swap_ab
    assert decode.split_k1 > 1  # few programs: split over H
    prefill = heuristic_moe_config(56, 3584, 3072, 16, 16384)  # EP16 prefill: ~4.7k pairs/expert
    assert prefill.block_m == 128 and not prefill.swap_ab and prefill.split_k1 == 1
    assert prefill.atomic_reduce  # fp32 [M*k, H] would be 3.8 GB
    assert not heuristic_moe_config(896, 3584, 192, 16, 64).atomic_reduce
    assert heuristic_moe_config(4, 48, 16, 2, 64).block_m == 32
