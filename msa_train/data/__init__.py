"""Training data: local files or a generated corpus, tokenised and packed for varlen attention.

See docs/data.md for the formats, the packing and label conventions and the validation.
"""
from .collate import collate_packed
from .config import DataConfig
from .dataset import build_packed_dataset, build_packed_datasets
from .generated import generate_corpus
from .packing import PackedDataset, PreferencePairDataset
from .sampler import ResumableSampler
from .sources import DataValidationError, RecordReport
from .tokenization import IGNORE_INDEX
from .tokenizer import TINY_VOCAB_SIZE, build_tokenizer, byte_tokenizer

__all__ = [
    "DataConfig", "DataValidationError", "IGNORE_INDEX", "PackedDataset", "PreferencePairDataset",
    "RecordReport", "ResumableSampler", "TINY_VOCAB_SIZE", "build_packed_dataset", "build_packed_datasets", "build_tokenizer",
    "byte_tokenizer", "collate_packed", "generate_corpus",
]
