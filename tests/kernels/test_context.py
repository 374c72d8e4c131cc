"""kernels.context: ring and all-gather attention over a `sequence` mesh axis (fake devices) against the NumPy
softmax-attention reference (value) and autodiff of the dense `xla` form on one device (gradient), fp32 1e-5: GQA,
packing, left padding, windows, soft-caps, sinks, a length the shards do not divide, the zig-zag layout, heads split
over `tensor` and rows over `data`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.kernels import attention
from jalign.kernels.context import context_attention, pick_form
from jalign.kernels.zigzag import inverse, zigzag
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


def _splash_blocks(q, k, v, seg, form, shards, softcap):
  """`context_attention` asked for splash blocks (interpreted), the tokens laid out in zig-zag order and put back."""
  order = zigzag(q.shape[1], shards)
  lay = lambda a: a[:, order]  # noqa: E731
  slots = np.broadcast_to(np.arange(q.shape[1], dtype=np.int32), seg.shape)
  out = context_attention(lay(q), lay(k), lay(v), *(jnp.asarray(lay(a)) for a in (seg, seg, slots, slots)),
                          scale=0.3, softcap=softcap, form=form, splash=True, zigzag=True, interpret=True)
  return out[:, inverse(order)]


@pytest.mark.parametrize("form,shards,softcap", [("ring", 4, None), ("ring", 4, 3.0), ("gather", 2, 3.0)])
def test_context_attention_with_splash_blocks_equals_the_reference(form, shards, softcap, monkeypatch):
  """Splash's kernels (Pallas interpret mode) inside the ring (4 shards: its own, earlier and later shards' masks
  and the hops between) and the all-gather form (2 shards), tokens in zig-zag order in chunks of 128 and rows over
  the data axis: the value equals NumPy's softmax attention and the gradient autodiff of the dense form (fp32 1e-5)
  with GQA, packing, left padding, soft-caps; the splash kernels were built, so that path ran."""
  from jalign.kernels import ring_splash
  built = []
  kernels = ring_splash._kernels
  monkeypatch.setattr(ring_splash, "_kernels", lambda *a: built.append(a) or kernels(*a))
  t = 2 * shards * 128
  rows = 8 // shards
  q, k, v, seg, pos = (a[:rows] for a in batch(t))
  valid = (seg != 0)[:, :, None, None]
  w = np.random.default_rng(1).normal(size=q.shape).astype(np.float32) * valid
  mesh = jax.make_mesh((rows, shards), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  run = lambda q, k, v: _splash_blocks(q, k, v, seg, form, shards, softcap)  # noqa: E731
  with jax.set_mesh(mesh):
    got = np.asarray(jax.jit(run)(q, k, v))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) * w), argnums=(0, 1, 2)))(q, k, v)
  assert len(built) == 3  # the value's forward, the gradient's forward and backward
  want = numpy_attention(q, k, v, seg, seg, pos, pos, causal=True, window=None, softcap=softcap, scale=0.3)
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)
  assert np.isfinite(got).all()
  dense = lambda q, k, v: attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,  # noqa: E731
                                    kv_positions=pos, scale=0.3, softcap=softcap, impl="xla")
  reference = jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2))(q, k, v)
  for name, g, d in zip("qkv", grads, reference):
    np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5 * np.abs(d).max(), err_msg=name)


@pytest.mark.parametrize("shards,form", [(4, "ring"), (2, "gather")])
def test_splash_blocks_compiled_for_a_tpu_slice(shards, form, monkeypatch):
  """Compiled for chips of a v5e-4 slice with the sequence over them (8192 bf16 tokens, 8 query heads and 2 key/value
  heads of 128, value and gradient through `attention(impl="auto")` as the decoder calls it): `auto` takes the
  ring over 4 chips and the all-gather over 2; splash's Mosaic kernels run in either (the ring's keys travel by
  collective permutes), and each chip's temporaries stay under 64 MiB, where one [T/4, T] fp32 score tensor of a head
  would be 64 MiB alone."""
  from jalign.kernels import ring_splash
  from jalign.models import make_mesh
  from jalign.parallel import tpu_target
  forms = []
  kernels = ring_splash._kernels
  monkeypatch.setattr(ring_splash, "_kernels", lambda *a: forms.append(a[2].form) or kernels(*a))
  mesh = make_mesh((1, 1, 1, 1, shards), tpu_target.target("v5e-4").devices[:shards])
  t = 8192
  sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, jax.P()))  # noqa: E731
  q, kv, seg = sd((1, t, 8, 128), jnp.bfloat16), sd((1, t, 2, 128), jnp.bfloat16), sd((1, t), jnp.int32)

  def loss(q, k, v, s):
    out = attention(q, k, v, q_segment_ids=s, kv_segment_ids=s, q_positions=s, kv_positions=s, impl="auto",
                    zigzag=True)
    return jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
  assert set(forms) == {form}
  text = compiled.as_text()
  assert "tpu_custom_call" in text and ("collective-permute" in text) == (form == "ring")
  assert tpu_target.temporaries(compiled.memory_analysis()) < 64 * 2**20
