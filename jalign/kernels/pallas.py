"""Pallas kernels for token log-probs / entropy / logsumexp: logits exist only as [tokens x vocab] tiles on chip.

Both backends share the tile maths (`_logits_tile`, `_dlogits_tile`) over a grid of (token blocks i, vocabulary
blocks j); the backward recomputes each logits tile from the saved logsumexp. They differ in how tiles combine:

- `gpu` (Triton lowering; the grid runs in parallel): the forward writes each tile's softmax statistics (max, sum of
  exp, sum of exp x logit, target logit) to small [vocab blocks, tokens] arrays, combined in XLA with a logsumexp
  (the split of Apple's Cut Cross-Entropy, Wijmans et al. 2024); the backward is one kernel per (i, j) tile that
  atomically adds its share of d hidden [bt, D] and d unembed [D, bv] in fp32, walking the model dimension in `bd`
  slices so the working set is three small tiles.
- `tpu` (Mosaic; the grid runs in order on a core, the vocabulary or token axis last, "arbitrary"): the forward keeps
  the statistics in its resident [bt, 1] output blocks and updates them online over the vocabulary blocks (per-tile
  statistics would be [vocab blocks, tokens, 1] arrays, and TPU pads a trailing 1 to 128 lanes: twice the memory of
  the logits); the backward's two kernels accumulate d hidden over vocabulary blocks and d unembed over token blocks
  in fp32 VMEM scratch and write each block once, in the input dtype (an fp32 [D, V] gradient alone would be as
  large as the logits).

`interpret=True` runs either on CPU (slowly: each grid step is a few ms); the tests do that.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30
BACKENDS = ("gpu", "tpu")
# Default tile sizes: (tokens, vocabulary, model-dim slice). GPU tiles follow common Triton matmul tiles; the TPU
# tiles are multiples of the (8, 128) vreg layout and keep the working set (double-buffered W block and the fp32
# d unembed block) inside the default scoped VMEM.
DEFAULT_BLOCKS = {"gpu": (64, 128, 64), "tpu": (128, 256, 0)}
TPU_SCOPED_VMEM = 16 << 20   # Mosaic's default scoped VMEM limit; the default TPU blocks narrow to stay under it


def _logits_tile(h_ref, w_ref, j, *, bd, vocab, temperature, softcap):
  """Scaled logits [bt, bv] of tile (., j) with columns past the vocabulary at -inf, d logits / d z, column ids."""
  bt, dp = h_ref.shape
  bv = w_ref.shape[1]
  if bd >= dp:
    z = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  else:
    def body(k, acc):
      sl = pl.ds(pl.multiple_of(k * bd, bd), bd)
      return acc + jnp.dot(h_ref[:, sl], w_ref[sl, :], preferred_element_type=jnp.float32)
    z = jax.lax.fori_loop(0, dp // bd, body, jnp.zeros((bt, bv), jnp.float32))
  dz = jnp.full((bt, bv), 1.0 / temperature, jnp.float32)
  if softcap is not None:
    t = jnp.tanh(z / softcap)
    z = t * softcap
    dz = dz * (1.0 - t * t)
  cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
  return jnp.where(cols < vocab, z / temperature, _NEG), dz, cols


def _dlogits_tile(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, j, **kw):
  """d loss / d z for tile (., j): d logp/dl = 1[target] - p, d lse/dl = p, d entropy/dl = -p (l - E_p[l])."""
  logits, dz, cols = _logits_tile(h_ref, w_ref, j, **kw)
  p = jnp.exp(logits - lse_ref[...])
  onehot = (cols == y_ref[...]).astype(jnp.float32)
  dl = glogp_ref[...] * (onehot - p) + glse_ref[...] * p - gent_ref[...] * p * (logits - mean_ref[...])
  return jnp.where(cols < kw["vocab"], dl, 0.0) * dz


def _fwd_tpu_kernel(h_ref, w_ref, y_ref, m_ref, s_ref, sl_ref, t_ref, **kw):
  """Online softmax statistics over the vocabulary blocks j (the trailing, sequential grid axis)."""
  j = pl.program_id(1)
  logits, _, cols = _logits_tile(h_ref, w_ref, j, **kw)

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, _NEG)
    s_ref[...] = jnp.zeros_like(s_ref)
    sl_ref[...] = jnp.zeros_like(sl_ref)
    t_ref[...] = jnp.zeros_like(t_ref)

  m_old = m_ref[...]
  m_new = jnp.maximum(m_old, jnp.max(logits, axis=1, keepdims=True))
  e = jnp.exp(logits - m_new)
  rescale = jnp.exp(m_old - m_new)
  s_ref[...] = s_ref[...] * rescale + jnp.sum(e, axis=1, keepdims=True)
  sl_ref[...] = sl_ref[...] * rescale + jnp.sum(e * jnp.where(cols < kw["vocab"], logits, 0.0), axis=1,
                                                keepdims=True)
  t_ref[...] += jnp.sum(jnp.where(cols == y_ref[...], logits, 0.0), axis=1, keepdims=True)
  m_ref[...] = m_new


def _fwd_kernel(h_ref, w_ref, y_ref, m_ref, s_ref, sl_ref, t_ref, **kw):
  logits, _, cols = _logits_tile(h_ref, w_ref, pl.program_id(1), **kw)
  m = jnp.max(logits, axis=1, keepdims=True)
  e = jnp.exp(logits - m)
  m_ref[...] = m
  s_ref[...] = jnp.sum(e, axis=1, keepdims=True)
  sl_ref[...] = jnp.sum(e * jnp.where(cols < kw["vocab"], logits, 0.0), axis=1, keepdims=True)
  t_ref[...] = jnp.sum(jnp.where(cols == y_ref[...], logits, 0.0), axis=1, keepdims=True)


def _contract(a, b, dims):
  return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _bwd_gpu_kernel(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, _dh_in, _dw_in,
                    dh_ref, dw_ref, **kw):
  from jax.experimental.pallas import triton as plgpu
  dl = _dlogits_tile(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, pl.program_id(1), **kw)
  dl = dl.astype(h_ref.dtype)
  bd = kw["bd"]

  def body(k, carry):
    sl = pl.ds(pl.multiple_of(k * bd, bd), bd)
    plgpu.atomic_add(dh_ref, (slice(None), sl), _contract(dl, w_ref[sl, :], ((1,), (1,))))  # dl @ W_k.T
    plgpu.atomic_add(dw_ref, (sl, slice(None)), _contract(h_ref[:, sl], dl, ((0,), (0,))))  # h_k.T @ dl
    return carry

  jax.lax.fori_loop(0, h_ref.shape[1] // bd, body, 0)


def _accumulate(out_ref, acc_ref, step, steps, value):
  """acc += value over the sequential grid axis (fp32 scratch), written to the output block once, at the end."""
  @pl.when(step == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += value

  @pl.when(step == steps - 1)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _bwd_tpu_dh_kernel(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, dh_ref, acc_ref,
                       **kw):
  j = pl.program_id(1)
  dl = _dlogits_tile(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, j, **kw)
  _accumulate(dh_ref, acc_ref, j, pl.num_programs(1), _contract(dl.astype(w_ref.dtype), w_ref[...], ((1,), (1,))))


def _bwd_tpu_dw_kernel(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, dw_ref, acc_ref,
                       **kw):
  dl = _dlogits_tile(h_ref, w_ref, y_ref, lse_ref, mean_ref, glogp_ref, gent_ref, glse_ref, pl.program_id(0), **kw)
  _accumulate(dw_ref, acc_ref, pl.program_id(1), pl.num_programs(1),
              _contract(h_ref[...], dl.astype(h_ref.dtype), ((0,), (0,))))


def _round_up(x, m):
  return -(-x // m) * m


def _pad(x, rows, cols):
  pr, pc = rows - x.shape[0], cols - x.shape[1]
  return x if pr == pc == 0 else jnp.pad(x, ((0, pr), (0, pc)))


def _specs(bt, bv, dp, swap: bool):
  """Block specs of (h, W, then per-row [N, 1] columns); `swap` puts the vocabulary block on grid axis 0."""
  tok = (lambda j, i: (i, 0)) if swap else (lambda i, j: (i, 0))
  voc = (lambda j, i: (0, j)) if swap else (lambda i, j: (0, j))
  return pl.BlockSpec((bt, dp), tok), pl.BlockSpec((dp, bv), voc), pl.BlockSpec((bt, 1), tok)


def tpu_vmem_bytes(bt: int, bv: int, dp: int, itemsize: int) -> int:
  """VMEM the TPU kernels' largest working set needs (the d unembed kernel): double-buffered h [bt, D] and W [D, bv]
  blocks and d unembed output block, its fp32 accumulator and the fp32 product added to it, and a few fp32 tiles."""
  return 2 * bt * dp * itemsize + dp * bv * (4 * itemsize + 8) + 8 * bt * bv * 4


def _compiler_params(backend, semantics, vmem_bytes: int = 0):
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    # Past the default scoped VMEM limit (16 MiB), ask for what the working set needs, with headroom.
    limit = int(vmem_bytes * 1.25) if vmem_bytes > TPU_SCOPED_VMEM else None
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_logprobs(h, w, y, static):
  return _forward(h, w, y, static)[:3]


def _forward(h, w, y, static):
  backend, vocab, temperature, softcap, (bt, bv, bd), interpret = static
  n_p, dp = h.shape
  nt, nv = n_p // bt, w.shape[1] // bv
  h_spec, w_spec, row_spec = _specs(bt, bv, dp, swap=False)
  kw = dict(bd=bd or dp, vocab=vocab, temperature=temperature, softcap=softcap)
  if backend == "tpu":  # statistics combined online in the kernel, over the sequential vocabulary axis
    stat = jax.ShapeDtypeStruct((n_p, 1), jnp.float32)
    m, s, sl, target = pl.pallas_call(
        functools.partial(_fwd_tpu_kernel, **kw), grid=(nt, nv), in_specs=[h_spec, w_spec, row_spec],
        out_specs=[row_spec] * 4, out_shape=[stat] * 4,
        compiler_params=_compiler_params(backend, ("parallel", "arbitrary"),
                                         tpu_vmem_bytes(bt, bv, dp, h.dtype.itemsize)),
        interpret=interpret, name="token_logprobs_fwd_tpu")(h, w, y)
    lse = m + jnp.log(s)
    mean_logit = sl / s
    return target - lse, lse - mean_logit, lse, mean_logit  # each [N_p, 1]
  stat = jax.ShapeDtypeStruct((nv, n_p, 1), jnp.float32)
  stat_spec = pl.BlockSpec((None, bt, 1), lambda i, j: (j, i, 0))
  m, s, sl, tgt = pl.pallas_call(
      functools.partial(_fwd_kernel, **kw), grid=(nt, nv), in_specs=[h_spec, w_spec, row_spec],
      out_specs=[stat_spec] * 4, out_shape=[stat] * 4,
      compiler_params=_compiler_params(backend, ("parallel", "parallel")), interpret=interpret,
      name=f"token_logprobs_fwd_{backend}")(h, w, y)
  # Combine the per-tile statistics: logsumexp over vocabulary blocks, E_p[logits] rescaled the same way.
  big = jnp.max(m, axis=0)
  scale = jnp.exp(m - big[None])
  total = jnp.sum(s * scale, axis=0)
  lse = big + jnp.log(total)
  mean_logit = jnp.sum(sl * scale, axis=0) / total
  target = jnp.sum(tgt, axis=0)
  return target - lse, lse - mean_logit, lse, mean_logit  # each [N_p, 1]


def _fwd(h, w, y, static):
  logp, entropy, lse, mean_logit = _forward(h, w, y, static)
  return (logp, entropy, lse), (h, w, y, lse, mean_logit)


def _bwd(static, res, grads):
  backend, vocab, temperature, softcap, (bt, bv, bd), interpret = static
  h, w, y, lse, mean_logit = res
  n_p, dp = h.shape
  vp = w.shape[1]
  nt, nv = n_p // bt, vp // bv
  rows = (y, lse, mean_logit, *grads)
  kw = dict(bd=bd or dp, vocab=vocab, temperature=temperature, softcap=softcap)
  if backend == "gpu":
    h_spec, w_spec, row_spec = _specs(bt, bv, dp, swap=False)
    dh_spec, dw_spec = pl.BlockSpec((bt, dp), lambda i, j: (i, 0)), pl.BlockSpec((dp, bv), lambda i, j: (0, j))
    zeros = (jnp.zeros((n_p, dp), jnp.float32), jnp.zeros((dp, vp), jnp.float32))
    dh, dw = pl.pallas_call(
        functools.partial(_bwd_gpu_kernel, **kw), grid=(nt, nv),
        in_specs=[h_spec, w_spec] + [row_spec] * 6 + [dh_spec, dw_spec], out_specs=[dh_spec, dw_spec],
        out_shape=[jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros], input_output_aliases={8: 0, 9: 1},
        compiler_params=_compiler_params(backend, None), interpret=interpret,
        name="token_logprobs_bwd_gpu")(h, w, *rows, *zeros)
  else:  # fp32 accumulators in VMEM scratch; the outputs in the inputs' dtype
    from jax.experimental.pallas import tpu as pltpu
    vmem = tpu_vmem_bytes(bt, bv, dp, h.dtype.itemsize)
    h_spec, w_spec, row_spec = _specs(bt, bv, dp, swap=False)
    dh = pl.pallas_call(
        functools.partial(_bwd_tpu_dh_kernel, **kw), grid=(nt, nv), in_specs=[h_spec, w_spec] + [row_spec] * 6,
        out_specs=pl.BlockSpec((bt, dp), lambda i, j: (i, 0)), out_shape=jax.ShapeDtypeStruct((n_p, dp), h.dtype),
        scratch_shapes=[pltpu.VMEM((bt, dp), jnp.float32)],
        compiler_params=_compiler_params(backend, ("parallel", "arbitrary"), vmem), interpret=interpret,
        name="token_logprobs_bwd_dh_tpu")(h, w, *rows)
    h_spec, w_spec, row_spec = _specs(bt, bv, dp, swap=True)
    dw = pl.pallas_call(
        functools.partial(_bwd_tpu_dw_kernel, **kw), grid=(nv, nt), in_specs=[h_spec, w_spec] + [row_spec] * 6,
        out_specs=pl.BlockSpec((dp, bv), lambda j, i: (0, j)), out_shape=jax.ShapeDtypeStruct((dp, vp), w.dtype),
        scratch_shapes=[pltpu.VMEM((dp, bv), jnp.float32)],
        compiler_params=_compiler_params(backend, ("parallel", "arbitrary"), vmem), interpret=interpret,
        name="token_logprobs_bwd_dw_tpu")(h, w, *rows)
  return dh.astype(h.dtype), dw.astype(w.dtype), None


_token_logprobs.defvjp(_fwd, _bwd)


def token_logprobs_pallas(hidden_NxD, unembed_DxV, targets_N, *, backend: str, temperature: float = 1.0,
                          softcap: float | None = None, blocks: tuple[int, int, int] | None = None,
                          interpret: bool = False):
  """(logprobs_N, entropy_N, logsumexp_N) through the `backend` kernel; `blocks` = (tokens, vocab, model-dim slice,
  0 = whole) per tile. Inputs are zero-padded to whole tiles (padded vocabulary columns are masked)."""
  if backend not in BACKENDS:
    raise ValueError(f"Pallas backend {backend!r}; available: {', '.join(BACKENDS)}")
  bt, bv, bd = blocks or DEFAULT_BLOCKS[backend]
  n, d = hidden_NxD.shape
  if backend == "tpu" and not blocks:  # wide model dims (Llama-3-8B's 4096): narrower vocabulary blocks
    while bv > 128 and tpu_vmem_bytes(bt, bv, d, hidden_NxD.dtype.itemsize) > TPU_SCOPED_VMEM:
      bv //= 2
  vocab = unembed_DxV.shape[1]
  bt = min(bt, _round_up(n, 8))
  bv = min(bv, _round_up(vocab, 8))
  if backend == "gpu":
    bd = min(bd or d, _round_up(d, 8))
  dp = _round_up(d, bd or 1)
  n_p, vp = _round_up(n, bt), _round_up(vocab, bv)
  h = _pad(hidden_NxD, n_p, dp)
  w = _pad(unembed_DxV.astype(hidden_NxD.dtype), dp, vp)
  y = _pad(targets_N.astype(jnp.int32)[:, None], n_p, 1)
  static = (backend, vocab, float(temperature), None if softcap is None else float(softcap), (bt, bv, bd),
            interpret)
  logp, entropy, lse = _token_logprobs(h, w, y, static)
  return logp[:n, 0], entropy[:n, 0], lse[:n, 0]
