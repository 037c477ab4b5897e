"""Test set-up shared by the whole suite.

Without a CUDA device the Triton kernels run in the interpreter; TRITON_INTERPRET must be
set before any Triton kernel is defined, so it is set here, before test modules import.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

# Interpreter runs are slow and CI has two cores: few examples, no per-example deadline.
settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The slowest files first, longest first (seconds per file on one of two xdist workers, 2 cores,
# cold Triton cache, 2026-12-06, pytest 742 s on this VM, about 0.75x that on CI): with two
# workers (`make test`: --dist loadfile --no-loadscope-reorder, without which xdist ignores this
# order) a long file started last would finish alone (test_weak_memory did: 37 s after the other
# worker). launch_configs 328 (its compiles share the cores with the servers), K3 servers 193,
# model_class 112, tiny-Llama servers 101, test_moe 97, checkpoint_ranks 56, memory_ordering 50,
# launches 49, weak_memory 43, packaging 40, sglang_plugin 36, checkpoint_pool 35.
SLOW_FIRST = ("test_launch_configs.py", "test_real_server_k3.py", "test_model_class.py", "test_real_server.py",
              "test_moe.py", "test_checkpoint_ranks.py", "test_memory_ordering.py", "test_launches.py",
              "test_weak_memory.py", "test_packaging.py", "test_sglang_plugin.py", "test_checkpoint_pool.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: file order kept otherwise


@pytest.fixture(scope="session")
def static_report(tmp_path_factory):
    """bench/sass_report.py's compiles of every shipped kernel, once per test session (shared by
    the xdist workers): tests/shared_compiles.py."""
    from shared_compiles import static_report as run

    return run(tmp_path_factory)
