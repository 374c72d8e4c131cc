"""kernels.context: ring and all-gather attention over a `sequence` mesh axis (fake devices) against the NumPy
softmax-attention reference (value) and autodiff of the dense `xla` form on one device (gradient), fp32 1e-5: GQA,
packing, left padding, windows, soft-caps, sinks, a length the shards do not divide, the zig-zag layout, heads split
over `tensor` and rows over `data`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.kernels import attention
from jalign.kernels.context import context_attention, inverse, pick_form, zigzag
from tests.kernels.test_attention import numpy_attention

N, K, H = 4, 2, 8


def batch(t, seed=0):
  """Four rows: left padding; three packed sequences then padding; one full sequence; two halves."""
  rng = np.random.default_rng(seed)
  seg = np.ones((4, t), np.int32)
  seg[0, :5] = 0
  seg[1, :15], seg[1, 15:30], seg[1, 30:34], seg[1, 34:] = 1, 2, 3, 0
  seg[3, t // 2:] = 2
  pos = np.zeros_like(seg)
  for b in range(4):
    for s in set(seg[b].tolist()) - {0}:
      idx = np.where(seg[b] == s)[0]
      pos[b, idx] = np.arange(len(idx))
  q = rng.normal(size=(4, t, N, H)).astype(np.float32)
  k, v = (rng.normal(size=(4, t, K, H)).astype(np.float32) for _ in range(2))
  return q, k, v, seg, pos


CASES = {  # (attention keywords, sinks, zig-zag layout); 37 tokens do not split over 4 shards, 40 do in zig-zag
    "causal_zigzag": (dict(), False, True),
    "window_softcap": (dict(sliding_window=6, softcap=3.0), False, False),
    "bidirectional": (dict(causal=False), False, False),
    "sinks_window_zigzag": (dict(sliding_window=9), True, True),
}


def check(mesh_shape, axes, form, case, blocks=(4, 8), rows=4):
  kw, with_sinks, zig = CASES[case]
  t = 40 if zig else 37
  q, k, v, seg, pos = (a[:rows] for a in batch(t))
  sinks = np.random.default_rng(2).normal(size=N).astype(np.float32) * 2 if with_sinks else None
  valid = (seg != 0)[:, :, None, None]
  w = np.random.default_rng(1).normal(size=q.shape).astype(np.float32) * valid
  shards = dict(zip(axes, mesh_shape))["sequence"]
  order = zigzag(t, shards) if zig else np.arange(t)
  lay = lambda a: a[:, order]  # noqa: E731

  def sharded(q, k, v, s):
    out = context_attention(lay(q), lay(k), lay(v), *(jnp.asarray(lay(a)) for a in (seg, seg, pos, pos)),
                            scale=0.3, sinks=s, form=form, blocks=blocks, **kw)
    return out[:, inverse(order)]

  dense = lambda q, k, v, s: attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,  # noqa: E731
                                       kv_positions=pos, scale=0.3, sinks=s, impl="xla", **kw)
  argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
  auto = (jax.sharding.AxisType.Auto,) * len(axes)
  with jax.set_mesh(jax.make_mesh(mesh_shape, axes, axis_types=auto)):
    got = np.asarray(jax.jit(sharded)(q, k, v, sinks))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a) * w), argnums=argnums))(q, k, v, sinks)
  want = numpy_attention(q, k, v, seg, seg, pos, pos, causal=kw.get("causal", True),
                         window=kw.get("sliding_window"), softcap=kw.get("softcap"), scale=0.3, sinks=sinks)
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)
  assert np.isfinite(got).all()
  reference = jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=argnums)(q, k, v, sinks)
  for name, g, d in zip(["q", "k", "v", "sinks"], grads, reference):
    np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5 * np.abs(d).max(), err_msg=name)


@pytest.mark.parametrize("form", ["ring", "gather"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sequence_sharded_attention_equals_the_reference(form, case):
  """Four sequence shards and two of rows; blocks of 4 x 8 so that each shard holds several blocks."""
  check((2, 4), ("data", "sequence"), form, case)


def test_heads_split_over_tensor_beside_the_sequence():
  check((2, 2, 2), ("data", "sequence", "tensor"), "ring", "sinks_window_zigzag")


@pytest.mark.parametrize("form", ["ring", "gather"])
def test_rows_the_data_axis_does_not_divide_stay_whole(form):
  """Three rows over two data shards: every data shard holds all rows (and must not count their gradients twice)."""
  check((2, 4), ("data", "sequence"), form, "sinks_window_zigzag", rows=3)


def test_auto_gathers_only_what_the_local_queries_outweigh():
  assert pick_form("auto", 2, 32, 8) == "gather"      # Llama-3-8B on 2 shards: 2 x 8 x 2 <= 32
  assert pick_form("auto", 4, 32, 8) == "ring"
  assert pick_form("auto", 2, 16, 16) == "ring"       # multi-head attention
  with pytest.raises(ValueError, match="context attention form 'ulysses'; available: ring, gather, auto"):
    pick_form("ulysses", 2, 8, 8)


def test_zigzag_gives_every_shard_the_same_causal_work():
  t, shards = 64, 4
  order = zigzag(t, shards)
  assert sorted(order) == list(range(t)) and (order[inverse(order)] == np.arange(t)).all()
  work = [int(np.sum(order[d * 16:(d + 1) * 16] + 1)) for d in range(shards)]  # keys each query attends to
  assert len(set(work)) == 1, work
  contiguous = [int(np.sum(np.arange(d * 16, (d + 1) * 16) + 1)) for d in range(shards)]
  assert contiguous[-1] > 6 * contiguous[0]
  with pytest.raises(ValueError, match=r"zigzag: the sequence length \(60\) must be a multiple of twice the shards"):
    zigzag(60, 4)
