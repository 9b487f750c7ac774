"""Public sliding-window attention: the Triton kernels behind the reference's packed-stream contract."""
from flash_msa.window.window import range_attention, window_attention

__all__ = ["range_attention", "window_attention"]
