"""The backend names the plugin registers with SGLang (``--moe-runner-backend``). A module of its
own so that every part of the plugin imports them without importing the package's entry point."""

BACKEND_NAME = "triton_situ"
# The slow-but-exact arm: the same MoE in plain torch from the checkpoint's own tensors
# (kernels/moe_torch_backend.py), for accuracy debugging and server A/Bs.
REFERENCE_BACKEND_NAME = "torch_reference"
