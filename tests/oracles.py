"""float64 NumPy transcriptions that the tests use as oracles, written from the papers (docs/ states the equations),
never calling the code under test. Test files import them from here (and never from each other).

Sections: the dense model's sublayers and forward (RoPE, RMSNorm, attention, SwiGLU); attention
and its per-head max logits (docs/optimizers.md#qk-clip); KDA (docs/kda.md), its layer; MLA and its
absorbed decode;
Muon and AdamW (docs/optimizers.md#muon);
Attention Residuals (docs/attention_residuals.md).
"""

import jax
import numpy as np

# ----------------------------------------------------------------------------- the dense model


def np_rope(x_bthd, positions_bt, theta):
  """Rotate each pair (i, i + D/2) by pos * theta^(-2i/D), as a complex multiplication."""
  d = x_bthd.shape[-1]
  half = d // 2
  angle = positions_bt[:, :, None, None] * theta ** (-2.0 * np.arange(half) / d)
  z = (x_bthd[..., :half] + 1j * x_bthd[..., half:]) * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


def np_rmsnorm(x, gain, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def np_silu(x):
  return x / (1.0 + np.exp(-x))


def matrix(node):
  """A matrix parameter, stored bare or (nn.Dense style) under 'kernel'."""
  return node['kernel'] if isinstance(node, dict) else node


def np_attention_block(x_btd, p, positions_bt, cfg):
  """Returns (y [B, T, D], per-head max logit [H])."""
  wq, wk, wv, wo = (np.asarray(p[n], np.float64) for n in ('query', 'key', 'value', 'out'))
  h, hkv = wq.shape[1], wk.shape[1]
  dh = wq.shape[2]
  t = x_btd.shape[1]
  q = np.einsum('btd,dhk->bthk', x_btd, wq)
  k = np.einsum('btd,dhk->bthk', x_btd, wk)
  v = np.einsum('btd,dhk->bthk', x_btd, wv)
  if cfg.position == 'rope':
    q, k = np_rope(q, positions_bt, cfg.rope_theta), np_rope(k, positions_bt, cfg.rope_theta)
  kv_head = np.arange(h) // (h // hkv)
  logits = np.einsum('bihk,bjhk->bhij', q, k[:, :, kv_head]) / np.sqrt(dh)
  causal = np.tril(np.ones((t, t), bool))
  logits = np.where(causal, logits, -np.inf)
  max_logits = logits.max(axis=(0, 2, 3))
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  o = np.einsum('bhij,bjhk->bihk', w, v[:, :, kv_head])
  return np.einsum('bthk,hkd->btd', o, wo), max_logits


def np_forward(cfg, params, tokens, positions=None):
  """float64 forward: (logits [B, T, V], max_logits [layers, H])."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  tokens = np.asarray(tokens)
  if positions is None:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  positions = np.asarray(positions, np.float64)
  h = p['embed'][tokens]
  max_logits = []
  for i in range(cfg.num_layers):
    lp = p[f'layer_{i}']
    y, m = np_attention_block(np_rmsnorm(h, lp['mixer_norm']['scale'], cfg.norm_eps), lp['attention'], positions, cfg)
    h = h + y
    max_logits.append(m)
    x = np_rmsnorm(h, lp['mlp_norm']['scale'], cfg.norm_eps)
    mlp = lp['mlp']
    h = h + (np_silu(x @ matrix(mlp['wi_gate'])) * (x @ matrix(mlp['wi_up']))) @ matrix(mlp['wo'])
  x = np_rmsnorm(h, p['final_norm']['scale'], cfg.norm_eps)
  head = p['embed'].T if cfg.tie_embeddings else p['head']
  return x @ head, np.stack(max_logits)


def np_sigmoid(x):
  return 1 / (1 + np.exp(-x))


# ----------------------------------------------------------------------------- attention, max logits


def ref_mask(t, s, causal):
  """[T, S] bool; query i sits at absolute position s - t + i (the last T of S positions)."""
  if not causal:
    return np.ones((t, s), bool)
  q_pos = np.arange(s - t, s)
  return q_pos[:, None] >= np.arange(s)[None, :]


def ref_expand_kv(x_bskd, h):
  """Repeat kv heads so that query head j reads kv head j // (H / Hkv): [B, S, H, D]."""
  group = h // x_bskd.shape[2]
  return x_bskd[:, :, np.arange(h) // group]


def ref_attention(q, k, v, causal):
  """float64 softmax attention; returns (out [B, T, H, Dv], probs [B, H, T, S])."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  _, t, h, d = q.shape
  s = k.shape[1]
  kh, vh = ref_expand_kv(k, h), ref_expand_kv(v, h)
  logits = np.einsum('bthd,bshd->bhts', q, kh) * d**-0.5
  logits = np.where(ref_mask(t, s, causal), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bhts,bshd->bthd', p, vh), p


def ref_max_logits(q, k, causal):
  """Per head: max over batch, queries and unmasked keys of D**-0.5 * q . k (explicit loops)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  out = np.full(h, -np.inf)
  for head in range(h):
    kv = head // (h // hkv)
    for bi in range(b):
      for i in range(t):
        last_key = s - t + i if causal else s - 1
        for j in range(last_key + 1):
          out[head] = max(out[head], float(q[bi, i, head] @ k[bi, j, kv]) * d**-0.5)
  return out


def ref_attention_grads(q, k, v, d_out, causal):
  """Analytic float64 backward of sum(out * d_out) w.r.t. q, k, v."""
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  scale = d**-0.5
  kh, vh = ref_expand_kv(k, h), ref_expand_kv(v, h)
  _, p = ref_attention(q, k, v, causal)
  dp = np.einsum('bthd,bshd->bhts', d_out, vh)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))  # softmax Jacobian; masked p are 0
  dq = scale * np.einsum('bhts,bshd->bthd', ds, kh)
  dkh = scale * np.einsum('bhts,bthd->bshd', ds, q)
  dvh = np.einsum('bhts,bthd->bshd', p, d_out)
  group = h // hkv  # sum each kv head's query heads
  dk = dkh.reshape(b, s, hkv, group, d).sum(3)
  dv = dvh.reshape(b, s, hkv, group, v.shape[-1]).sum(3)
  return dq, dk, dv


def ref_max_logits_fast(q, k, causal):
  """Vectorised ref_max_logits (same definition, for larger shapes): float64 max over batch,
  queries and unmasked keys of D^-0.5 q . k per head; queries are the last T of S positions."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  _, t, h, d = q.shape
  logits = np.einsum('bthd,bshd->bhts', q, ref_expand_kv(k, h)) * d**-0.5
  return np.where(ref_mask(t, k.shape[1], causal), logits, -np.inf).max(axis=(0, 2, 3))


def np_projected_max_logits(x_btd, w_q, w_k):
  """Per query head max over batch and causal (t, s) of q_t . k_s / sqrt(Dh), float64, with q and
  k projected from x by w_q [D, H, Dh] and w_k [D, Hkv, Dh] and rotated (RoPE, theta 10^4)."""
  x, w_q, w_k = (np.asarray(a, np.float64) for a in (x_btd, w_q, w_k))
  t = x.shape[1]
  positions = np.arange(t, dtype=np.float64)[None]
  q = np_rope(np.einsum('btd,dhk->bthk', x, w_q), positions, 10000.0)
  k = np_rope(np.einsum('btd,dhk->bthk', x, w_k), positions, 10000.0)
  k = np.repeat(k, w_q.shape[1] // w_k.shape[1], axis=2)  # query head h uses KV head h // G
  logits = np.einsum('bthk,bshk->bhts', q, k) / np.sqrt(w_q.shape[-1])
  causal = np.tril(np.ones((t, t), bool))
  return np.where(causal, logits, -np.inf).max(axis=(0, 2, 3))


# ----------------------------------------------------------------------------- KDA (docs/kda.md)


def ref_kda(q, k, v, g, beta, scale, s0=None):
  """float64 KDA, docs/kda.md, one token at a time; returns (o [B, T, H, V], S_T [B, H, K, V])."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  s = np.zeros((b, h, dk, dv)) if s0 is None else np.array(s0, np.float64)
  o = np.zeros((b, t, h, dv))
  for i in range(t):
    s = s * np.exp(g[:, i])[..., None]  # decay
    predicted = np.einsum('bhkv,bhk->bhv', s, k[:, i])  # S^T k
    delta = beta[:, i, :, None] * (v[:, i] - predicted)  # beta (v - S^T k)
    s = s + k[:, i, :, :, None] * delta[:, :, None, :]  # + k delta^T
    o[:, i] = np.einsum('bhkv,bhk->bhv', s, scale * q[:, i])  # read
  return o, s


def np_conv(x, w):
  """Causal depthwise conv over axis 1: y[t] = sum_j w[j] x[t - 3 + j]."""
  width = w.shape[0]
  xp = np.concatenate([np.zeros((x.shape[0], width - 1) + x.shape[2:]), x], axis=1)
  return sum(xp[:, j : j + x.shape[1]] * w[j] for j in range(width))


def np_short_conv(x, w, activation):
  """docs/kda.md's short conv and its activation in float64: 'none', 'silu', or 'silu_l2' (SiLU, then
  each head's features divided by their L2 norm, eps 1e-6)."""
  y = np_conv(np.asarray(x, np.float64), np.asarray(w, np.float64))
  if activation == 'none':
    return y
  a = np_silu(y)
  return a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6) if activation == 'silu_l2' else a


def np_kda_layer(p, x, *, short_conv, output_gate, lower_bound):
  """float64 docs/kda.md layer with parameters p (the layer's tree) on x [B, T, D] -> y [B, T, D]."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  h, dk = p['q_proj'].shape[1:]
  q, k, v = (np.einsum('btd,dhk->bthk', x, p[f'{n}_proj']) for n in 'qkv')
  if short_conv:
    q, k, v = (np_conv(t, p[f'{n}_conv']['kernel']) for t, n in zip((q, k, v), 'qkv'))
  l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
  q, k, v = l2(np_silu(q)), l2(np_silu(k)), np_silu(v)
  beta = np_sigmoid(np.einsum('btd,dh->bth', x, p['b_proj']))
  f = np.einsum('btr,rhk->bthk', x @ p['f_a'], p['f_b']) + p['dt_bias']
  a = np.exp(p['A_log'])[:, None]
  g = lower_bound * np_sigmoid(a * f) if lower_bound else -a * np.log1p(np.exp(f))
  s = np.zeros((x.shape[0], h, dk, dk))
  o = np.zeros((x.shape[0], x.shape[1], h, dk))
  for t in range(x.shape[1]):  # docs/kda.md: decay, delta write, read
    s = s * np.exp(g[:, t])[..., None]
    pred = np.einsum('bhkv,bhk->bhv', s, k[:, t])
    s = s + np.einsum('bhk,bhv->bhkv', k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
    o[:, t] = np.einsum('bhkv,bhk->bhv', s, q[:, t] * dk**-0.5)
  o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * p['o_norm']
  if output_gate != 'none':
    gate = np.einsum('btr,rhk->bthk', x @ p['g_a'], p['g_b'])
    o = o * (np_sigmoid(gate) if output_gate == 'sigmoid' else np_silu(gate))
  return np.einsum('bthk,hkd->btd', o, p['o_proj'])


# ----------------------------------------------------------------------------- MLA


def np_mla(p, x, pos, cfg):
  """float64 reference: returns y [B, T, D] and per-head max logits [H]."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  eps, dn, dr = 1e-6, cfg['qk_nope_head_dim'], cfg['qk_rope_head_dim']
  q_in = np_rmsnorm(x @ p['q_down'], p['q_norm']['scale'], eps) if cfg['q_lora_rank'] else x
  q = np.einsum('btr,rhk->bthk', q_in, p['q_nope'])
  c = np_rmsnorm(x @ p['kv_down'], p['kv_norm']['scale'], eps)
  k = np.einsum('btr,rhk->bthk', c, p['k_nope'])
  v = np.einsum('btr,rhk->bthk', c, p['v'])
  if dr:
    qr = np_rope(np.einsum('btr,rhk->bthk', q_in, p['q_rope']), pos, 10000.0)
    kr = np_rope((x @ p['k_rope'])[:, :, None], pos, 10000.0)
    q = np.concatenate([q, qr], -1)
    k = np.concatenate([k, np.broadcast_to(kr, k.shape[:3] + (dr,))], -1)
  logits = np.einsum('bthk,bshk->bhts', q, k) * (dn + dr) ** -0.5
  mask = np.tril(np.ones((x.shape[1], x.shape[1]), bool))
  logits = np.where(mask, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = np.einsum('bhts,bshk->bthk', probs, v)
  return np.einsum('bthk,hkd->btd', o, p['out']), logits.max(axis=(0, 2, 3))


def np_mla_decode(q_latent, q_rope, latent, k_rope, length, scale):
  """The absorbed MLA decode (docs/attention.md#decoding), float64: per sequence b, the softmax over
  positions s < length[b] of scale (q_latent[b, h] . latent[b, s] + q_rope[b, h] . k_rope[b, s]), times
  latent[b, s]. q_rope and k_rope None when dr = 0. Returns o_latent [B, H, r]."""
  q_latent, latent = np.asarray(q_latent, np.float64), np.asarray(latent, np.float64)
  out = np.zeros(q_latent.shape)
  for b, n in enumerate(np.broadcast_to(np.asarray(length), (q_latent.shape[0],))):
    logits = q_latent[b] @ latent[b, :n].T
    if q_rope is not None:
      logits += np.asarray(q_rope[b], np.float64) @ np.asarray(k_rope[b, :n], np.float64).T
    probs = np.exp(scale * logits - (scale * logits).max(-1, keepdims=True))
    out[b] = (probs / probs.sum(-1, keepdims=True)) @ latent[b, :n]
  return out


# ----------------------------------------------------------------------------- Muon, AdamW


def np_ns5(n):
  """Newton-Schulz, 5 steps, float64."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = n / (np.sqrt(np.sum(n * n)) + 1e-7)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  for _ in range(5):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


class NpMuon:
  """Moonlight's Muon on one matrix W [A, B], float64."""

  def __init__(self, w, *, mu=0.95, nesterov=True, wd=0.0):
    self.w, self.m, self.mu, self.nesterov, self.wd = np.array(w, np.float64), np.zeros(np.shape(w)), mu, nesterov, wd

  def step(self, g, lr):
    g = np.asarray(g, np.float64)
    self.m = self.mu * self.m + g
    n = g + self.mu * self.m if self.nesterov else self.m
    o = np_ns5(n)
    self.w = self.w - lr * (0.2 * np.sqrt(max(self.w.shape)) * o + self.wd * self.w)


class NpAdamW:
  """AdamW (decoupled, decay multiplied by the lr), float64."""

  def __init__(self, w, *, b1=0.9, b2=0.95, eps=1e-8, wd=0.0):
    self.w = np.array(w, np.float64)
    self.m, self.v, self.t = np.zeros_like(self.w), np.zeros_like(self.w), 0
    self.b1, self.b2, self.eps, self.wd = b1, b2, eps, wd

  def step(self, g, lr):
    g = np.asarray(g, np.float64)
    self.t += 1
    self.m = self.b1 * self.m + (1 - self.b1) * g
    self.v = self.b2 * self.v + (1 - self.b2) * g * g
    m_hat, v_hat = self.m / (1 - self.b1**self.t), self.v / (1 - self.b2**self.t)
    self.w = self.w - lr * (m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * self.w)


# ----------------------------------------------------------------------------- AttnRes (docs/attention_residuals.md)


def np_depth_attention(sources, w, gain, eps, *, key_norm=True, depth_weights='softmax'):
  """float64 docs/attention_residuals.md depth attention and its two ablated switches. Keys k_i = gain * v_i / rms(v_i)
  with rms(v) = sqrt(mean_d v^2 + eps) (key_norm), or k_i = v_i (key_norm=False: no norm and no
  gain; pass gain=None); logits s_i = w . k_i; alpha = softmax_i(s) ('softmax') or
  alpha_i = 1 / (1 + exp(-s_i)) ('sigmoid'); h = sum_i alpha_i v_i.
  Returns (h [..., D], alpha [N, ...])."""
  v = np.stack(sources).astype(np.float64)
  if key_norm:
    keys = gain * v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
  else:
    assert gain is None, 'without the key norm there is no key gain'
    keys = v
  logits = keys @ np.asarray(w, np.float64)
  if depth_weights == 'sigmoid':
    alpha = 1 / (1 + np.exp(-logits))
  else:
    assert depth_weights == 'softmax', depth_weights
    alpha = np.exp(logits - logits.max(axis=0))
    alpha /= alpha.sum(axis=0)
  return np.einsum('n...,n...d->...d', alpha, v), alpha


def np_merge_norm(o, lse, partial, q, scale, eps, norm_eps):
  """float64 docs/attention_residuals.md phase 2 then RMSNorm: the softmax over [block sums (their logsumexp lse),
  partial] as a two-way gate, the merged input normalised with gain `scale`."""
  o, lse, p = (np.asarray(a, np.float64) for a in (o, lse, partial))
  s_p = (p / np.sqrt(np.mean(p * p, -1, keepdims=True) + eps)) @ q
  sigma = (1 / (1 + np.exp(s_p - lse)))[..., None]
  h = sigma * o + (1 - sigma) * p
  return scale * h / np.sqrt(np.mean(h * h, -1, keepdims=True) + norm_eps)


def np_attnres_forward(cfg, params, tokens):
  """float64 forward of an AttnRes model: (logits, mean weights per consumer, input RMS, output RMS).

  Every sublayer output is kept; consumer l (sublayer index, or L for the final aggregator) with
  block size S sees b_0 = embedding, the sums of the blocks [kS, (k+1)S) that end at or before l,
  and the sum of the outputs of its own block before l when there are any, and weighs them by
  np_depth_attention with cfg.attnres_key_norm and cfg.attnres_depth_weights (the key gain only
  with the key norm). Sublayer 0 has no parameters and takes the embedding itself (weight 1).
  """
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  tokens = np.asarray(tokens)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.float64)
  S = 1 if cfg.residual == 'attnres_full' else cfg.attnres_block_size
  emb = p['embed'][tokens]
  outputs, weights, in_rms, out_rms = [], [], [], []

  def consume(l, q):
    n = l // S
    sources = [emb] + [sum(outputs[k * S : (k + 1) * S]) for k in range(n)]
    if l % S:
      sources.append(sum(outputs[n * S : l]))
    if q is None:  # sublayer 0: the embedding alone, no parameters
      assert l == 0 and len(sources) == 1
      h, alpha = emb, np.ones((1,) + emb.shape[:-1])
    else:
      assert ('attnres_key_scale' in q) == cfg.attnres_key_norm, sorted(q)
      h, alpha = np_depth_attention(
        sources,
        q['attnres_query'],
        q.get('attnres_key_scale'),
        cfg.norm_eps,
        key_norm=cfg.attnres_key_norm,
        depth_weights=cfg.attnres_depth_weights,
      )
    weights.append(alpha.mean(axis=(1, 2)))
    in_rms.append(np.sqrt(np.mean(h * h)))
    return h

  for i in range(cfg.num_layers):
    lp = p[f'layer_{i}']
    h = consume(2 * i, p['attnres'].get(f'layer_{i}_mixer'))
    y, _ = np_attention_block(np_rmsnorm(h, lp['mixer_norm']['scale'], cfg.norm_eps), lp['attention'], positions, cfg)
    outputs.append(y)
    h = consume(2 * i + 1, p['attnres'][f'layer_{i}_mlp'])
    x = np_rmsnorm(h, lp['mlp_norm']['scale'], cfg.norm_eps)
    mlp = lp['mlp']
    outputs.append((np_silu(x @ matrix(mlp['wi_gate'])) * (x @ matrix(mlp['wi_up']))) @ matrix(mlp['wo']))
  out_rms = [np.sqrt(np.mean(y * y)) for y in outputs]
  h = consume(2 * cfg.num_layers, p['attnres']['final'])
  x = np_rmsnorm(h, p['final_norm']['scale'], cfg.norm_eps)
  head = p['embed'].T if cfg.tie_embeddings else p['head']
  return x @ head, weights, np.array(in_rms), np.array(out_rms)


# ----------------------------------------------------------------------------- packed documents


def np_document_spans(segment_ids_bt):
  """[(row, start, end)] of each run of equal segment ids, row by row (docs/data.md#document-masking)."""
  spans = []
  for row, ids in enumerate(np.asarray(segment_ids_bt)):
    cuts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    spans += [(row, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
  return spans


def np_each_document(fn, segment_ids_bt, *arrays):
  """fn applied to each document alone (arrays [B, T, ...] cut to [1, length, ...]), its outputs
  [1, length, ...] put back in place: what packing with document masking must reproduce."""
  out = None
  for row, a, b in np_document_spans(segment_ids_bt):
    piece = np.asarray(fn(*(x[row : row + 1, a:b] for x in arrays)))
    if out is None:
      out = np.zeros((len(arrays[0]), arrays[0].shape[1]) + piece.shape[2:], piece.dtype)
    out[row, a:b] = piece[0]
  return out
