"""Fixtures of the data tests: a byte-level BPE trained on stdlib source at test time, and the
same BPE as a tiktoken file."""

import data_helpers
import pytest


@pytest.fixture(scope='session')
def bpe_json(tmp_path_factory):
  """tokenizer.json (+ tokenizer_config.json) of a 1,000-id byte-level BPE trained on 40 stdlib modules."""
  from kimijax.data import bpe_train

  directory = tmp_path_factory.mktemp('bpe')
  return bpe_train.save_bpe(bpe_train.train_bpe(data_helpers.stdlib_texts(40), 1000), directory)


@pytest.fixture(scope='session')
def tiktoken_path(bpe_json, tmp_path_factory):
  """bpe_json's ranks as a tiktoken BPE file, alone in its folder (no sidecar: the 'default' preset)."""
  path = tmp_path_factory.mktemp('tiktoken') / 'bpe.tiktoken'
  data_helpers.write_tiktoken(bpe_json, path)
  return path
