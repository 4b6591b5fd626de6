"""Registers, spills, shared memory and instruction mix of the AttnRes Pallas kernels, from their
Triton compilation for an H200, on a machine without a GPU.

    pip install triton==3.6.0      # once: Triton's compiler with its ptxas and cuobjdump
    python -m experiments.tools.triton_report [--sources=8] [--queries=6] [--dtype=bfloat16] \
        [--phase1_tiles=bt_grads=16/dc_grads=64] [--merge_tiles=...] [--out_dir=DIR]

It lowers one block's kernels for an H200 through jax.export (phase 1 of n sources for S
queries, then merge_norm of its first output, forward and backward), at the bench_350m shape
by default. pallas_call(debug=True) prints each kernel's Triton IR during that lowering; each IR
is compiled in a subprocess (--triton_python: a Python with `triton`, this one by default) for
sm_90 with the kernel's own warps and stages, then read with `ptxas -v` (registers, spills) and
`cuobjdump -sass` (instruction counts). XLA builds the running kernels with its own fork of
Triton, so these figures are close to theirs, not equal. --out_dir keeps each kernel's IR,
PTX and SASS. Its figures for the AttnRes kernels: experiments/results/bench_attnres.md.
"""

import collections
import contextlib
import dataclasses
import functools
import io
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.experimental import pallas as pl

FLAGS = flags.FLAGS
SASS_COLUMNS = ('FFMA', 'FADD', 'FMUL', 'HMMA', 'HGMMA', 'LDG', 'LDGSTS', 'STG', 'SHFL', 'BAR')


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  flags.DEFINE_integer('sources', 8, 'n: sources of phase 1')
  flags.DEFINE_integer('queries', 6, 'S: consumers per block')
  flags.DEFINE_integer('tokens', 16 * 4096, 'M: rows of each source')
  flags.DEFINE_integer('d_model', 1024, 'D')
  flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'dtype of the sources')
  flags.DEFINE_string('phase1_tiles', '', "phase-1 tiles, 'key=int/key=int'")
  flags.DEFINE_string('merge_tiles', '', 'merge_norm tiles, the same form')
  flags.DEFINE_string('triton_python', sys.executable, 'a Python that can import triton')
  flags.DEFINE_string('out_dir', None, "keep each kernel's .ttir, .ttgir, .ptx and .sass here")


def lower_for_h200(fn, *args) -> str:
  """fn's jitted module lowered for an H200 on this machine, GPU or not: the Pallas kernels go
  through the Triton lowering, which rejects what it cannot express (a shape that is not a
  power of two, an op without a Triton rule) before any GPU time is spent."""
  from jax import export
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

  # Auto axes: a whole model's sharding annotations lower as they do on one real device.
  h200 = AbstractMesh(
    (1,), ('x',), axis_types=(AxisType.Auto,), abstract_device=AbstractDevice('NVIDIA H200', 132, 'gpu')
  )
  triton = export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')
  with use_abstract_mesh(h200):
    return export.export(jax.jit(fn), platforms=['cuda'], disabled_checks=[triton])(*args).mlir_module()


def attnres_block(n, s, m, d, dtype, phase1_settings=None, merge_settings=None):
  """(fn, args): value and gradient of phase 1 (n sources [M, D], S queries) and of merge_norm of
  its first output, with an addend and a later use of the partial sum: every AttnRes kernel, the
  merge_norm backward in its variant that adds that later use's gradient. phase1_settings,
  merge_settings: the kernels' Phase1Settings and MergeNormSettings (None: the defaults)."""
  from kernels_pallas.attnres.merge_norm import merge_norm
  from kernels_pallas.attnres.phase1 import phase1

  def block(sources, queries, partial, y, scale):
    outs, lse, passed = phase1(sources, queries, settings=phase1_settings)
    x, p = merge_norm(
      outs[0],
      lse[0],
      partial,
      queries[0],
      scale,
      eps=1e-6,
      norm_eps=1e-6,
      dtype=jnp.bfloat16,
      addend=y,
      settings=merge_settings,
    )
    return (
      jnp.sum(x.astype(jnp.float32))
      + jnp.sum(p.astype(jnp.float32) ** 2)
      + sum(jnp.sum(v.astype(jnp.float32) ** 2) for v in passed)
    )

  sources = [jax.ShapeDtypeStruct((m, d), dtype)] * n
  args = (
    sources,
    jax.ShapeDtypeStruct((s, d), jnp.float32),
    sources[0],
    sources[0],
    jax.ShapeDtypeStruct((d,), jnp.float32),
  )
  return jax.value_and_grad(block, argnums=(0, 1, 2, 3, 4)), args


@dataclasses.dataclass
class Kernel:
  name: str  # the pallas_call's name; '#2' etc. for later variants of one name
  ir: str  # Triton IR (tt dialect), as Triton's parser reads it
  warps: int
  stages: int
  grid: tuple


def kernel_irs(fn, *args) -> list[Kernel]:
  """Every Pallas kernel in fn lowered for an H200: its Triton IR (from pallas_call(debug=True))
  with the warps, stages and grid of its custom call."""
  original = pl.pallas_call
  pl.pallas_call = functools.partial(original, debug=True)
  printed = io.StringIO()
  try:
    with contextlib.redirect_stdout(printed):
      module = lower_for_h200(fn, *args)
  finally:
    pl.pallas_call = original
  launch = {}
  for config in re.findall(r'mhlo\.backend_config = \{debug = true, (.*?)\}', _drop_ir(module)):
    fields = dict(re.findall(r'(\w+) = "?([\w.]+)"?', config))
    launch[fields['name']] = (
      int(fields['num_warps']),
      int(fields['num_stages']),
      tuple(int(fields[f'grid_{a}']) for a in 'xyz'),
    )
  kernels, seen = [], collections.Counter()
  for chunk in printed.getvalue().split('The Triton module for pallas_call')[1:]:
    ir = clean_ir(chunk)
    name = re.search(r'module @(\w+)', ir).group(1)
    seen[name] += 1
    label = name if seen[name] == 1 else f'{name}#{seen[name]}'
    kernels.append(Kernel(label, ir, *launch[name]))
  return kernels


def _drop_ir(module: str) -> str:
  """The module text without the serialized kernels (strings that may hold any byte)."""
  return re.sub(r'ir = "(\\.|[^"\\])*", ', '', module)


def clean_ir(printed: str) -> str:
  """One module as pallas_call(debug=True) prints it -> text Triton's parser accepts: from
  'module @' to its closing brace, without the source locations (pretty-printed, they are not
  MLIR syntax)."""
  text = printed[printed.index('module @') :]
  text = text[: text.index('\n}') + 2] + '\n'
  text = re.sub(r' \[unknown\]| "[^"\n]*"\(#loc\d*\)| \(#loc\d*\)| loc\([^)\n]*\)', '', text)
  return re.sub(r'^#loc.*\n', '', text, flags=re.M)


# Run by --triton_python: compiles one IR file for sm_90, writes .ttgir/.ptx/.cubin beside it and
# prints the shared memory and the directory of Triton's CUDA tools.
_COMPILE = r"""
import json, os, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=warps, num_stages=stages))
base = path[:-len('.ttir')]
for key in ('ttgir', 'ptx'):
  open(base + '.' + key, 'w').write(k.asm[key])
open(base + '.cubin', 'wb').write(k.asm['cubin'])
print(json.dumps(dict(shared=k.metadata.shared,
                      bin=os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin'))))
"""


def compile_report(kernel: Kernel, out_dir: pathlib.Path, triton_python: str) -> dict:
  """Registers, spill bytes, shared memory, layout conversions and SASS counts of one kernel."""
  ir_path = out_dir / f'{kernel.name.replace("#", "_")}.ttir'
  ir_path.write_text(kernel.ir)
  run = subprocess.run(
    [triton_python, '-c', _COMPILE, str(ir_path), str(kernel.warps), str(kernel.stages)], capture_output=True, text=True
  )
  if run.returncode:
    raise RuntimeError(f'triton could not compile {kernel.name} ({ir_path}):\n{run.stderr[-3000:]}')
  meta = json.loads(run.stdout.strip().splitlines()[-1])
  base = ir_path.with_suffix('')
  ptxas = subprocess.run(
    [f'{meta["bin"]}/ptxas', '-arch=sm_90a', '-v', f'{base}.ptx', '-o', f'{base}.cubin'],
    capture_output=True,
    text=True,
    check=True,
  ).stderr
  sass = subprocess.run(
    [f'{meta["bin"]}/cuobjdump', '-sass', f'{base}.cubin'], capture_output=True, text=True, check=True
  ).stdout
  pathlib.Path(f'{base}.sass').write_text(sass)
  return dict(
    registers=int(re.search(r'Used (\d+) registers', ptxas).group(1)),
    spill_stores=int(re.search(r'(\d+) bytes spill stores', ptxas).group(1)),
    spill_loads=int(re.search(r'(\d+) bytes spill loads', ptxas).group(1)),
    shared=meta['shared'],
    layout_conversions=pathlib.Path(f'{base}.ttgir').read_text().count('ttg.convert_layout'),
    sass=sass_counts(sass),
  )


def sass_counts(sass: str) -> collections.Counter:
  """Instructions by opcode (without modifiers or predicate) in cuobjdump -sass text."""
  ops = re.findall(r'^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T] )?([A-Z][A-Z0-9_]*)', sass, flags=re.M)
  return collections.Counter(ops)


def main(argv):
  del argv
  from kernels_pallas.attnres.settings import MergeNormSettings, Phase1Settings

  # Tile flags checked here, before anything is lowered: one error that names the bad key.
  phase1_settings = Phase1Settings.from_string(FLAGS.phase1_tiles)
  merge_settings = MergeNormSettings.from_string(FLAGS.merge_tiles)
  if subprocess.run([FLAGS.triton_python, '-c', 'import triton'], capture_output=True).returncode:
    raise SystemExit(
      f'triton_report.py: {FLAGS.triton_python} cannot import triton; '
      'pip install triton==3.6.0 there, or pass --triton_python'
    )
  fn, args = attnres_block(
    FLAGS.sources, FLAGS.queries, FLAGS.tokens, FLAGS.d_model, jnp.dtype(FLAGS.dtype), phase1_settings, merge_settings
  )
  kernels = kernel_irs(fn, *args)
  out_dir = pathlib.Path(FLAGS.out_dir or tempfile.mkdtemp(prefix='triton_report_'))
  out_dir.mkdir(parents=True, exist_ok=True)
  print(
    f'n = {FLAGS.sources}, S = {FLAGS.queries}, M = {FLAGS.tokens}, D = {FLAGS.d_model}, '
    f'{FLAGS.dtype} sources, sm_90; files in {out_dir}\n'
  )
  print(
    '| kernel | grid | warps / stages | registers | spill bytes (st / ld) | shared bytes '
    '| layout conversions | SASS | ' + ' | '.join(SASS_COLUMNS) + ' |'
  )
  print('|---' * (8 + len(SASS_COLUMNS)) + '|')
  for kernel in kernels:
    r = compile_report(kernel, out_dir, FLAGS.triton_python)
    counts = ' | '.join(str(r['sass'][op]) for op in SASS_COLUMNS)
    print(
      f'| {kernel.name} | {"x".join(map(str, kernel.grid))} | {kernel.warps} / {kernel.stages} '
      f'| {r["registers"]} | {r["spill_stores"]} / {r["spill_loads"]} | {r["shared"]} '
      f'| {r["layout_conversions"]} | {sum(r["sass"].values())} | {counts} |',
      flush=True,
    )


if __name__ == '__main__':
  define_flags()
  app.run(main)
