"""`full_kl(impl="pallas_tpu")`: the exact full-vocabulary KL(pi || pi_ref) as TPU (Mosaic) kernels; both models'
logits exist only as [tokens x vocab] tiles in VMEM.

The layout of `pallas.py`'s TPU log-prob kernels: the forward walks vocabulary blocks j on the sequential
("arbitrary") grid axis and keeps online statistics in resident [bt, 1] output blocks (max and sum of exp of each
model's logits, and sum of exp(z_p - m_p) (z_p - z_q)); then KL = E_p[z_p - z_q] - lse_p + lse_q. The backward
recomputes both tiles from the saved logsumexps, d KL / d z_p = p (log p - log q - KL), and accumulates d hidden
(over vocabulary blocks) and d unembed (over token blocks) of the policy in fp32 VMEM scratch, each block written
once in the input dtype. The reference is frozen (no gradient); its width may differ from the policy's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jalign.kernels.pallas import (
  _NEG,
  TPU_SCOPED_VMEM,
  _accumulate,
  _compiler_params,
  _contract,
  _logits_tile,
  _pad,
  _round_up,
  tpu_vmem_bytes,
)

DEFAULT_BLOCKS = (128, 256)  # (tokens, vocabulary)


def _tiles(hp_ref, wp_ref, hq_ref, wq_ref, j, *, vocab, temperature, softcap):
  kw = dict(vocab=vocab, temperature=temperature, softcap=softcap)
  zp, dz, cols = _logits_tile(hp_ref, wp_ref, j, bd=hp_ref.shape[1], **kw)
  zq, _, _ = _logits_tile(hq_ref, wq_ref, j, bd=hq_ref.shape[1], **kw)
  return zp, zq, dz, cols


def _fwd_kernel(hp_ref, wp_ref, hq_ref, wq_ref, mp_ref, sp_ref, acc_ref, mq_ref, sq_ref, **kw):
  j = pl.program_id(1)
  zp, zq, _, cols = _tiles(hp_ref, wp_ref, hq_ref, wq_ref, j, **kw)

  @pl.when(j == 0)
  def _():
    for ref, value in ((mp_ref, _NEG), (sp_ref, 0.0), (acc_ref, 0.0), (mq_ref, _NEG), (sq_ref, 0.0)):
      ref[...] = jnp.full_like(ref, value)

  mp_old, mq_old = mp_ref[...], mq_ref[...]
  mp = jnp.maximum(mp_old, jnp.max(zp, axis=1, keepdims=True))
  mq = jnp.maximum(mq_old, jnp.max(zq, axis=1, keepdims=True))
  ep = jnp.exp(zp - mp)
  rescale = jnp.exp(mp_old - mp)
  gap = jnp.where(cols < kw["vocab"], zp - zq, 0.0)
  sp_ref[...] = sp_ref[...] * rescale + jnp.sum(ep, axis=1, keepdims=True)
  acc_ref[...] = acc_ref[...] * rescale + jnp.sum(ep * gap, axis=1, keepdims=True)
  sq_ref[...] = sq_ref[...] * jnp.exp(mq_old - mq) + jnp.sum(jnp.exp(zq - mq), axis=1, keepdims=True)
  mp_ref[...], mq_ref[...] = mp, mq


def _dlogits(hp_ref, wp_ref, hq_ref, wq_ref, lse_p_ref, lse_q_ref, kl_ref, g_ref, j, **kw):
  zp, zq, dz, cols = _tiles(hp_ref, wp_ref, hq_ref, wq_ref, j, **kw)
  lp, lq = zp - lse_p_ref[...], zq - lse_q_ref[...]
  dl = g_ref[...] * jnp.exp(lp) * (lp - lq - kl_ref[...])
  return jnp.where(cols < kw["vocab"], dl, 0.0) * dz


def _bwd_dh_kernel(hp_ref, wp_ref, hq_ref, wq_ref, *rows_and_out, **kw):
  *rows, dh_ref, acc_ref = rows_and_out
  j = pl.program_id(1)
  dl = _dlogits(hp_ref, wp_ref, hq_ref, wq_ref, *rows, j, **kw)
  _accumulate(dh_ref, acc_ref, j, pl.num_programs(1), _contract(dl.astype(wp_ref.dtype), wp_ref[...], ((1,), (1,))))


def _bwd_dw_kernel(hp_ref, wp_ref, hq_ref, wq_ref, *rows_and_out, **kw):
  *rows, dw_ref, acc_ref = rows_and_out
  dl = _dlogits(hp_ref, wp_ref, hq_ref, wq_ref, *rows, pl.program_id(0), **kw)
  _accumulate(dw_ref, acc_ref, pl.program_id(1), pl.num_programs(1),
              _contract(hp_ref[...], dl.astype(hp_ref.dtype), ((0,), (0,))))


def _specs(bt, bv, dp, eq, swap: bool):
  """Block specs of (h_p, W_p, h_q, W_q, then [N, 1] rows); `swap` puts the vocabulary block on grid axis 0."""
  tok = (lambda j, i: (i, 0)) if swap else (lambda i, j: (i, 0))
  voc = (lambda j, i: (0, j)) if swap else (lambda i, j: (0, j))
  return ([pl.BlockSpec((bt, dp), tok), pl.BlockSpec((dp, bv), voc), pl.BlockSpec((bt, eq), tok),
           pl.BlockSpec((eq, bv), voc)], pl.BlockSpec((bt, 1), tok))


def _call(kernel, grid, in_specs, out_specs, out_shape, static, *args, scratch=()):
  vocab, temperature, softcap, (bt, bv), vmem, interpret, name = static
  return pl.pallas_call(
      functools.partial(kernel, vocab=vocab, temperature=temperature, softcap=softcap), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, scratch_shapes=list(scratch),
      compiler_params=_compiler_params("tpu", ("parallel", "arbitrary"), vmem), interpret=interpret,
      name=name)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kl(hp, wp, hq, wq, static):
  return _forward(hp, wp, hq, wq, static)[0]


def _forward(hp, wp, hq, wq, static):
  bt, bv = static[3]
  n_p, dp, eq = hp.shape[0], hp.shape[1], hq.shape[1]
  ins, row = _specs(bt, bv, dp, eq, swap=False)
  stat = jax.ShapeDtypeStruct((n_p, 1), jnp.float32)
  mp, sp, acc, mq, sq = _call(_fwd_kernel, (n_p // bt, wp.shape[1] // bv), ins, [row] * 5, [stat] * 5,
                              (*static, "full_kl_fwd_tpu"), hp, wp, hq, wq)
  lse_p, lse_q = mp + jnp.log(sp), mq + jnp.log(sq)
  kl = acc / sp - lse_p + lse_q
  return kl, lse_p, lse_q


def _fwd(hp, wp, hq, wq, static):
  kl, lse_p, lse_q = _forward(hp, wp, hq, wq, static)
  return kl, (hp, wp, hq, wq, lse_p, lse_q, kl)


def _bwd(static, res, g_kl):
  from jax.experimental.pallas import tpu as pltpu
  hp, wp, hq, wq, lse_p, lse_q, kl = res
  bt, bv = static[3]
  n_p, dp, eq, vp = hp.shape[0], hp.shape[1], hq.shape[1], wp.shape[1]
  rows = (lse_p, lse_q, kl, g_kl)
  ins, row = _specs(bt, bv, dp, eq, swap=False)
  dh = _call(_bwd_dh_kernel, (n_p // bt, vp // bv), ins + [row] * 4, pl.BlockSpec((bt, dp), lambda i, j: (i, 0)),
             jax.ShapeDtypeStruct((n_p, dp), hp.dtype), (*static, "full_kl_bwd_dh_tpu"), hp, wp, hq, wq,
             *rows, scratch=[pltpu.VMEM((bt, dp), jnp.float32)])
  ins, row = _specs(bt, bv, dp, eq, swap=True)
  dw = _call(_bwd_dw_kernel, (vp // bv, n_p // bt), ins + [row] * 4, pl.BlockSpec((dp, bv), lambda j, i: (0, j)),
             jax.ShapeDtypeStruct((dp, vp), wp.dtype), (*static, "full_kl_bwd_dw_tpu"), hp, wp, hq, wq,
             *rows, scratch=[pltpu.VMEM((dp, bv), jnp.float32)])
  return dh, dw, jnp.zeros_like(hq), jnp.zeros_like(wq)


_kl.defvjp(_fwd, _bwd)


def full_kl_pallas_tpu(hp_NxD, wp_DxV, hq_NxE, wq_ExV, *, temperature: float = 1.0, softcap: float | None = None,
                       blocks: tuple[int, int] | None = None, interpret=False):
  """kl_N in fp32; inputs zero-padded to whole tiles (padded vocabulary columns masked). `blocks`: (tokens, vocab)."""
  bt, bv = blocks or DEFAULT_BLOCKS
  n, d = hp_NxD.shape
  e, vocab = hq_NxE.shape[1], wp_DxV.shape[1]
  itemsize = hp_NxD.dtype.itemsize
  if not blocks:  # both models' weight blocks share VMEM: narrow the vocabulary block for wide models
    while bv > 128 and tpu_vmem_bytes(bt, bv, d + e, itemsize) > TPU_SCOPED_VMEM:
      bv //= 2
  bt, bv = min(bt, _round_up(n, 8)), min(bv, _round_up(vocab, 128))
  n_p, vp = _round_up(n, bt), _round_up(vocab, bv)
  hp, hq = _pad(hp_NxD, n_p, d), _pad(hq_NxE.astype(hp_NxD.dtype), n_p, e)
  wp, wq = _pad(wp_DxV.astype(hp_NxD.dtype), d, vp), _pad(wq_ExV.astype(hp_NxD.dtype), e, vp)
  static = (vocab, float(temperature), None if softcap is None else float(softcap), (bt, bv),
            tpu_vmem_bytes(bt, bv, d + e, itemsize), interpret)
  return _kl(hp, wp, hq, wq, static)[:n, 0]
