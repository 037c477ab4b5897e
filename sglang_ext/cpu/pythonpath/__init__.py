"""Not a package to import: the folder ``k3nvfp4.sglang_ext.cpu_server`` puts first on the CPU
server's PYTHONPATH, so that its files load as the top-level modules ``sitecustomize``,
``sgl_kernel`` and ``fla_interpreter_math`` (see k3nvfp4.sglang_ext.cpu)."""
