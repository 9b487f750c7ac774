from flash_msa.selection.interface import selected_attention

__all__ = ["selected_attention"]
