"""kimijax/data/tokenizer*.py: the byte, tokenizer.json and tiktoken tokenizers round-trip text,
never emit EOS inside a document, take EOS / BOS / PAD and the model vocabulary from the tokenizer,
and name the file of a tokenizer that does not parse."""

import json
import shutil

import data_helpers
import ml_collections
import numpy as np
import pytest

from kimijax.data import DataError, load_tokenizer, model_vocab_size
from kimijax.data.tokenizer import ByteTokenizer, config_vocab_size


def raises_one_line(match, fn, *args):
  with pytest.raises(DataError) as err:
    fn(*args)
  message = str(err.value)
  assert '\n' not in message
  for m in match:
    assert m in message, message
  return message


def round_trip_texts():
  return data_helpers.documents() + data_helpers.stdlib_texts(15, start=80)  # the last: unseen in training


def test_byte_tokenizer_unchanged():
  tok = load_tokenizer('byte')
  assert isinstance(tok, ByteTokenizer)
  assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (258, 256, 257, None)
  assert tok.token_dtype == np.uint16
  assert tok.encode('hé').tolist() == [104, 0xC3, 0xA9]
  assert [t.tolist() for t in tok.encode_batch(['a', b'\xff'])] == [[97], [255]]


@pytest.mark.parametrize('kind', ['hf', 'tiktoken'])
def test_round_trip_and_no_eos_inside_documents(kind, bpe_json, tiktoken_path):
  tok = load_tokenizer(f'hf:{bpe_json}' if kind == 'hf' else f'tiktoken:{tiktoken_path}')
  texts = round_trip_texts()
  total_ids = total_bytes = 0
  for text, ids in zip(texts, tok.encode_batch(texts)):
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert tok.decode(ids) == text
    assert not np.isin(ids, [tok.eos_id, tok.pad_id]).any()
    assert ids.min() >= 0 and ids.max() < tok.vocab_size
    total_ids, total_bytes = total_ids + len(ids), total_bytes + len(text.encode())
  assert total_ids < 0.6 * total_bytes  # a BPE: merges happen
  assert tok.decode(np.array([tok.eos_id, *tok.encode('ab'), tok.pad_id])) == 'ab'  # specials dropped
  assert tok.decode(tok.encode(b'bytes \xff')) == 'bytes \ufffd'


def test_hf_specials_from_sidecar(bpe_json):
  tok = load_tokenizer(f'hf:{bpe_json}')
  vocab = json.loads(bpe_json.read_text())['model']['vocab']
  assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (1000, vocab['<|endoftext|>'], vocab['<|pad|>'], None)
  assert tok.token_dtype == np.uint16


def test_tiktoken_default_preset(tiktoken_path):
  n_ranks = len(tiktoken_path.read_text().splitlines())
  tok = load_tokenizer(f'tiktoken:{tiktoken_path}')
  assert tok.preset == 'default'
  assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (n_ranks + 1, n_ranks, n_ranks, None)


def test_tiktoken_long_documents_encode_as_a_whole(tiktoken_path):
  """Pieces cut at newlines give the ids of encoding the whole text (tiktoken itself is the reference)."""
  import tiktoken

  from kimijax.data import tokenizer_tiktoken as tt

  tok = load_tokenizer(f'tiktoken:{tiktoken_path}')
  ranks = tt.read_ranks(tiktoken_path, 'test')
  reference = tiktoken.Encoding('ref', pat_str=tt.PRESETS['default'][0], mergeable_ranks=ranks, special_tokens={})
  text = '\n'.join(data_helpers.stdlib_texts(8, start=30))
  assert len(text) > 3 * tt.MAX_PIECE_CHARS
  assert len(tt.split_long(text)) > 3
  assert ''.join(tt.split_long(text)) == text
  assert all(len(p) <= tt.MAX_PIECE_CHARS for p in tt.split_long(text))
  assert tok.encode(text).tolist() == reference.encode_ordinary(text)


def test_tiktoken_kimi_preset_from_sidecar(tiktoken_path, tmp_path):
  n = len(tiktoken_path.read_text().splitlines())
  shutil.copy(tiktoken_path, tmp_path / 'tiktoken.model')
  (tmp_path / 'tokenizer_config.json').write_text(
    json.dumps(
      {
        'auto_map': {'AutoTokenizer': ['tokenization_kimi.TikTokenTokenizer', None]},
        'added_tokens_decoder': {
          str(n): {'content': '[BOS]'},
          str(n + 1): {'content': '[EOS]'},
          str(n + 4): {'content': '<|im_end|>'},
        },
        'bos_token': '[BOS]',
        'eos_token': '[EOS]',
      }
    )
  )
  tok = load_tokenizer(f'tiktoken:{tmp_path / "tiktoken.model"}')
  assert tok.preset == 'kimi'
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (n + 258, n, n + 1, n + 1)
  text = '漢字とEnglishの混在 HelloWorld 中文文本 123456'
  assert tok.decode(tok.encode(text)) == text
  for text in round_trip_texts()[:20]:
    assert tok.decode(tok.encode(text)) == text
  # The preset named without a sidecar: its special ids are all '<|reserved_token_ID|>', so no EOS.
  raises_one_line(['no end-of-document token'], load_tokenizer, f'tiktoken:{tiktoken_path}#kimi')
  assert tok.fingerprint != load_tokenizer(f'tiktoken:{tiktoken_path}').fingerprint


def test_tiktoken_named_openai_preset(tiktoken_path):
  tok = load_tokenizer(f'tiktoken:{tiktoken_path}#cl100k_base')
  assert (tok.vocab_size, tok.eos_id) == (100277, 100257)
  text = round_trip_texts()[0]
  assert tok.decode(tok.encode(text)) == text
  raises_one_line(["'nope'", 'preset'], load_tokenizer, f'tiktoken:{tiktoken_path}#nope')


def test_fingerprints(bpe_json, tiktoken_path, tmp_path):
  copy = tmp_path / 'elsewhere' / 'bpe.tiktoken'
  copy.parent.mkdir()
  shutil.copy(tiktoken_path, copy)
  prints = [
    load_tokenizer(s).fingerprint
    for s in ('byte', f'hf:{bpe_json}', f'tiktoken:{tiktoken_path}', f'tiktoken:{tiktoken_path}#r50k_base')
  ]
  assert len(set(prints)) == 4
  assert load_tokenizer(f'tiktoken:{copy}').fingerprint == prints[2]  # the bytes, not the path


def test_model_vocab_size():
  assert model_vocab_size(0, 258) == 384
  assert model_vocab_size(0, 1024) == 1024
  assert model_vocab_size(0, 163_842) == 163_968
  assert model_vocab_size(258, 258) == 258
  assert model_vocab_size(32768, 258) == 32768
  raises_one_line(
    ['model.vocab_size=1000', '1025', "data.tokenizer='hf:x'", '1152'], model_vocab_size, 1000, 1025, 'hf:x'
  )
  config = data_helpers.make_config(source='mqar', tokenizer='hf:/nonexistent')
  config.model = ml_collections.ConfigDict({'vocab_size': 0})
  assert config_vocab_size(config) == 384  # MQAR's ids are bytes whatever data.tokenizer says


def test_bad_tokenizer_files(tmp_path, bpe_json):
  raises_one_line(["data.tokenizer='sp:x'"], load_tokenizer, 'sp:x')
  raises_one_line(['does not exist'], load_tokenizer, f'hf:{tmp_path / "none.json"}')
  (tmp_path / 'bad.json').write_text('{"not": "a tokenizer"')
  raises_one_line(
    [str(tmp_path / 'bad.json'), 'not a tokenizers tokenizer.json'], load_tokenizer, f'hf:{tmp_path / "bad.json"}'
  )
  (tmp_path / 'bad.tiktoken').write_text('IQ== 0\nnot-base64! 1\n')
  raises_one_line([f'{tmp_path / "bad.tiktoken"}:2'], load_tokenizer, f'tiktoken:{tmp_path / "bad.tiktoken"}')
  (tmp_path / 'empty.tiktoken').write_text('\n')
  raises_one_line(['holds no ranks'], load_tokenizer, f'tiktoken:{tmp_path / "empty.tiktoken"}')
  # A tokenizer.json with no end-of-document token, then one whose sidecar names a missing token.
  data = json.loads(bpe_json.read_text())
  data['added_tokens'] = []
  vocab = data['model']['vocab']
  for name in ('<|endoftext|>', '<|pad|>'):
    vocab[name + 'x'] = vocab.pop(name)
  (tmp_path / 'noeos').mkdir()
  (tmp_path / 'noeos' / 'tokenizer.json').write_text(json.dumps(data))
  raises_one_line(['no end-of-document token', 'eos_token'], load_tokenizer, f'hf:{tmp_path}/noeos/tokenizer.json')
  (tmp_path / 'noeos' / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '</s>'}))
  raises_one_line(["'</s>'", 'tokenizer_config.json'], load_tokenizer, f'hf:{tmp_path}/noeos/tokenizer.json')


def test_bpe_training_is_deterministic():
  from kimijax.data import bpe_train

  texts = data_helpers.stdlib_texts(6, start=100)
  a = bpe_train.train_bpe(texts, 700).to_str()
  assert a == bpe_train.train_bpe(texts, 700).to_str()
  assert a != bpe_train.train_bpe(data_helpers.stdlib_texts(6, start=110), 700).to_str()
  with pytest.raises(DataError):
    bpe_train.train_bpe(texts, 100)
