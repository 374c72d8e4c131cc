"""kernels.attention: every impl against a NumPy softmax-attention reference (value) and against autodiff of the
dense form (gradient), with GQA, left padding, packed segments, windows, soft-capping and ragged block edges (splash
in Pallas' interpret mode); compiled for a TPU, the memory of the long-context forms."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jalign.kernels import attention

B, T, N, K, H = 3, 37, 4, 2, 8


def numpy_attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal, window, softcap, scale, sinks=None):
  """softmax(cap(q k^T * scale) + mask) v per (batch, head), in float64; rows with no key give 0. `sinks` [N]: each
  head's logit joins the softmax's denominator (gpt-oss; transformers' eager attention: a column dropped after the
  softmax)."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  out = np.zeros((b, t, n, h))
  for bi in range(b):
    allowed = (q_seg[bi][:, None] == kv_seg[bi][None, :]) & (kv_seg[bi][None, :] != 0)
    behind = q_pos[bi][:, None] - kv_pos[bi][None, :]
    if causal:
      allowed &= behind >= 0
    if window:
      allowed &= behind < window
    for hi in range(n):
      s = q[bi, :, hi].astype(np.float64) @ k[bi, :, hi // g].astype(np.float64).T * scale
      if softcap:
        s = np.tanh(s / softcap) * softcap
      s = np.where(allowed, s, -np.inf)
      top = np.max(s, axis=-1, keepdims=True)
      if sinks is not None:
        top = np.maximum(top, sinks[hi])
      p = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
      den = p.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[hi] - top))
      out[bi, :, hi] = (p / np.where(den == 0, 1, den)) @ v[bi, :, hi // g]
  return out


def packed_batch(seed=0, t=T):
  """Row 0 left-padded by 5; row 1 three packed sequences then padding; row 2 one full sequence."""
  rng = np.random.default_rng(seed)
  seg = np.ones((B, t), np.int32)
  seg[0, :5] = 0
  seg[1, :15], seg[1, 15:30], seg[1, 30:34], seg[1, 34:] = 1, 2, 3, 0
  pos = np.zeros((B, t), np.int32)
  for b in range(B):
    for s in set(seg[b].tolist()) - {0}:
      idx = np.where(seg[b] == s)[0]
      pos[b, idx] = np.arange(len(idx))
  q = rng.normal(size=(B, t, N, H)).astype(np.float32)
  k, v = (rng.normal(size=(B, t, K, H)).astype(np.float32) for _ in range(2))
  return q, k, v, seg, pos


CASES = {
    "causal": dict(),
    "window": dict(sliding_window=4),
    "softcap": dict(softcap=2.0),
    "window_softcap": dict(sliding_window=6, softcap=3.0),
    "bidirectional": dict(causal=False),
}


@pytest.mark.parametrize("impl", ["xla", "chunked", "splash"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_value_matches_numpy_and_gradient_matches_dense(impl, case):
  kw = CASES[case]
  q, k, v, seg, pos = packed_batch()
  masks = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), q_positions=jnp.asarray(pos),
               kv_positions=jnp.asarray(pos))
  valid = (seg != 0)[:, :, None, None]
  # Blocks of 8 x 16: T = 37 is not a multiple of either, and causality, windows and segments leave dead pairs.
  # splash runs interpreted, over slot indices (equal to the positions' order inside each packed sequence).
  run = lambda impl, q, k, v: attention(q, k, v, impl=impl, blocks=(8, 16), scale=0.3, interpret=True,  # noqa: E731
                                        **masks, **kw)
  got = np.asarray(run(impl, q, k, v))
  want = numpy_attention(q, k, v, seg, seg, pos, pos, causal=kw.get("causal", True),
                         window=kw.get("sliding_window"), softcap=kw.get("softcap"), scale=0.3)
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)
  assert np.isfinite(got).all()  # padding rows too
  w = np.random.default_rng(1).normal(size=got.shape).astype(np.float32) * valid
  loss = lambda impl: (lambda q, k, v: jnp.sum(run(impl, q, k, v) * w))  # noqa: E731
  grads = jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
  dense = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
  for name, g, d in zip("qkv", grads, dense):
    np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5 * np.abs(d).max(), err_msg=name)


def test_sinks_match_numpy_and_the_chunked_gradient_matches_dense():
  """gpt-oss's sinks (a logit per head in each softmax's denominator) with GQA, packing, padding and a window:
  `xla` and `chunked` equal NumPy; chunked's own backward (the sinks' gradient included) equals autodiff of the
  dense form; the kernels without sinks refuse them by name."""
  q, k, v, seg, pos = packed_batch()
  sinks = np.random.default_rng(2).normal(size=N).astype(np.float32) * 2
  masks = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), q_positions=jnp.asarray(pos),
               kv_positions=jnp.asarray(pos), sliding_window=6)
  valid = (seg != 0)[:, :, None, None]
  run = lambda impl, q, k, v, s: attention(q, k, v, impl=impl, blocks=(8, 16), scale=0.3, sinks=s,  # noqa: E731
                                           **masks)
  want = numpy_attention(q, k, v, seg, seg, pos, pos, causal=True, window=6, softcap=None, scale=0.3, sinks=sinks)
  w = np.random.default_rng(1).normal(size=want.shape).astype(np.float32) * valid
  grads = {}
  for impl in ("xla", "chunked"):
    got = np.asarray(run(impl, q, k, v, sinks))
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)
    grads[impl] = jax.grad(lambda *a: jnp.sum(run(impl, *a) * w), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for name, g, d in zip(["q", "k", "v", "sinks"], grads["chunked"], grads["xla"]):
    np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5 * np.abs(d).max(), err_msg=name)
  assert np.abs(grads["xla"][3]).min() > 0
  for impl in ("splash", "cudnn"):
    with pytest.raises(ValueError, match=f"attention impl '{impl}' has no sinks; use 'chunked' or 'xla'"):
      run(impl, q, k, v, sinks)


@pytest.mark.parametrize("case", ["causal", "window", "bidirectional"])
def test_cudnn_call_matches_numpy(case):
  """The `cudnn` impl's call to `jax.nn.dot_product_attention`, evaluated by that API's XLA implementation (the
  same arguments cuDNN gets on a GPU): padding's own segment, the window as cuDNN's left window."""
  from jalign.kernels.attn import cudnn_attention
  kw = CASES[case]
  q, k, v, seg, pos = packed_batch(5)
  got = cudnn_attention(q, k, v, jnp.asarray(seg), jnp.asarray(seg), causal=kw.get("causal", True),
                        window=kw.get("sliding_window"), softcap=None, scale=0.3, implementation="xla")
  want = numpy_attention(q, k, v, seg, seg, pos, pos, causal=kw.get("causal", True),
                         window=kw.get("sliding_window"), softcap=None, scale=0.3)
  valid = (seg != 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()
  with pytest.raises(ValueError, match="needs a GPU target"):
    attention(q, k, v, impl="cudnn")
  with pytest.raises(ValueError, match="without a soft-cap"):
    cudnn_attention(q, k, v, jnp.asarray(seg), jnp.asarray(seg), causal=True, window=None, softcap=2.0, scale=0.3)


def test_queries_at_an_offset_into_longer_keys():
  """Cross shapes (S != T): the last T positions of an S-token sequence, as a prefill after a cached prefix."""
  rng = np.random.default_rng(2)
  s, t = 29, 11
  q = rng.normal(size=(2, t, N, H)).astype(np.float32)
  k, v = (rng.normal(size=(2, s, K, H)).astype(np.float32) for _ in range(2))
  kv_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (2, s))
  q_pos = kv_pos[:, s - t:]
  ones = lambda n: np.ones((2, n), np.int32)  # noqa: E731
  want = numpy_attention(q, k, v, ones(t), ones(s), q_pos, kv_pos, causal=True, window=None, softcap=None,
                         scale=H ** -0.5)
  for impl in ("xla", "chunked"):
    got = attention(q, k, v, q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos), impl=impl,
                    blocks=(4, 8))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


def test_bf16_chunked_close_to_dense():
  """bf16 inputs: both accumulate in fp32; they differ by the rounding of probabilities to bf16 before P @ V
  (dense: normalised; chunked: unnormalised, divided at the end). Stated bound: 2e-2 of the output's scale."""
  q, k, v, seg, pos = packed_batch(3)
  masks = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), q_positions=jnp.asarray(pos),
               kv_positions=jnp.asarray(pos))
  cast = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  outs = [attention(cast(q), cast(k), cast(v), impl=impl, blocks=(8, 8), **masks).astype(jnp.float32)
          for impl in ("xla", "chunked")]
  valid = (seg != 0)[:, :, None, None]
  assert float(jnp.max(jnp.abs(jnp.where(valid, outs[0] - outs[1], 0)))) <= 2e-2 * float(jnp.max(jnp.abs(outs[0])))
  assert outs[1].dtype == jnp.float32 and attention(cast(q), cast(k), cast(v), impl="chunked").dtype == jnp.bfloat16


def test_traced_window_under_scan():
  """Per-layer windows arrive as a scanned scalar (Gemma's alternating layers); 0 means no window."""
  q, k, v, seg, pos = packed_batch(4)

  def body(carry, window):
    return carry, attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, sliding_window=window, impl="chunked",
                            blocks=(8, 8))

  _, outs = jax.lax.scan(body, 0, jnp.asarray([0, 5], jnp.int32))
  for out, window in zip(outs, (0, 5)):
    want = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, sliding_window=window, impl="xla")
    valid = (seg != 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)


def test_chunked_memory_is_linear_in_length():
  """XLA's compiled temporaries for value + gradient: `chunked` grows ~linearly with T (blocks of 256), `xla`
  quadratically (its [B, N, T, T] scores)."""
  def temp(impl, t):
    q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, impl=impl)), argnums=(0, 1, 2)))
    return step.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

  chunked = temp("chunked", 1024), temp("chunked", 4096)
  dense = temp("xla", 1024), temp("xla", 4096)
  assert chunked[1] / chunked[0] < 5, chunked
  assert dense[1] / dense[0] > 12, dense
  assert chunked[1] < dense[1] / 20, (chunked, dense)


def test_bad_impl_and_shapes_are_named():
  q = jnp.zeros((1, 4, 4, 8))
  kv = jnp.zeros((1, 4, 3, 8))
  with pytest.raises(ValueError, match="available: xla, chunked, splash, cudnn, auto"):
    attention(q, q, q, impl="flash")
  with pytest.raises(ValueError, match="K dividing N"):
    attention(q, kv, kv)
  with pytest.raises(ValueError, match="'splash' needs a TPU target .*interpret=True"):
    attention(q, q, q, impl="splash")


def _tpu_compile(impl, t, heads=8, head_dim=128):
  """value + gradient of attention over one bf16 sequence of `t` tokens, compiled for one TPU v5e chip."""
  from jalign.parallel import tpu_target
  mesh = tpu_target.chip_mesh("v5e:2x2")
  sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, P()))  # noqa: E731
  q, seg = sd((1, t, heads, head_dim), jnp.bfloat16), sd((1, t), jnp.int32)

  def loss(q, k, v, s):
    return jnp.sum(attention(q, k, v, q_segment_ids=s, kv_segment_ids=s, impl=impl).astype(jnp.float32))

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, seg).compile()


def test_long_context_forms_compiled_for_a_tpu_stay_small():
  """TPU v5e compile, fwd + bwd, 8 heads of 128: at T = 32768 `splash` and `chunked` need <= 1% of the
  temporaries of the dense form at T = 8192 scaled by 16 (what it would need at 32768), and `auto` picks splash
  (a Mosaic custom call in the compiled program)."""
  dense_32k = 16 * _tpu_compile("xla", 8192).memory_analysis().temp_size_in_bytes
  assert dense_32k > 16 * 2**30  # the [8, T, T] fp32 scores alone are 2 GiB at 8192
  for impl in ("splash", "chunked"):
    temp = _tpu_compile(impl, 32768).memory_analysis().temp_size_in_bytes
    assert temp <= 0.01 * dense_32k, (impl, temp, dense_32k)
  assert "tpu_custom_call" in _tpu_compile("auto", 1024).as_text()
  assert "tpu_custom_call" not in _tpu_compile("chunked", 1024).as_text()


def test_chunked_keeps_no_block_scores_inside_a_scan_of_layers():
  """The gradient of `chunked` inside a `lax.scan` (a scanned decoder's layers) needs about the memory of one
  layer's: no [T/bq, S/bk] stack of block scores kept for the backward (its custom backward recomputes them).
  Compiled for the CPU, T = 2048 in blocks of 256: such a stack would be 64 blocks x 1 MiB of fp32 scores."""
  t = 2048
  q = jnp.ones((1, t, 4, 16), jnp.float32)
  kv = jnp.ones((1, t, 2, 16), jnp.float32)
  attend = lambda q: attention(q, kv, kv, impl="chunked", blocks=(256, 256))  # noqa: E731

  def temp(layers):
    def loss(q):
      out, _ = jax.lax.scan(lambda x, _: (attend(x), None), q, None, length=layers)
      return out.sum()
    return jax.jit(jax.grad(loss)).lower(q).compile().memory_analysis().temp_size_in_bytes

  one, four = temp(1), temp(4)
  assert four < one + 4 * q.nbytes * 3, (one, four)  # each more layer keeps its input, output and softmax stats
  assert four < 16 * 2**20, four
