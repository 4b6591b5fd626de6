"""Registers, spills, shared memory and instruction mix of the Pallas kernels of one op, from their
Triton compilation for an H200, on a machine without a GPU.

    pip install triton==3.6.0      # once: Triton's compiler with its ptxas and cuobjdump
    python -m experiments.tools.triton_report [--op=attnres] [--sources=8] [--queries=6] \
        [--phase1_tiles=bt_grads=16/dc_grads=64] [--merge_tiles=...]
    python -m experiments.tools.triton_report --op=kda [--batch=16 --seq_len=4096 --heads=8 --head_dim=128]
    python -m experiments.tools.triton_report --op=short_conv [--batch=16 --seq_len=4096 --heads=8 --head_dim=128]
    python -m experiments.tools.triton_report --op=mla_decode [--batch=16 --heads=8 --context=131072 \
        --rank=512 --rope_dim=64]
    python -m experiments.tools.triton_report --op=moe [--tokens=65536 --d_model=1024 --experts=64 \
        --top_k=8 --expert_hidden=512] [--settings=block_m=64/stages=2]

with [--dtype=bfloat16] [--triton_python=PYTHON] [--out_dir=DIR] for every op. Each op runs at its
benchmark shape by default, its kernels at the settings of its family, changed by --settings
('key=int/key=int' of KdaSettings, ShortConvSettings, MlaDecodeSettings or MoeSettings; AttnRes
takes --phase1_tiles and --merge_tiles):

  attnres     one block's kernels, forward and backward: phase 1 of n sources for S queries, then
              merge_norm of its first output (bench_350m's shape: M = 16 x 4096 rows of D = 1024)
  kda         kda(impl='pallas') as the KDA layer calls it in training, the decay gate's
              pre-activation with a_log and dt_bias (fused into the kernels), forward and backward
              (the hybrid step's (16, 4096, 8 heads, 128))
  short_conv  short_conv(impl='pallas') with the silu_l2 activation (the KDA layer's q and k),
              forward and backward, at the same shape
  mla_decode  mla_decode(impl='pallas'), one decode step (no backward): batch 16, 8 heads, latent
              rank 512, 64 decoupled dims, a cache of 131072 positions
  moe         routed_experts(impl='pallas'), forward and backward: 65,536 tokens of d 1024, 64
              experts top-8, expert hidden 512

The op's jitted value (and gradient) is lowered for an H200 through jax.export, its kernels forced
to the Triton lowering (not interpret mode) on this machine; every distinct Triton custom call of
the module gives one kernel: its Triton IR (verified by jaxlib's Triton dialect: an IR that does
not verify is an error naming the kernel) and its warps, stages and grid. Each IR is compiled in a
subprocess (--triton_python: a Python with `triton`, this one by default) for sm_90 with the
kernel's own warps and stages, then read with `ptxas -v` (registers, spills) and `cuobjdump -sass`
(instruction counts). XLA builds the running kernels with its own fork of Triton, so these figures
are close to theirs, not equal. --out_dir keeps each kernel's IR, PTX and SASS. An H200 SM has
228 KB of shared memory (227 KB at most per block) and 65536 registers (255 at most per thread).
Figures: experiments/results/bench_attnres.md (AttnRes), bench_kda.md (KDA), moe.md (MoE).
"""

import collections
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags

FLAGS = flags.FLAGS
SASS_COLUMNS = ('FFMA', 'FADD', 'FMUL', 'HMMA', 'HGMMA', 'LDG', 'LDGSTS', 'STG', 'SHFL', 'BAR')
OPS = ('attnres', 'kda', 'short_conv', 'mla_decode', 'moe')
TRITON_CALL = '__gpu$xla.gpu.triton'


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  flags.DEFINE_enum('op', 'attnres', OPS, 'whose kernels')
  flags.DEFINE_string(
    'settings', '', "kda, short_conv, mla_decode, moe: the kernels' settings, 'key=int/key=int' ('': the defaults)"
  )
  flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'dtype of the inputs')
  # attnres
  flags.DEFINE_integer('sources', 8, 'attnres: n, sources of phase 1')
  flags.DEFINE_integer('queries', 6, 'attnres: S, consumers per block')
  flags.DEFINE_string('phase1_tiles', '', "attnres: phase-1 tiles, 'key=int/key=int'")
  flags.DEFINE_string('merge_tiles', '', 'attnres: merge_norm tiles, the same form')
  # shared by several ops
  flags.DEFINE_integer('tokens', 16 * 4096, 'attnres: M, rows of each source; moe: T, tokens')
  flags.DEFINE_integer('d_model', 1024, 'attnres, moe: D')
  flags.DEFINE_integer('batch', 16, 'kda, short_conv, mla_decode: B')
  flags.DEFINE_integer('heads', 8, 'kda, short_conv, mla_decode: H')
  flags.DEFINE_integer('seq_len', 4096, 'kda, short_conv: T')
  flags.DEFINE_integer('head_dim', 128, 'kda, short_conv: K = V')
  flags.DEFINE_integer('context', 131072, 'mla_decode: cached positions S')
  flags.DEFINE_integer('rank', 512, 'mla_decode: latent rank r')
  flags.DEFINE_integer('rope_dim', 64, 'mla_decode: decoupled dims dr (0: none)')
  flags.DEFINE_integer('experts', 64, 'moe: routed experts E')
  flags.DEFINE_integer('top_k', 8, 'moe: experts per token')
  flags.DEFINE_integer('expert_hidden', 512, "moe: F, an expert's hidden width")
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
  triton = export.DisabledSafetyCheck.custom_call(TRITON_CALL)
  with use_abstract_mesh(h200):
    return export.export(jax.jit(fn), platforms=['cuda'], disabled_checks=[triton])(*args).mlir_module()


# ----------------------------------------------------------------------------- one builder per op


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


def kda_op(b, t, h, d, dtype, settings=None):
  """(fn, args): value and gradient of kda(impl='pallas') as the KDA layer calls it in training:
  q, k, v and the decay gate's pre-activation f [B, T, H, K] in dtype, beta [B, T, H] float32,
  a_log [H] and dt_bias [H, K] float32 (the gate formed inside the kernels at fused_gate=1);
  gradients of all seven. settings: a KdaSettings (None: the defaults)."""
  from kimijax.ops.kda import kda

  def loss(q, k, v, f, beta, a_log, dt_bias):
    o, _ = kda(q, k, v, f, beta, impl='pallas', a_log=a_log, dt_bias=dt_bias, settings=settings)
    return jnp.sum(o.astype(jnp.float32))

  x = jax.ShapeDtypeStruct((b, t, h, d), dtype)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return jax.value_and_grad(loss, argnums=tuple(range(7))), (x, x, x, x, f32(b, t, h), f32(h), f32(h, d))


def short_conv_op(b, t, h, d, dtype, settings=None):
  """(fn, args): value and gradient of short_conv(impl='pallas') with the silu_l2 activation (the
  KDA layer's q and k convs): x [B, T, H, K] in dtype, taps [4, H, K] float32; gradients of both.
  settings: a ShortConvSettings (None: the defaults)."""
  from kimijax.layers.kda import CONV_WIDTH
  from kimijax.ops.short_conv import short_conv

  def loss(x, w):
    y, _ = short_conv(x, w, 'silu_l2', impl='pallas', settings=settings)
    return jnp.sum(y.astype(jnp.float32))

  args = (jax.ShapeDtypeStruct((b, t, h, d), dtype), jax.ShapeDtypeStruct((CONV_WIDTH, h, d), jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1)), args


def mla_decode_op(b, h, s, r, dr, dtype, settings=None):
  """(fn, args): one decode step of mla_decode(impl='pallas') (it has no backward): queries
  q_latent [B, H, r] and q_rope [B, H, dr], a cache of S positions, latent [B, S, r] and k_rope
  [B, S, dr] (dr = 0: no decoupled dims), lengths [B] int32. settings: an MlaDecodeSettings (None:
  the defaults)."""
  from kimijax.ops.mla_decode import mla_decode

  scale = (128 + dr) ** -0.5  # as bench_mla_decode: the query heads' nope and rope dims
  decode = lambda q, q_rope, c, k_rope, length: mla_decode(
    q, q_rope, c, k_rope, length, scale=scale, impl='pallas', settings=settings
  )
  sds = jax.ShapeDtypeStruct
  length = sds((b,), jnp.int32)
  if not dr:
    return (lambda q, c, length: decode(q, None, c, None, length)), (
      sds((b, h, r), dtype),
      sds((b, s, r), dtype),
      length,
    )
  return decode, (sds((b, h, r), dtype), sds((b, h, dr), dtype), sds((b, s, r), dtype), sds((b, s, dr), dtype), length)


def moe_op(t, d, e, k, f, dtype, settings=None):
  """(fn, args): value and gradient of routed_experts(impl='pallas') (kimijax/ops/moe.py): T tokens
  x [T, D] in dtype routed to k of E experts (weights [T, k] float32, experts [T, k] int32), expert
  weights w_gate, w_up [E, D, F] and w_down [E, F, D] in dtype; gradients of x, the routing weights
  and the expert weights. settings: a MoeSettings (None: the defaults)."""
  from kimijax.ops.moe import routed_experts

  def loss(x, weights, experts, w_gate, w_up, w_down):
    y = routed_experts(x, weights, experts, w_gate, w_up, w_down, impl='pallas', settings=settings)
    return jnp.sum(y)

  sds = jax.ShapeDtypeStruct
  args = (
    sds((t, d), dtype),
    sds((t, k), jnp.float32),
    sds((t, k), jnp.int32),
    sds((e, d, f), dtype),
    sds((e, d, f), dtype),
    sds((e, f, d), dtype),
  )
  return jax.value_and_grad(loss, argnums=(0, 1, 3, 4, 5)), args


# ----------------------------------------------------------------------------- the kernels


@dataclasses.dataclass
class Kernel:
  name: str  # the pallas_call's name; '#2' etc. for later variants of one name
  ir: str  # Triton IR (tt dialect), as Triton's parser reads it
  warps: int
  stages: int
  grid: tuple


def kernel_irs(fn, *args) -> list[Kernel]:
  """Every distinct Pallas kernel in fn lowered for an H200, each Triton custom call of the module
  once (in module order, identical calls once): its Triton IR without locations, verified by
  jaxlib's Triton dialect (else a ValueError naming the kernel, with MLIR's diagnostic), and the
  warps, stages and grid of that call. The kernels are lowered through Triton even off the GPU
  (kernels_pallas.common.kernels_interpreted is False meanwhile)."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  from kernels_pallas import common

  interpreted = common.kernels_interpreted
  common.kernels_interpreted = lambda: False
  try:
    module_text = lower_for_h200(fn, *args)
  finally:
    common.kernels_interpreted = interpreted
  context = mlir.make_ir_context()
  tt_dialect.register_dialect(context)
  kernels, seen, names = [], set(), collections.Counter()
  with context:
    for call in _triton_calls(ir.Module.parse(module_text).operation):
      config = ir.DictAttr(call.attributes['mhlo.backend_config'])
      name = ir.StringAttr(config['name']).value
      warps, stages, *grid = (
        ir.IntegerAttr(config[key]).value for key in ('num_warps', 'num_stages', 'grid_x', 'grid_y', 'grid_z')
      )
      try:
        kernel_module = ir.Module.parse(ir.StringAttr(config['ir']).value_bytes)
      except ir.MLIRError as e:
        raise ValueError(f'the Triton IR of kernel {name} does not verify: {e}') from None
      text = kernel_module.operation.get_asm(enable_debug_info=False)
      key = (name, text, warps, stages, tuple(grid))
      if key in seen:
        continue
      seen.add(key)
      names[name] += 1
      label = name if names[name] == 1 else f'{name}#{names[name]}'
      kernels.append(Kernel(label, text, warps, stages, tuple(grid)))
  return kernels


def _triton_calls(op):
  """The Triton custom calls under op, in module order."""
  from jax._src.lib.mlir import ir

  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        inner = inner.operation
        if (
          inner.name == 'stablehlo.custom_call'
          and ir.StringAttr(inner.attributes['call_target_name']).value == TRITON_CALL
        ):
          yield inner
        yield from _triton_calls(inner)


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


def parse_settings(text: str, flag: str, cls):
  """cls parsed from --flag's text; a bad key or value is one error naming the flag."""
  try:
    return cls.from_string(text)
  except ValueError as e:
    raise SystemExit(f'triton_report.py: --{flag}={text!r}: {e}') from None


def op_call(op: str):
  """(fn, args, a line saying the shape) of --op at the flags' sizes and settings, the settings
  checked before anything is lowered."""
  dtype = jnp.dtype(FLAGS.dtype)
  if op != 'attnres' and (FLAGS.phase1_tiles or FLAGS.merge_tiles):
    raise SystemExit(f'triton_report.py: --phase1_tiles and --merge_tiles are for --op=attnres, not --op={op}')
  if op == 'attnres':
    from kernels_pallas.attnres.settings import MergeNormSettings, Phase1Settings

    if FLAGS.settings:
      raise SystemExit('triton_report.py: --op=attnres takes --phase1_tiles and --merge_tiles, not --settings')
    phase1 = parse_settings(FLAGS.phase1_tiles, 'phase1_tiles', Phase1Settings)
    merge = parse_settings(FLAGS.merge_tiles, 'merge_tiles', MergeNormSettings)
    n, s, m, d = FLAGS.sources, FLAGS.queries, FLAGS.tokens, FLAGS.d_model
    return (*attnres_block(n, s, m, d, dtype, phase1, merge), f'n = {n}, S = {s}, M = {m}, D = {d}, {dtype} sources')
  b, h, t, k = FLAGS.batch, FLAGS.heads, FLAGS.seq_len, FLAGS.head_dim
  if op == 'kda':
    from kernels_pallas.kda.settings import KdaSettings

    settings = parse_settings(FLAGS.settings, 'settings', KdaSettings)
    return (*kda_op(b, t, h, k, dtype, settings), f'kda, gated, (B, T, H, K) = ({b}, {t}, {h}, {k}), {dtype}')
  if op == 'short_conv':
    from kernels_pallas.short_conv.settings import ShortConvSettings

    settings = parse_settings(FLAGS.settings, 'settings', ShortConvSettings)
    return (
      *short_conv_op(b, t, h, k, dtype, settings),
      f'short_conv silu_l2, (B, T, H, K) = ({b}, {t}, {h}, {k}), {dtype}',
    )
  if op == 'mla_decode':
    from kernels_pallas.mla_decode.settings import MlaDecodeSettings

    settings = parse_settings(FLAGS.settings, 'settings', MlaDecodeSettings)
    s, r, dr = FLAGS.context, FLAGS.rank, FLAGS.rope_dim
    fn, args = mla_decode_op(b, h, s, r, dr, dtype, settings)
    return fn, args, f'mla_decode, B = {b}, H = {h}, S = {s}, r = {r}, dr = {dr}, {dtype}'
  from kernels_pallas.moe.settings import MoeSettings

  settings = parse_settings(FLAGS.settings, 'settings', MoeSettings)
  t, d, e, k, f = FLAGS.tokens, FLAGS.d_model, FLAGS.experts, FLAGS.top_k, FLAGS.expert_hidden
  fn, args = moe_op(t, d, e, k, f, dtype, settings)
  return fn, args, f'moe, T = {t}, D = {d}, E = {e}, top-{k}, F = {f}, {dtype}'


def main(argv):
  del argv
  # Settings checked here, before anything is lowered: one error that names the flag.
  fn, args, shape = op_call(FLAGS.op)
  if FLAGS.op != 'attnres' and FLAGS.settings:
    shape += f', settings {FLAGS.settings}'
  if subprocess.run([FLAGS.triton_python, '-c', 'import triton'], capture_output=True).returncode:
    raise SystemExit(
      f'triton_report.py: {FLAGS.triton_python} cannot import triton; '
      'pip install triton==3.6.0 there, or pass --triton_python'
    )
  try:
    kernels = kernel_irs(fn, *args)
  except ValueError as e:  # sizes the op's kernels do not take (the op names them), or an IR that does not verify
    raise SystemExit(f'triton_report.py: --op={FLAGS.op} at {shape}: {e}') from None
  out_dir = pathlib.Path(FLAGS.out_dir or tempfile.mkdtemp(prefix='triton_report_'))
  out_dir.mkdir(parents=True, exist_ok=True)
  print(f'{shape}, sm_90; files in {out_dir}\n')
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
