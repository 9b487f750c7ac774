"""Public sliding-window attention: the Triton kernels behind the reference's packed-stream contract.

``flash_msa.window.window.range_attention`` (the kernel set shared with compressed attention)
stays internal: its backward needs exact query ranges per key row, which only the range
builders in this package guarantee.
"""
from flash_msa.window.window import window_attention

__all__ = ["window_attention"]
