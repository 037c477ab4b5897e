"""Test set-up shared by the whole suite.

Without a CUDA device the Triton kernels run in the interpreter; TRITON_INTERPRET must be
set before any Triton kernel is defined, so it is set here, before test modules import.
"""

import os

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


# The slowest files first (measured, `make test` prints --durations=25): with two xdist workers
# (`make test`, --dist loadfile) a long file started last would finish alone.
SLOW_FIRST = ("test_real_server_k3.py", "test_launch_configs.py", "test_real_server.py", "test_model_class.py",
              "test_mxfp4_serving.py", "test_sglang_plugin.py", "test_memory_ordering.py", "test_launches.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: file order kept otherwise
