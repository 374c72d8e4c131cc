"""full_kl: the exact per-token KL(pi || pi_ref) against a NumPy formula, its policy gradient against autodiff of the
plain formula, a frozen reference, and the chunked version's memory against the materialised one; full_divergence
(distillation's generalized JSD) against the logits form of `losses.distill` in value and gradient, and its memory
compiled for the CPU and for a TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.kernels import full_divergence, full_kl
from jalign.losses.distill import generalized_jsd


def np_kl(hp, wp, hq, wq, temperature=1.0, softcap=None):
  def log_softmax(h, w):
    z = h.astype(np.float64) @ w.astype(np.float64)
    if softcap:
      z = np.tanh(z / softcap) * softcap
    z = z / temperature
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), -1, keepdims=True))

  lp, lq = log_softmax(hp, wp), log_softmax(hq, wq)
  return np.sum(np.exp(lp) * (lp - lq), -1)


def _data(seed=0, n=(3, 7), d=24, e=40, v=101):
  """Policy width 24, reference width 40 (a larger teacher), shared vocabulary of 101."""
  rng = np.random.RandomState(seed)
  return (rng.randn(*n, d).astype(np.float32), (rng.randn(d, v) * 0.4).astype(np.float32),
          rng.randn(*n, e).astype(np.float32), (rng.randn(e, v) * 0.3).astype(np.float32))


FORMS = [dict(), dict(temperature=0.7), dict(softcap=1.5)]


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas_tpu"])
@pytest.mark.parametrize("kw", FORMS)
def test_values_match_numpy(impl, kw):
  """pallas_tpu runs in interpret mode with TPU semantics (tiles of 8 tokens x 128 columns here)."""
  hp, wp, hq, wq = _data()
  mask = np.ones((3, 7), np.int32)
  mask[1, -3:] = 0
  got = full_kl(*(jnp.asarray(a) for a in (hp, wp, hq, wq)), mask_T=jnp.asarray(mask), impl=impl, chunk=16,
                interpret=True, **kw)
  want = np_kl(hp, wp, hq, wq, **kw) * mask
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)
  assert np.all(want[mask == 1] > 0)


def test_kl_of_a_model_with_itself_is_zero():
  hp, wp, _, _ = (jnp.asarray(a) for a in _data(1))
  np.testing.assert_allclose(np.asarray(full_kl(hp, wp, hp, wp, chunk=16)), 0.0, atol=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "pallas_tpu"])
@pytest.mark.parametrize("kw", FORMS)
def test_policy_gradients_equal_autodiff_and_the_reference_is_frozen(impl, kw):
  hp, wp, hq, wq = (jnp.asarray(a) for a in _data(2))
  weights = jnp.asarray(np.random.RandomState(0).rand(3, 7).astype(np.float32))

  def loss(impl):
    return lambda *a: jnp.sum(full_kl(*a, impl=impl, chunk=16, interpret=True, **kw) * weights)

  want = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(hp, wp, hq, wq)
  got = jax.grad(loss(impl), argnums=(0, 1, 2, 3))(hp, wp, hq, wq)
  for g, t in zip(got[:2], want[:2]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(t), atol=1e-5 * float(jnp.max(jnp.abs(t))), rtol=1e-5)
  for g in list(got[2:]) + list(want[2:]):
    assert float(jnp.max(jnp.abs(g))) == 0.0


def test_chunked_never_materialises_either_logits_tensor():
  n, d, v = 1024, 64, 32768
  sd = jax.ShapeDtypeStruct
  args = (sd((n, d), jnp.float32), sd((d, v), jnp.float32), sd((n, d), jnp.float32), sd((d, v), jnp.float32))

  def temp_bytes(impl):
    f = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(full_kl(*a, impl=impl, chunk=1024)), argnums=(0, 1)))
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = n * v * 4
  assert temp_bytes("xla") >= 2 * logits_bytes
  assert temp_bytes("chunked") < logits_bytes / 2


@pytest.mark.parametrize("kw", FORMS)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_divergence_and_its_student_gradient_equal_the_logits_form(beta, kw):
  """`chunked` (chunks of 16 over a vocabulary of 101: the last chunk slides back) against `generalized_jsd` of the
  materialised logits, value and gradient; the teacher gets no gradient."""
  hp, wp, hq, wq = (jnp.asarray(a) for a in _data(3))
  weights = jnp.asarray(np.random.RandomState(1).rand(3, 7).astype(np.float32))
  temperature, softcap = kw.get("temperature", 1.0), kw.get("softcap")

  def logits(h, w):
    z = h @ w
    return z if softcap is None else jnp.tanh(z / softcap) * softcap

  def plain(*a):
    return jnp.sum(generalized_jsd(logits(*a[:2]), logits(*a[2:]), beta, temperature) * weights)

  def fused(*a):
    return jnp.sum(full_divergence(*a, beta=beta, impl="chunked", chunk=16, **kw) * weights)

  (want, want_g), (got, got_g) = (jax.value_and_grad(f, argnums=(0, 1, 2, 3))(hp, wp, hq, wq) for f in (plain, fused))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  assert float(want) > 0
  for g, t in zip(got_g[:2], want_g[:2]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(t), atol=1e-5 * float(jnp.max(jnp.abs(t))), rtol=1e-4)
  for g in list(got_g[2:]) + list(want_g[2:]):
    assert float(jnp.max(jnp.abs(g))) == 0.0


def _divergence_temporaries(impl: str, mesh=None) -> int:
  """Value + student gradient of the JSD (beta 0.5) at T=8192, D=2048, V=128256 bf16, student and teacher alike,
  compiled (for `mesh`'s chips, else the CPU): XLA's temporaries."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jalign.parallel import tpu_target
  sharding = {} if mesh is None else dict(sharding=NamedSharding(mesh, P()))
  args = (jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16, **sharding),
          jax.ShapeDtypeStruct((2048, 128256), jnp.bfloat16, **sharding)) * 2
  f = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(full_divergence(*a, beta=0.5, impl=impl)), argnums=(0, 1)))
  if mesh is None:
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes
  with jax.set_mesh(mesh):
    return tpu_target.temporaries(f.lower(*args).compile().memory_analysis())


def test_fused_divergence_needs_under_5_percent_of_the_materialised_form():
  """Compiled for the CPU and for one TPU v5e chip: `chunked` against the two materialised [T, V] logits tensors."""
  from jalign.parallel import tpu_target
  assert _divergence_temporaries("chunked") <= 0.05 * _divergence_temporaries("xla")
  mesh = tpu_target.chip_mesh("v5e:2x2")
  assert _divergence_temporaries("chunked", mesh) <= 0.05 * _divergence_temporaries("xla", mesh)


def test_bad_calls():
  hp, wp, hq, wq = (jnp.asarray(a) for a in _data())
  with pytest.raises(ValueError, match="available: xla, chunked, pallas_tpu, auto"):
    full_kl(hp, wp, hq, wq, impl="pallas")
  with pytest.raises(ValueError, match="policy vocabulary 101 != reference vocabulary 100"):
    full_kl(hp, wp, hq, wq[:, :100])
  with pytest.raises(ValueError, match="needs a TPU target"):
    full_kl(hp, wp, hq, wq, impl="pallas_tpu")
  with pytest.raises(ValueError, match=r"beta=1.5 must be in \[0, 1\]"):
    full_divergence(hp, wp, hq, wq, beta=1.5)
  with pytest.raises(ValueError, match="'pallas_tpu' computes the reverse KL \\(beta=1\\) only, not beta=0.5"):
    full_divergence(hp, wp, hq, wq, beta=0.5, impl="pallas_tpu")


def test_pallas_tpu_compiled_for_a_tpu_needs_under_2_percent_of_xla():
  """Value + policy gradient compiled for one TPU v5e chip at T=8192, D=2048, V=128256 bf16 (policy and reference
  alike): the fused kernel against the two materialised [T, V] logits tensors."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jalign.parallel import tpu_target
  mesh = tpu_target.chip_mesh("v5e:2x2")
  sd = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))  # noqa: E731
  args = (sd((8192, 2048)), sd((2048, 128256))) * 2

  def temp(impl):
    f = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(full_kl(*a, impl=impl)), argnums=(0, 1)))
    with jax.set_mesh(mesh):
      return tpu_target.temporaries(f.lower(*args).compile().memory_analysis())

  assert temp("auto") <= 0.02 * temp("xla")
