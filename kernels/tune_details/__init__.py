"""Private pieces of k3nvfp4.kernels.tune: what the tuner searches per kernel mode (modes.py)."""
