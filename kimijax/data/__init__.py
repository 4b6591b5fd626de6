"""Data package: byte tokenizer, corpora, MQAR, and the grain pipeline."""

from kimijax.data.mqar import mqar_batch
from kimijax.data.pipeline import (
    DataLoader,
    data_report,
    default_data_config,
    eval_batches,
    make_loader,
    pack_documents,
)
from kimijax.data.sources import (
    DataError,
    split_files,
    stdlib_documents,
    stdlib_files,
    text_documents,
)
from kimijax.data.tokenizer import EOS_ID, PAD_ID, ByteTokenizer

__all__ = [
    'ByteTokenizer', 'DataError', 'DataLoader', 'EOS_ID', 'PAD_ID', 'data_report',
    'default_data_config', 'eval_batches', 'make_loader', 'mqar_batch',
    'pack_documents', 'split_files', 'stdlib_documents', 'stdlib_files',
    'text_documents',
]
