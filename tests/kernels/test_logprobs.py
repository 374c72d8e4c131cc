"""token_logprobs: every implementation against a NumPy formula and its gradients against autodiff of the plain
formula (the Pallas kernels in interpret mode), the vocabulary-sharded path against the unsharded one, and the
chunked version's memory (XLA's own buffer accounting) against the materialised one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jalign.kernels import LogprobOptions, token_logprobs
from jalign.models.sharding import make_mesh

# Small tiles so every kernel walks several vocabulary blocks (101 = 3 x 32 + 5: a ragged last block), several token
# blocks (21 = 16 + 5) and, on GPU, several model-dim slices (24 = 3 x 8).
IMPL_KW = {"xla": {}, "chunked": dict(chunk=16), "pallas_gpu": dict(blocks=(16, 32, 8), interpret=True),
           "pallas_tpu": dict(blocks=(16, 32, 0), interpret=True)}
FORMS = [dict(), dict(temperature=0.6), dict(softcap=1.5)]


def np_reference(h, w, y, temperature=1.0, softcap=None):
  z = h.astype(np.float64) @ w.astype(np.float64)
  if softcap:
    z = np.tanh(z / softcap) * softcap
  z = z / temperature
  lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
  logp = z - lse[..., None]
  return (np.take_along_axis(logp, y[..., None], -1)[..., 0], -np.sum(np.exp(logp) * logp, -1), lse)


def _data(seed=0, n=(3, 7), d=24, v=101):
  rng = np.random.RandomState(seed)
  return (rng.randn(*n, d).astype(np.float32), (rng.randn(d, v) * 0.4).astype(np.float32),
          rng.randint(0, v, n))


def _masked(seed=0, **kw):
  """Data with a few masked positions whose targets are HF's -100 padding."""
  h, w, y = _data(seed, **kw)
  mask = np.ones(y.shape, np.int32)
  mask[0, -2:] = mask[2, 0] = 0
  return h, w, np.where(mask == 1, y, -100), mask


@pytest.mark.parametrize("impl", list(IMPL_KW))
@pytest.mark.parametrize("kw", FORMS)
def test_values_match_numpy(impl, kw):
  h, w, y, mask = _masked()
  got = token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), mask_T=jnp.asarray(mask), impl=impl,
                       **IMPL_KW[impl], **kw)
  for g, want in zip(got, np_reference(h, w, np.where(mask == 1, y, 0), **kw)):
    np.testing.assert_allclose(np.asarray(g), want * mask, atol=2e-5, rtol=1e-5)


def _weighted_sum(impl, y, mask, **kw):
  weights = (1.0, -0.3, 0.2)  # exercise the gradients of all three outputs
  return lambda h, w: sum(jnp.sum(o * c) for o, c in zip(token_logprobs(h, w, y, mask_T=mask, impl=impl, **kw),
                                                        weights))


@pytest.mark.parametrize("impl", ["chunked", "pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("kw", FORMS)
def test_gradients_equal_autodiff_of_the_formula(impl, kw):
  h, w, y, mask = (jnp.asarray(a) for a in _masked(1))
  want = jax.grad(_weighted_sum("xla", y, mask, **kw), argnums=(0, 1))(h, w)
  got = jax.grad(_weighted_sum(impl, y, mask, **IMPL_KW[impl], **kw), argnums=(0, 1))(h, w)
  for g, t in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(t), atol=1e-5 * float(jnp.max(jnp.abs(t))), rtol=1e-5)
  assert float(jnp.max(jnp.abs(got[0][0, -2:]))) == 0.0  # masked rows get no gradient


@pytest.mark.parametrize("impl", list(IMPL_KW))
def test_bf16_inputs_accumulate_in_fp32(impl):
  """bf16 hidden and unembedding: outputs in fp32, within 2e-2 of the fp64 formula on the same bf16 values (the
  logits tiles are fp32; only the inputs are rounded); gradients within 2% of the largest entry of xla's."""
  h, w, y = _data(2)
  hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  got = token_logprobs(hb, wb, jnp.asarray(y), impl=impl, **IMPL_KW[impl])
  want = np_reference(np.asarray(hb, np.float32), np.asarray(wb, np.float32), y)
  assert got[0].dtype == jnp.float32
  for g, t in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), t, atol=2e-2)
  mask = jnp.ones(y.shape)
  ref = jax.grad(_weighted_sum("xla", jnp.asarray(y), mask), argnums=(0, 1))(hb, wb)
  grads = jax.grad(_weighted_sum(impl, jnp.asarray(y), mask, **IMPL_KW[impl]), argnums=(0, 1))(hb, wb)
  for g, t in zip(grads, ref):
    assert g.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(t.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(t, np.float32), atol=2e-2 * scale)


@pytest.mark.parametrize("impl", list(IMPL_KW))
def test_vocabulary_sharded_over_tensor_equals_unsharded(impl):
  """A (2, 1, 4) mesh with the unembedding's vocabulary split four ways: each shard works on its 26 columns and the
  shards combine their statistics; values and gradients equal the unsharded formula, and for xla / chunked the
  compiled step never gathers the vocabulary."""
  h, w, y, mask = (jnp.asarray(a) for a in _masked(3, n=(4, 6), v=104))
  want = jax.value_and_grad(_weighted_sum("xla", y, mask), argnums=(0, 1))(h, w)
  mesh = make_mesh((2, 1, 4))
  with jax.set_mesh(mesh):
    hs = jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp"))))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
    f = jax.jit(jax.value_and_grad(_weighted_sum(impl, y, mask, **IMPL_KW[impl]), argnums=(0, 1)))
    got = f(hs, ws)
    if impl in ("xla", "chunked"):
      assert "all-gather" not in f.lower(hs, ws).compile().as_text()
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
  for g, t in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(t), atol=1e-5 * float(jnp.max(jnp.abs(t))), rtol=1e-5)


def test_chunked_never_materialises_the_logits():
  """XLA's buffer accounting: the reference holds [N, V] logits; the chunked version's scratch scales with the chunk
  ([N, chunk] tiles plus the [D, V] weight gradient), not with N x V."""
  n, d, v = 1024, 64, 32768
  h, w = jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32)
  y = jnp.zeros((n,), jnp.int32)

  def temp_bytes(impl, chunk=2048):
    f = jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(token_logprobs(h, w, y, impl=impl, chunk=chunk)[0]),
                                   argnums=(0, 1)))
    return f.lower(h, w).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = n * v * 4
  assert temp_bytes("xla") >= logits_bytes
  big, small = temp_bytes("chunked", 2048), temp_bytes("chunked", 512)
  assert big < logits_bytes / 2, big
  assert small < big / 2, (small, big)


def test_unknown_impl():
  h, w, y = _data()
  with pytest.raises(ValueError, match="available: xla, chunked, pallas_gpu, pallas_tpu, auto"):
    token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), impl="pallas")
  with pytest.raises(ValueError, match="needs a GPU target .*interpret=True"):
    token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), impl="pallas_gpu")
  with pytest.raises(ValueError, match="blocks=.*tokens, vocab, model-dim"):
    token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), impl="pallas_tpu", blocks=(8, 8), interpret=True)


def test_dpo_and_grpo_steps_agree_across_impls():
  """Whole objectives: loss and gradients through `chunked` (vocabulary 288 in chunks of 100) and the Pallas kernels
  (interpret mode, tiles of 96 columns) equal `xla`."""
  from flax import nnx

  from jalign import models
  from jalign.objectives import dpo, grpo
  from jalign.rl.batch import RolloutBatch

  cfg = models.ModelConfig(vocab_size=288, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16)
  graphdef, state = nnx.split(models.create(cfg, seed=0))
  params = nnx.to_pure_dict(state)
  rng = np.random.RandomState(0)
  b, length = 4, 12
  real = (np.arange(length)[None, None] < rng.randint(6, length + 1, (b, 2, 1))).astype(np.int32)
  pairs = {"tokens": rng.randint(0, 288, (b, 2, length)).astype(np.int32) * real, "segment_ids": real,
           "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (b, 2, length)) * real,
           "loss_mask": real * (np.arange(length) >= 4), "ref_chosen_logps": rng.randn(b).astype(np.float32) - 20,
           "ref_rejected_logps": rng.randn(b).astype(np.float32) - 20}
  n, p, r = 4, 8, 6
  seq = {"tokens": rng.randint(1, 288, (n, p + r)).astype(np.int32), "segment_ids": np.ones((n, p + r), np.int32),
         "positions": np.broadcast_to(np.arange(p + r, dtype=np.int32), (n, p + r)),
         "response_mask": (np.arange(r)[None] < rng.randint(1, r + 1, (n, 1))).astype(np.int32),
         "advantages": rng.randn(n, r).astype(np.float32), "old_logp": -rng.rand(n, r).astype(np.float32) * 5,
         "ref_logp": -rng.rand(n, r).astype(np.float32) * 5}
  seq = RolloutBatch(response=seq["tokens"][:, p:], **seq)
  opts = lambda impl: LogprobOptions(impl=impl, chunk=100, interpret=impl.startswith("pallas"),  # noqa: E731
                                     blocks=(32, 96, 16) if impl.startswith("pallas") else ())
  cases = [(lambda impl: dpo.make_loss_fn(graphdef, dpo.DpoLossConfig(rpo_alpha=0.5), logprobs=opts(impl)), pairs),
           (lambda impl: grpo.make_loss_fn(graphdef, grpo.GrpoLossConfig(), opts(impl)), seq)]
  for make, batch in cases:
    batch = jax.tree.map(jnp.asarray, batch)
    out = {}
    for impl in ("xla", "chunked", "pallas_gpu", "pallas_tpu"):
      fn = make(impl)
      out[impl] = jax.jit(jax.value_and_grad(lambda prm: fn(prm, batch)[0]))(params)  # op by op: minutes
    for impl in ("chunked", "pallas_gpu", "pallas_tpu"):
      np.testing.assert_allclose(out[impl][0], out["xla"][0], rtol=1e-5)
      for g1, g2 in zip(jax.tree.leaves(out[impl][1]), jax.tree.leaves(out["xla"][1])):
        np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", [(2048, 256, 50257), (512, 576, 49152), (8192, 2048, 128256)])
def test_chunked_default_chunk_stays_small_at_any_vocabulary(shape):
  """The chunk comes from a memory budget and the vocabulary (at most 1/64 of it): value+grad temporaries stay
  under 5% of `xla`'s (a fixed 4096-column chunk took 10.9% at the first shape, 16.7% at the second)."""
  t, d, v = shape
  sd = jax.ShapeDtypeStruct

  def temp(impl):
    def loss(h, w, y):
      logp, entropy, _ = token_logprobs(h, w, y, impl=impl)
      return jnp.sum(logp) + 0.1 * jnp.sum(entropy)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        sd((t, d), jnp.float32), sd((d, v), jnp.float32), sd((t,), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp("chunked") < 0.05 * temp("xla")
