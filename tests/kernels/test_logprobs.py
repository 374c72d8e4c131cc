"""token_logprobs: both implementations against a NumPy formula, gradients against each other, and the chunked
version's memory (XLA's own buffer accounting) against the materialised one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.kernels import token_logprobs


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


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.6), dict(softcap=1.5)])
def test_values_match_numpy(impl, kw):
  h, w, y = _data()
  got = token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), impl=impl, chunk=16, **kw)
  for g, want in zip(got, np_reference(h, w, y, **kw)):
    np.testing.assert_allclose(np.asarray(g), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.6), dict(softcap=1.5)])
def test_chunked_gradients_equal_autodiff_of_the_formula(kw):
  h, w, y = (jnp.asarray(a) for a in _data(1))
  weights = (1.0, -0.3, 0.2)  # exercise the gradients of all three outputs

  def loss(impl):
    return lambda h, w: sum(jnp.sum(o * c) for o, c in zip(token_logprobs(h, w, y, impl=impl, chunk=16, **kw),
                                                          weights))

  want = jax.grad(loss("xla"), argnums=(0, 1))(h, w)
  got = jax.grad(loss("chunked"), argnums=(0, 1))(h, w)
  for g, t in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(t), atol=1e-5, rtol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
  h, w, y = _data(2)
  got = token_logprobs(jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(y), impl="chunked",
                       chunk=32)
  want = np_reference(np.asarray(jnp.asarray(h, jnp.bfloat16), np.float32),
                      np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32), y)
  assert got[0].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got[0]), want[0], atol=2e-2)


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
  with pytest.raises(ValueError, match="available: xla, chunked, auto"):
    token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), impl="pallas_tpu")


def test_dpo_and_grpo_steps_agree_between_xla_and_chunked():
  """Whole objectives: loss and gradients through `chunked` (vocabulary 288 in chunks of 100) equal `xla`."""
  from flax import nnx

  from jalign import models
  from jalign.objectives import dpo, grpo

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
  seq["response"] = seq["tokens"][:, p:]
  cases = [(lambda impl: dpo.make_loss_fn(graphdef, dpo.DpoLossConfig(rpo_alpha=0.5), impl=impl, chunk=100), pairs),
           (lambda impl: grpo.make_loss_fn(graphdef, grpo.GrpoLossConfig(), impl, 100), seq)]
  for make, batch in cases:
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    out = {}
    for impl in ("xla", "chunked"):
      fn = make(impl)
      out[impl] = jax.value_and_grad(lambda prm: fn(prm, batch)[0])(params)
    np.testing.assert_allclose(out["chunked"][0], out["xla"][0], rtol=1e-5)
    for g1, g2 in zip(jax.tree.leaves(out["chunked"][1]), jax.tree.leaves(out["xla"][1])):
      np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-6)
