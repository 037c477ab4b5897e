"""SGLang plugin of kimi-k3-nvfp4 (entry point group ``sglang.srt.plugins``)."""


def register() -> None:
    """Plugin entry point. CONTRACT STUB - to be implemented."""
