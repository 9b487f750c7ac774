from flash_msa.utils.validation import trusted_inputs
from flash_msa.utils.varlen import compressed_cu_seqlens, default_cu_seqlens, token_seq_bounds

__all__ = ["trusted_inputs", "compressed_cu_seqlens", "default_cu_seqlens", "token_seq_bounds"]
