"""float64 NumPy transcription of the released Mixture-of-Experts layer, the oracle of
tests/ops/test_moe_ops.py and tests/layers/test_moe_layer.py (beside tests/oracles.py, which holds the
other sublayers' oracles). Written from DeepSeek-V3 §2.1 (arXiv 2412.19437) and the released
modeling code's facts (transformers' DeepseekV3MoE, which KimiLinearMoE reuses), never calling
kimijax: a token at a time for the routing, explicit loops over the chosen experts, and the
gradients by hand (backpropagation written out), so that no autodiff is shared with the code
under test.

Routing per token: s = sigmoid(u) (or softmax(u)); c = s + b chooses; with groups a group's score
is the sum of its two largest c and only the topk_group best groups are eligible; the top_k
eligible experts by c are chosen; their weights are s / (sum of the chosen s + 1e-20) (when
renormalising) times the scaling factor. y = sum_k w_k SwiGLU_{e_k}(x) + SwiGLU_shared(x).
The sequence-wise balance loss: alpha * mean over sequences of sum_i f_i P_i, f_i = E / (K T) x
(times i was chosen in the sequence), P_i = mean over the sequence of s_i / sum_j s_j.
"""

import numpy as np


def np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def np_silu(x):
  return x * np_sigmoid(x)


def np_dsilu(x):
  s = np_sigmoid(x)
  return s * (1.0 + x * (1.0 - s))


def np_scores(logits_te, score_func):
  if score_func == 'sigmoid':
    return np_sigmoid(logits_te)
  z = np.exp(logits_te - logits_te.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def np_route(logits_te, bias_e, *, top_k, score_func='sigmoid', n_group=1, topk_group=1, renormalize=True, scaling=1.0):
  """(experts [T, K] best first, weights [T, K], scores [T, E], margin): margin is the smallest gap,
  over tokens, between the last chosen and the first unchosen biased score (and between the last
  eligible and the first ineligible group score): a test needs it well above float32 rounding."""
  logits_te = np.asarray(logits_te, np.float64)
  t, e = logits_te.shape
  scores = np_scores(logits_te, score_func)
  bias = np.zeros(e) if bias_e is None else np.asarray(bias_e, np.float64)
  experts = np.zeros((t, top_k), np.int64)
  weights = np.zeros((t, top_k))
  margin = np.inf
  for i in range(t):
    c = scores[i] + bias
    eligible = np.ones(e, bool)
    if n_group > 1:
      size = e // n_group
      group_score = np.array([np.sort(c[g * size : (g + 1) * size])[-2:].sum() for g in range(n_group)])
      ranked = np.argsort(-group_score, kind='stable')
      if topk_group < n_group:
        margin = min(margin, group_score[ranked[topk_group - 1]] - group_score[ranked[topk_group]])
      eligible[:] = False
      for g in ranked[:topk_group]:
        eligible[g * size : (g + 1) * size] = True
    candidates = np.flatnonzero(eligible)
    candidates = candidates[np.argsort(-c[candidates], kind='stable')]
    chosen = candidates[:top_k]
    if len(candidates) > top_k:
      margin = min(margin, c[chosen[-1]] - c[candidates[top_k]])
    w = scores[i, chosen]
    if renormalize:
      w = w / (w.sum() + 1e-20)
    experts[i], weights[i] = chosen, w * scaling
  return experts, weights, scores, margin


def np_swiglu(x_nd, w_gate, w_up, w_down):
  return (np_silu(x_nd @ w_gate) * (x_nd @ w_up)) @ w_down


def np_swiglu_backward(x_nd, w_gate, w_up, w_down, g_nd):
  """(dx, dw_gate, dw_up, dw_down) of sum(g * SwiGLU(x))."""
  a, u = x_nd @ w_gate, x_nd @ w_up
  h = np_silu(a) * u
  dh = g_nd @ w_down.T
  da, du = dh * u * np_dsilu(a), dh * np_silu(a)
  return da @ w_gate.T + du @ w_up.T, x_nd.T @ da, x_nd.T @ du, h.T @ g_nd


def np_routed_experts(x_td, weights_tk, experts_tk, w_gate, w_up, w_down, dy_td=None):
  """y [T, D] = sum_k w_tk SwiGLU_{e_tk}(x_t), a (token, k) pair at a time; with dy also the
  gradients of sum(y * dy): (y, dx, dweights, dw_gate, dw_up, dw_down)."""
  x_td, weights_tk = np.asarray(x_td, np.float64), np.asarray(weights_tk, np.float64)
  w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in (w_gate, w_up, w_down))
  t, k = experts_tk.shape
  y = np.zeros_like(x_td)
  dx, dw = np.zeros_like(x_td), np.zeros_like(weights_tk)
  dg, du, dd = np.zeros_like(w_gate), np.zeros_like(w_up), np.zeros_like(w_down)
  for n in range(t):
    for j in range(k):
      e = experts_tk[n, j]
      out = np_swiglu(x_td[n : n + 1], w_gate[e], w_up[e], w_down[e])[0]
      y[n] += weights_tk[n, j] * out
      if dy_td is not None:
        g = np.asarray(dy_td, np.float64)[n : n + 1]
        dw[n, j] = np.sum(g * out)
        gx, gg, gu, gd = np_swiglu_backward(x_td[n : n + 1], w_gate[e], w_up[e], w_down[e], weights_tk[n, j] * g)
        dx[n] += gx[0]
        dg[e] += gg
        du[e] += gu
        dd[e] += gd
  return y if dy_td is None else (y, dx, dw, dg, du, dd)


def np_sequence_balance_loss(scores_bte, experts_btk, alpha):
  b, t, e = scores_bte.shape
  k = experts_btk.shape[-1]
  total = 0.0
  for i in range(b):
    f = np.array([np.sum(experts_btk[i] == j) for j in range(e)]) * e / (k * t)
    p = (scores_bte[i] / scores_bte[i].sum(-1, keepdims=True)).mean(0)
    total += np.sum(f * p)
  return alpha * total / b


def np_moe_layer(x_btd, params, bias_e, cfg, dy_btd=None):
  """The layer in float64. params: 'router' [D, E], 'wi_gate' 'wi_up' [E, D, F], 'wo' [E, F, D] and
  optionally 'shared' {'wi_gate', 'wi_up', 'wo'}; cfg: a dict with top_k, score_func, n_group,
  topk_group, renormalize, scaling, alpha. Returns (y [B, T, D], aux_loss, routing (experts,
  weights, scores, margin)) and, with dy_btd, also the gradients of sum(y * dy) + aux_loss: a dict
  like params plus 'x'."""
  p = {
    k: (
      np.asarray(v, np.float64) if not isinstance(v, dict) else {kk: np.asarray(vv, np.float64) for kk, vv in v.items()}
    )
    for k, v in params.items()
  }
  x_btd = np.asarray(x_btd, np.float64)
  b, t, d = x_btd.shape
  x = x_btd.reshape(b * t, d)
  e = p['router'].shape[1]
  logits = x @ p['router']
  experts, weights, scores, margin = np_route(
    logits,
    bias_e,
    top_k=cfg['top_k'],
    score_func=cfg['score_func'],
    n_group=cfg['n_group'],
    topk_group=cfg['topk_group'],
    renormalize=cfg['renormalize'],
    scaling=cfg['scaling'],
  )
  k = experts.shape[1]
  y = np.zeros_like(x)
  outs = np.zeros((b * t, k, d))
  for n in range(b * t):
    for j in range(k):
      ex = experts[n, j]
      outs[n, j] = np_swiglu(x[n : n + 1], p['wi_gate'][ex], p['wi_up'][ex], p['wo'][ex])[0]
      y[n] += weights[n, j] * outs[n, j]
  if 'shared' in p:
    sh = p['shared']
    y += np_swiglu(x, sh['wi_gate'], sh['wi_up'], sh['wo'])
  aux = np_sequence_balance_loss(scores.reshape(b, t, e), experts.reshape(b, t, k), cfg['alpha'])
  routing = (experts, weights, scores, margin)
  if dy_btd is None:
    return y.reshape(b, t, d), aux, routing

  g = np.asarray(dy_btd, np.float64).reshape(b * t, d)
  grads = {name: np.zeros_like(p[name]) for name in ('router', 'wi_gate', 'wi_up', 'wo')}
  dx = np.zeros_like(x)
  dweights = np.einsum('nd,nkd->nk', g, outs)
  for n in range(b * t):
    for j in range(k):
      ex = experts[n, j]
      gx, gg, gu, gd = np_swiglu_backward(
        x[n : n + 1], p['wi_gate'][ex], p['wi_up'][ex], p['wo'][ex], weights[n, j] * g[n : n + 1]
      )
      dx[n] += gx[0]
      grads['wi_gate'][ex] += gg
      grads['wi_up'][ex] += gu
      grads['wo'][ex] += gd
  if 'shared' in p:
    sh = p['shared']
    gx, gg, gu, gd = np_swiglu_backward(x, sh['wi_gate'], sh['wi_up'], sh['wo'], g)
    dx += gx
    grads['shared'] = {'wi_gate': gg, 'wi_up': gu, 'wo': gd}

  # weights -> scores: w_j = scaling * s_j / Z (Z = sum of the chosen s + 1e-20) or scaling * s_j.
  dscores = np.zeros_like(scores)
  for n in range(b * t):
    s_c = scores[n, experts[n]]
    if cfg['renormalize']:
      z = s_c.sum() + 1e-20
      dscores[n, experts[n]] += cfg['scaling'] * (dweights[n] / z - np.sum(dweights[n] * s_c) / z**2)
    else:
      dscores[n, experts[n]] += cfg['scaling'] * dweights[n]
  # aux loss -> scores: d/dp_bte = alpha f_be / (B T); p = s / S -> ds = (dp - sum(dp p)) / S.
  if cfg['alpha']:
    s_bte = scores.reshape(b, t, e)
    ex_btk = experts.reshape(b, t, k)
    for i in range(b):
      f = np.array([np.sum(ex_btk[i] == j) for j in range(e)]) * e / (k * t)
      ssum = s_bte[i].sum(-1, keepdims=True)
      pr = s_bte[i] / ssum
      dp = np.broadcast_to(cfg['alpha'] * f / (b * t), pr.shape)
      dscores[i * t : (i + 1) * t] += (dp - np.sum(dp * pr, -1, keepdims=True)) / ssum
  if cfg['score_func'] == 'sigmoid':
    dlogits = dscores * scores * (1.0 - scores)
  else:
    dlogits = scores * (dscores - np.sum(dscores * scores, -1, keepdims=True))
  grads['router'] = x.T @ dlogits
  dx += dlogits @ p['router'].T
  grads['x'] = dx.reshape(b, t, d)
  return y.reshape(b, t, d), aux, routing, grads
