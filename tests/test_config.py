"""kimijax/config.py and kimijax/schema.py: the declarations, the checks derived from them, the rules
between keys, and loading a config file by path with variants and overrides."""

import pathlib
import re
import subprocess
import sys

import ml_collections
import pytest
from absl import flags
from helpers import cpu_subprocess_env
from tiny_config import TINY

from kimijax import config as config_lib, schema
from kimijax.config import ConfigError, base_config, load, load_file, validate
from kimijax.ops import (
  attention as attention_ops,
  attnres as attnres_ops,
  kda as kda_ops,
  mla_decode as mla_decode_ops,
  short_conv as short_conv_ops,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _with(values: dict) -> ml_collections.ConfigDict:
  """base_config() with {'group.key': value} set whatever the value's type (a plain rebuild: the
  ConfigDict's own type check would refuse some of these before validate sees them)."""
  d = base_config().to_dict()
  for path, value in values.items():
    *groups, name = path.split('.')
    node = d
    for g in groups:
      node = node[g]
    node[name] = value
  return ml_collections.ConfigDict(d)


def _keys(section, prefix=''):
  for name, key in section.items():
    if isinstance(key, dict):
      yield from _keys(key, f'{prefix}{name}.')
    else:
      yield f'{prefix}{name}', key


# ----------------------------------------------------------------------------- the declarations


def test_base_config_is_the_declared_defaults_and_every_key_has_one_line_of_doc():
  c = base_config()
  declared = dict(_keys(config_lib.SCHEMA))
  assert 'model.kernels.kda' in declared and 'data.source' in declared and 'mesh.rules' in declared
  for path, key in declared.items():
    *groups, name = path.split('.')
    node = c
    for g in groups:
      node = node[g]
    assert node[name] == key.default, path
    assert key.doc and '\n' not in key.doc, path
  validate(c)


def test_the_data_section_is_declared_with_the_pipeline():
  from kimijax.data.pipeline import DATA_KEYS, SOURCES, default_data_config

  assert config_lib.SCHEMA['data'] is DATA_KEYS
  assert (
    default_data_config().to_dict()
    == base_config().data.to_dict()
    == {
      'source': 'stdlib',
      'path': '',
      'val_fraction': 0.05,
      'mqar_num_pairs': 16,
      'tokenizer': 'byte',
      'document_mask': False,
    }
  )
  assert list(DATA_KEYS['source'].allowed) == list(SOURCES)


def test_renamed_and_new_keys():
  m = base_config().model
  assert m.short_conv_impl == 'xla' and 'kda_conv_impl' not in m
  assert m.mla_decode_impl == 'xla'
  assert m.kernels.to_dict() == {
    'kda': '',
    'short_conv': '',
    'attnres_phase1': '',
    'attnres_merge_norm': '',
    'mla_decode': '',
    'moe': '',
  }


@pytest.mark.parametrize(
  'key,impls',
  [
    ('kda_impl', kda_ops.IMPLS),
    ('attn_impl', attention_ops.IMPLS),
    ('short_conv_impl', short_conv_ops.IMPLS),
    ('attnres_impl', attnres_ops.IMPLS),
    ('mla_decode_impl', mla_decode_ops.IMPLS),
  ],
  ids=['kda', 'attn', 'short_conv', 'attnres', 'mla_decode'],
)
def test_impl_keys_allow_the_names_of_the_ops_implementation_tables(key, impls):
  for name in impls:
    validate(_with({f'model.{key}': name}))
  with pytest.raises(
    ConfigError,
    match=rf"^model\.{key}='flash' is not allowed; allowed values: "
    rf'\[{", ".join(map(repr, impls))}\]$',
  ):
    validate(_with({f'model.{key}': 'flash'}))


# ----------------------------------------------------------------------------- generic checks


@pytest.mark.parametrize(
  'values,message',
  [
    ({'model.foo': 1}, "unknown config key 'model.foo'; known keys in 'model': ["),
    ({'bar': 1}, "unknown config key 'bar'; known keys here: ['data', 'mesh', 'model', 'optimizer', 'seed', 'train']"),
    ({'model.kernels': 'x'}, "config key 'model.kernels' must be a group with keys ['attnres_merge_norm'"),
    ({'train.steps': 1.5}, 'train.steps=1.5 is not an int (such as 1000 or 1e3)'),
    ({'train.steps': True}, 'train.steps=True is not an int'),
    ({'optimizer.learning_rate': 'fast'}, "optimizer.learning_rate='fast' is not a float"),
    ({'data.path': 3}, 'data.path=3 is not a string'),
    ({'model.kernels.kda': 0}, 'model.kernels.kda=0 is not a string'),
    ({'train.plot': 'yes'}, "train.plot='yes' is not allowed; allowed values: [True, False]"),
    ({'model.remat': 1}, 'model.remat=1 is not allowed; allowed values: [True, False]'),
    ({'model.position': 'alibi'}, "model.position='alibi' is not allowed; allowed values: ['rope', 'nope']"),
    ({'train.steps': 0}, 'train.steps=0 must be positive'),
    ({'train.grad_clip': -1.0}, 'train.grad_clip=-1.0 must be non-negative'),
    ({'train.loss_chunk': -1}, 'train.loss_chunk=-1 must be non-negative'),
    ({'optimizer.momentum': 1.0}, 'optimizer.momentum=1.0 must lie in [0, 1)'),
    ({'data.val_fraction': 0.0}, 'data.val_fraction=0.0 must lie in (0, 1)'),
    ({'model.kda_gate_lower_bound': 0.5}, 'model.kda_gate_lower_bound=0.5 must lie in [-5, 0]'),
    ({'mesh.tensor': 0}, 'mesh.tensor=0 must be a positive size or -1'),
    ({'mesh.rules': (('embed', 'model'),)}, "names mesh axis 'model'"),
    ({'model.layer_pattern': ''}, 'model.layer_pattern is empty'),
    (
      {'model.kernels.mla_decode': 'block_s=24'},
      "model.kernels.mla_decode='block_s=24': mla_decode pallas: block_s must be a power of two >= 16, got 24",
    ),
    (
      {'model.moe.impl': 'pallas', 'model.kernels.moe': 'block_m=24'},
      "model.kernels.moe='block_m=24' (model.moe.impl='pallas'): moe pallas: block_m must be a power of two",
    ),
    (
      {'model.moe.impl': 'mosaic', 'model.kernels.moe': 'stages=3/blok=2'},
      "model.kernels.moe='stages=3/blok=2' (model.moe.impl='mosaic'): moe mosaic: unknown keys ['blok']",
    ),
    (
      {'model.moe.impl': 'xla_blocked', 'model.kernels.moe': 'block_m=64'},
      "model.kernels.moe='block_m=64' (model.moe.impl='xla_blocked'): moe xla_blocked: unknown keys ['block_m']",
    ),
    (
      {'model.moe.impl': 'xla', 'model.kernels.moe': 'block_m=64'},
      "model.kernels.moe='block_m=64': model.moe.impl='xla' takes no settings",
    ),
  ],
)
def test_each_declaration_brings_its_checks(values, message):
  with pytest.raises(ConfigError) as info:
    validate(_with(values))
  assert message in str(info.value) and '\n' not in str(info.value), str(info.value)


def test_a_float_key_takes_an_int_and_a_missing_key_is_named():
  validate(_with({'optimizer.learning_rate': 1}))
  d = base_config().to_dict()
  del d['train']['plot']
  with pytest.raises(ConfigError, match="config key 'train.plot' is missing"):
    validate(ml_collections.ConfigDict(d))


def test_bounds():
  assert schema.in_bounds(0.0, '[0, 1)') and not schema.in_bounds(1.0, '[0, 1)')
  assert schema.in_bounds(-5.0, '[-5, 0]') and not schema.in_bounds(-5.01, '[-5, 0]')
  assert schema.in_bounds(1e9, '(0, inf)') and not schema.in_bounds(0, '(0, inf)')


@pytest.mark.parametrize(
  'text,current,want',
  [
    ('1e3', 1000, 1000),
    ('2048', 1, 2048),
    ('-1', 1, -1),
    ('3e-4', 1.0, 3e-4),
    ('5', 1.0, 5.0),
    ('False', True, False),
    ('true', False, True),
    ('0', True, False),
    ('xla', 'chunk', 'xla'),
    ("(('embed', None),)", (('a', 'b'),), (('embed', None),)),
  ],
)
def test_command_line_values_are_parsed_as_the_keys_type(text, current, want):
  value = schema.parse_value('a.b', text, current)
  assert value == want and type(value) is type(want)


@pytest.mark.parametrize(
  'text,current,message',
  [
    ('abc', 1, "a.b='abc' is not an int (such as 1000 or 1e3)"),
    ('1.5e0', 1, "a.b='1.5e0' is not an int"),
    ('inf', 1, 'is not an int'),
    ('fast', 1.0, "a.b='fast' is not a float"),
    ('yes', True, "a.b='yes' is not a bool (True or False)"),
    ('embed', (), "a.b='embed' is not a tuple"),
  ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key_and_the_type(text, current, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    schema.parse_value('a.b', text, current)


# ----------------------------------------------------------------------------- rules between keys


@pytest.mark.parametrize(
  'values,message',
  [
    ({'model.num_heads': 3}, 'model.num_heads=3 does not divide model.d_model=256'),
    ({'model.d_model': 36, 'model.num_heads': 4}, 'head_dim = model.d_model // model.num_heads = 9 must be even'),
    ({'model.num_kv_heads': 2}, "set model.attention_kind='gqa'"),
    (
      {'model.attention_kind': 'gqa', 'model.num_kv_heads': 3},
      'model.num_kv_heads=3 does not divide model.num_heads=4',
    ),
    ({'model.mla_qk_rope_head_dim': 3}, 'model.mla_qk_rope_head_dim=3 must be even'),
    (
      {'model.residual': 'attnres_full', 'model.attnres_impl': 'pallas', 'model.attnres_key_norm': False},
      "model.attnres_key_norm=False needs model.attnres_impl='xla'",
    ),
    (
      {'model.residual': 'attnres_block', 'model.attnres_impl': 'pallas', 'model.d_model': 40, 'model.num_heads': 5},
      "model.attnres_impl='pallas' needs model.d_model divisible by 16",
    ),
    (
      {'model.layer_pattern': 'KA', 'model.kda_head_dim': 24, 'model.kda_impl': 'pallas'},
      "model.kda_impl='pallas' needs the KDA head dim",
    ),
    (
      {'model.layer_pattern': 'KA', 'model.kda_head_dim': 24, 'model.short_conv_impl': 'pallas'},
      "model.short_conv_impl='pallas' needs the KDA head dim",
    ),
    (
      {'model.attention_kind': 'mla', 'model.mla_kv_lora_rank': 48, 'model.mla_decode_impl': 'pallas'},
      "model.mla_decode_impl='pallas' needs r and dr (when not 0) powers of two >= 16; got r 48 "
      '(model.mla_kv_lora_rank, model.mla_qk_rope_head_dim)',
    ),
    (
      {'model.attention_kind': 'mla', 'model.mla_qk_rope_head_dim': 8, 'model.mla_decode_impl': 'pallas'},
      "model.mla_decode_impl='pallas' needs r and dr (when not 0) powers of two >= 16; got dr 8",
    ),
    ({'data.source': 'text'}, "data.path must name a text file or folder when data.source='text'"),
    ({'data.source': 'shards'}, 'data.path must name the folder `python -m kimijax.data.prepare` wrote'),
    (
      {'data.document_mask': True, 'model.attn_impl': 'cudnn'},
      "model.attn_impl='cudnn' has no document mask, which data.document_mask=True needs",
    ),
    ({'mesh.fsdp': -1}, 'at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1'),
  ],
)
def test_rules_between_keys(values, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    validate(_with(values))


def test_the_pallas_kda_and_mla_decode_rules_apply_only_with_their_layers():
  validate(_with({'model.layer_pattern': 'A', 'model.kda_head_dim': 24, 'model.kda_impl': 'pallas'}))
  validate(_with({'model.mla_kv_lora_rank': 48, 'model.mla_decode_impl': 'pallas'}))  # no MLA layers


MOE = {'model.mlp_kind': 'moe'}


@pytest.mark.parametrize(
  'values,message',
  [
    ({'model.moe.top_k': 9}, 'model.moe.top_k=9 exceeds model.moe.num_experts=8'),
    ({'model.moe.n_group': 3}, 'model.moe.n_group=3 must be >= 1 and divide model.moe.num_experts=8'),
    ({'model.moe.n_group': 2, 'model.moe.topk_group': 3}, 'model.moe.topk_group=3 must be in [1, model.moe.n_group=2]'),
    ({'model.moe.n_group': 8}, 'model.moe.n_group=8 leaves 1 expert per group'),
    (
      {'model.moe.n_group': 4, 'model.moe.top_k': 3},
      'model.moe.top_k=3 exceeds the 2 experts eligible with model.moe.topk_group=1',
    ),
    ({'model.moe.num_shared': 3}, 'model.moe.expert_hidden=0 takes model.mlp_dim=768 // (model.moe.top_k=2 + '),
    ({'model.moe.first_dense_layers': 4}, 'model.moe.first_dense_layers=4 leaves no MoE layer of model.num_layers=4'),
    ({'model.moe.impl': 'tokamax', 'model.moe.expert_hidden': 96}, "model.moe.impl='tokamax' needs expert hidden (96)"),
    ({'model.moe.impl': 'tokamax', 'model.d_model': 96, 'model.num_heads': 3}, 'needs d_model (96) to be a multiple'),
    ({'model.moe.score_func': 'relu'}, "model.moe.score_func='relu' is not allowed"),
    ({'model.moe.impl': 'megablox'}, "model.moe.impl='megablox' is not allowed; allowed values: ['xla', 'xla_blocked'"),
    ({'model.moe.impl': 'pallas', 'model.moe.expert_hidden': 40}, "model.moe.impl='pallas' needs expert hidden (40)"),
    ({'mesh.expert': -1}, 'mesh.expert=-1 must be positive'),
    ({'mesh.rules': (('expert', 'experts'),)}, "names mesh axis 'experts'"),
  ],
)
def test_moe_rules_name_the_keys(values, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    validate(_with({**MOE, **values}))


def test_moe_keys_are_ignored_by_a_dense_model_and_the_defaults_resolve():
  validate(_with({'model.moe.top_k': 9, 'model.moe.num_shared': 2}))  # mlp_kind='dense': not read
  m = validate(_with(MOE)).model
  assert config_lib.moe_hidden(m) == (768 // 3, 768)  # top-2 + 1 shared as wide as the dense MLP
  assert [config_lib.moe_layer(m, i) for i in range(4)] == [False, True, True, True]
  assert config_lib.moe_inactive_params(m) == 3 * (8 - 2) * 3 * 256 * 256
  assert config_lib.moe_inactive_params(base_config().model) == 0
  validate(_with({**MOE, 'model.moe.impl': 'tokamax'}))  # shapes fit; the platform is checked at train start


def test_document_mask_takes_every_attention_implementation_with_a_segment_mask():
  for impl in ('xla', 'tokamax', 'gpu'):
    validate(_with({'data.document_mask': True, 'model.attn_impl': impl}))
  validate(_with({'data.document_mask': True, 'model.attn_impl': 'cudnn', 'model.layer_pattern': 'K'}))  # unused


def test_vocab_size_zero_is_the_tokenizers_padded_and_a_smaller_one_is_an_error(tmp_path):
  """0 resolves to the tokenizer's vocabulary padded to a multiple of 128 (the byte tokenizer's 258:
  384; MQAR's ids are bytes whatever data.tokenizer); a BPE's vocabulary above model.vocab_size is
  one error naming both and the fix; a tokenizer file that is missing is one error naming it."""
  from data_helpers import stdlib_texts

  from kimijax.data import bpe_train

  assert validate(_with({'model.vocab_size': 0})).model.vocab_size == 384
  assert validate(_with({'model.vocab_size': 0, 'data.source': 'mqar'})).model.vocab_size == 384
  assert validate(_with({'model.vocab_size': 1000})).model.vocab_size == 1000
  bpe = bpe_train.save_bpe(bpe_train.train_bpe(stdlib_texts(4), 600), tmp_path)
  spec = f'hf:{bpe}'
  assert validate(_with({'model.vocab_size': 0, 'data.tokenizer': spec})).model.vocab_size == 640
  with pytest.raises(ConfigError, match=r"model.vocab_size=258 is smaller than the vocabulary of data.tokenizer='hf:"):
    validate(_with({'data.tokenizer': spec}))
  with pytest.raises(ConfigError, match='data.tokenizer'):
    validate(_with({'model.vocab_size': 0, 'data.tokenizer': f'hf:{tmp_path}/missing.json'}))


# ----------------------------------------------------------------------------- config files


def test_load_applies_variants_and_typed_overrides_and_validates():
  c = load(
    'configs/default.py:gqa,nope',
    overrides={'train.steps': '1e3', 'optimizer.learning_rate': 1, 'train.plot': 'false', 'data.source': 'mqar'},
  )
  assert (c.model.attention_kind, c.model.num_kv_heads, c.model.position) == ('gqa', 2, 'nope')
  assert c.train.steps == 1000 and type(c.train.steps) is int
  assert c.optimizer.learning_rate == 1.0 and c.train.plot is False and c.data.source == 'mqar'
  assert c.train.seq_len == 256 and c.model.compute_dtype == 'float32'  # the file's own values
  with pytest.raises(AttributeError):
    c.train.stepz = 5  # locked: no new keys
  assert load('configs/default.py', {'train.steps': 1e3}).train.steps == 1000


def test_variants_apply_in_the_order_the_file_lists_them():
  a = load('configs/bench_350m.py:attnres_xla,attnres_block')
  b = load('configs/bench_350m.py:attnres_block,attnres_xla')
  assert a.to_dict() == b.to_dict() and a.model.attnres_impl == 'xla' and a.model.residual == 'attnres_block'
  hm = load('configs/bench_350m.py:hybrid,mla').model
  assert (hm.layer_pattern, hm.attention_kind, hm.mla_kv_lora_rank, hm.kda_impl, hm.short_conv_impl) == (
    'KKKA',
    'mla',
    512,
    'pallas',
    'pallas',
  )
  long = load('configs/bench_350m.py:long,hybrid', {'train.seq_len': 131072})
  assert (long.train.batch_size, long.train.seq_len, long.train.loss_chunk, long.model.remat) == (1, 131072, 4096, True)


def test_load_works_from_any_working_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  c = load('configs/kimi_linear_small.py:rope', {'train.steps': '20'})
  assert c.model.mla_rope is True and c.train.steps == 20
  own = tmp_path / 'mine.py'  # a config file outside the repository, by a relative path
  own.write_text(
    'from kimijax import configs_common\nfrom kimijax.config import apply_variants, base_config\n\n'
    'def get_config(variants=None):\n  c = base_config()\n  configs_common.cpu_run(c)\n'
    "  return apply_variants(c, {'big': lambda c: c.model.update(d_model=512)}, variants)\n"
  )
  assert load('mine.py:big').model.d_model == 512
  assert load(str(own)).train.steps == 600


@pytest.mark.parametrize(
  'spec,overrides,message',
  [
    ('configs/default.py:gqa2', None, "configs/default.py: unknown variant 'gqa2'; allowed: 'gqa', 'nope'"),
    ('configs/kimi_linear_small.py:rope,nope1', None, "unknown variant 'nope1'; allowed: 'all_mla', "),
    ('configs/default.py:gqa,gqa', None, "configs/default.py: variants 'gqa,gqa' name one twice"),
    ('configs/ladder.py:smoke,gpu', None, "configs/ladder.py: 'smoke,gpu': give one ladder"),
    ('configs/no_such.py', None, "config file 'configs/no_such.py' not found"),
    ('configs/default.py', {'train.stepz': '10'}, "unknown config key 'train.stepz'; known keys in 'train'"),
    ('configs/default.py', {'train.steps.x': '1'}, "unknown config key 'train.steps.x': 'train.steps' is a value"),
    ('configs/default.py', {'train': '1'}, "config key 'train' is a group"),
    ('configs/default.py', {'train.steps': 'abc'}, "train.steps='abc' is not an int"),
    ('configs/default.py', {'train.steps': 2.5}, 'train.steps=2.5 is not of the type of train.steps (int)'),
    ('configs/default.py', {'model.num_heads': '3'}, 'model.num_heads=3 does not divide'),
  ],
)
def test_load_mistakes_are_one_config_error(spec, overrides, message):
  with pytest.raises(ConfigError) as info:
    load(spec, overrides)
  assert message in str(info.value) and '\n' not in str(info.value), str(info.value)


def test_a_config_files_own_error_names_the_file(tmp_path):
  bad = tmp_path / 'bad.py'
  bad.write_text('def get_config(variants=None):\n  return {}["model"]\n')
  with pytest.raises(ConfigError, match=f"^{bad}: KeyError: 'model'$"):
    load(str(bad))
  (tmp_path / 'none.py').write_text('x = 1\n')
  with pytest.raises(ConfigError, match='none.py: defines no get_config'):
    load(str(tmp_path / 'none.py'))


def test_load_file_leaves_a_ladder_unvalidated():
  ladder = load_file('configs/ladder.py:gpu', {'base.train.steps': '1e2'})
  assert ladder.name == 'gpu' and ladder.base.train.steps == 100 and ladder.base.model.attn_impl == 'tokamax'
  with pytest.raises(ConfigError) as info:  # no default ladder (its docstring): one line naming them all
    load_file('configs/ladder.py')
  assert str(info.value) == (
    "configs/ladder.py: give a ladder: --config=configs/ladder.py:NAME, NAME one of 'smoke', 'smoke_moe', "
    "'gpu', 'gpu_attnres', 'gpu_hybrid', 'gpu_moe'"
  )


def test_the_config_flag_takes_a_file_variants_and_overrides(monkeypatch):
  argv = [
    'prog',
    '--config=configs/default.py:nope',
    '--config.train.steps=1e3',
    '--config.model.remat=true',
    '--other=1',
  ]
  monkeypatch.setattr(sys, 'argv', argv)
  fv = flags.FlagValues()
  config_lib.define_config_flag('config', None, 'a config', flag_values=fv)
  flags.DEFINE_string('other', None, 'another flag', flag_values=fv)
  fv(argv)
  c = config_lib.config_from_flags('config', flag_values=fv)
  assert c.model.position == 'nope' and c.train.steps == 1000 and c.model.remat is True
  empty = flags.FlagValues()
  monkeypatch.setattr(sys, 'argv', ['prog'])
  config_lib.define_config_flag('config', None, 'a config', flag_values=empty)
  empty(['prog'])
  with pytest.raises(ConfigError, match=r'--config=FILE\[:VARIANT\] is required'):
    config_lib.config_from_flags('config', flag_values=empty)


# ----------------------------------------------------------------------------- errors through run.py


BAD = [  # (override, fragments the one message must contain)
  ({'model.foo': 1}, ['model.foo', "'d_model'", "'num_heads'"]),
  ({'model.d_model': -64}, ['model.d_model', 'positive']),
  ({'model.num_heads': 3}, ['model.num_heads', 'model.d_model']),
  ({'optimizer.name': 'sgd'}, ['optimizer.name', "'adamw'"]),
  ({'model.layer_pattern': 'AX'}, ['model.layer_pattern', "'X'", "'A'"]),
]
BAD_IDS = ['unknown_key', 'negative_d_model', 'heads_not_dividing', 'unknown_optimizer', 'unknown_layer_letter']


def test_yarn_needs_a_rotating_layer_and_a_factor_of_at_least_one():
  from kimijax.config import load

  with pytest.raises(ConfigError, match=r'model\.yarn\.factor=4\.0 extends RoPE, but no layer'):
    load('configs/kimi_linear_moe.py', overrides={'model.yarn.factor': 4.0})  # its MLA is NoPE
  with pytest.raises(ConfigError, match=r'model\.yarn\.factor=0\.5 must be 0'):
    load('configs/default.py', overrides={'model.yarn.factor': 0.5})
  assert load('configs/default.py', overrides={'model.yarn.factor': 4.0}).model.yarn.factor == 4.0


@pytest.mark.parametrize('override,fragments', BAD, ids=BAD_IDS)
def test_validate_rejects_bad_config(override, fragments):
  c = base_config()
  for key, value in override.items():
    group, name = key.split('.')
    c[group][name] = value  # an unlocked ConfigDict accepts new keys
  with pytest.raises(ConfigError) as info:
    validate(c)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


def run_py(workdir, flags):
  env = cpu_subprocess_env()
  command = [
    sys.executable,
    str(ROOT / 'run.py'),
    '--config=' + str(ROOT / 'configs/default.py'),
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in flags.items()]
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_run_py_rejects_bad_config_before_training(tmp_path):
  procs = [
    (override, fragments, tmp_path / name, run_py(tmp_path / name, {**TINY, **override}))
    for (override, fragments), name in zip(BAD, BAD_IDS)
  ]  # all at once: each only starts up
  for override, fragments, workdir, proc in procs:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, override
    assert 'Traceback' not in err, err[-2000:]
    lines = [l for l in err.splitlines() if 'ConfigError' in l]
    assert len(lines) == 1, err[-2000:]  # one message
    for fragment in fragments:
      assert fragment in lines[0], (override, lines[0])
    assert not (workdir / 'checkpoints').exists() and not (workdir / 'metrics.jsonl').exists()


def test_run_py_takes_integral_floats_and_names_a_bad_type_in_one_line():
  env = cpu_subprocess_env()
  base = [sys.executable, str(ROOT / 'run.py'), '--mode=config', '--config=configs/default.py']
  procs = [
    subprocess.Popen(base + [flag], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for flag in ('--config.train.steps=1e3', '--config.train.steps=abc')
  ]
  (good_out, good_err), (_, bad_err) = [p.communicate(timeout=300) for p in procs]
  assert procs[0].returncode == 0, good_err[-2000:]
  assert '  steps: 1000\n' in good_out
  assert procs[1].returncode != 0 and 'Traceback' not in bad_err and 'FATAL' not in bad_err, bad_err[-2000:]
  assert bad_err.strip().splitlines() == ["ConfigError: train.steps='abc' is not an int (such as 1000 or 1e3)"]
