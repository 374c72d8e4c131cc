"""The distillation divergence against a NumPy transcription of TRL 1.16's definition and against TRL itself."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.losses.distill import generalized_jsd

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def np_generalized_jsd(student, teacher, beta, temperature):
  """TRL 1.16 `DistillationTrainer` (trl/kernels/chunked_divergence.py): the forward KL at beta 0, the reverse KL at
  beta 1, else beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = (1 - beta) p_s + beta p_t; fp64."""
  def log_softmax(z):
    z = z / temperature
    return z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)
  log_ps, log_pt = log_softmax(np.float64(student)), log_softmax(np.float64(teacher))
  ps, pt = np.exp(log_ps), np.exp(log_pt)
  if beta == 0:
    return np.sum(pt * (log_pt - log_ps), -1)
  if beta == 1:
    return np.sum(ps * (log_ps - log_pt), -1)
  log_m = np.log((1 - beta) * ps + beta * pt)
  return beta * np.sum(pt * (log_pt - log_m), -1) + (1 - beta) * np.sum(ps * (log_ps - log_m), -1)


def _logits(seed=0, shape=(2, 3, 50)):
  rng = np.random.RandomState(seed)
  return rng.randn(*shape) * 3, rng.randn(*shape) * 3 + rng.randn(shape[-1])  # teacher with its own bias


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_is_trls_formula(beta, temperature):
  student, teacher = _logits()
  with jax.enable_x64():
    got = generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), beta, temperature)
    assert got.shape == (2, 3) and got.dtype == jnp.float64
    np.testing.assert_allclose(got, np_generalized_jsd(student, teacher, beta, temperature), rtol=1e-6, atol=1e-12)
  assert np.all(np.asarray(got) > 0)
  same = generalized_jsd(jnp.asarray(student, jnp.float32), jnp.asarray(student, jnp.float32), beta, temperature)
  np.testing.assert_allclose(same, 0.0, atol=1e-6)  # a divergence: 0 between equal distributions


@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_and_its_gradient_equal_trls_kernel(beta):
  """TRL's own `ChunkedDivergenceFunction` (the torch path of its CPU fallback) on hidden states and LM heads, value
  and gradient with respect to the student's hidden states and head; the teacher gets no gradient."""
  torch = pytest.importorskip("torch")
  chunked = pytest.importorskip("trl.kernels.chunked_divergence")
  rng = np.random.RandomState(1)
  n, d_s, d_t, v = 6, 8, 12, 40  # a wider teacher: only the vocabulary is shared
  h_s, w_s = rng.randn(n, d_s).astype(np.float32), rng.randn(v, d_s).astype(np.float32)
  h_t, w_t = rng.randn(n, d_t).astype(np.float32), rng.randn(v, d_t).astype(np.float32)
  t = [torch.tensor(x, requires_grad=True) for x in (h_s, w_s, h_t, w_t)]
  theirs, _ = chunked.ChunkedDivergenceFunction.apply(t[0], t[1], None, t[2], t[3], None, beta, 1.5)
  theirs.sum().backward()

  def ours(hs, ws, ht, wt):
    return generalized_jsd(hs @ ws.T, ht @ wt.T, beta, 1.5)
  value = ours(*map(jnp.asarray, (h_s, w_s, h_t, w_t)))
  grads = jax.grad(lambda *a: ours(*a).sum(), argnums=(0, 1, 2, 3))(*map(jnp.asarray, (h_s, w_s, h_t, w_t)))
  np.testing.assert_allclose(value, theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
  for ours_grad, x in zip(grads[:2], t[:2]):
    np.testing.assert_allclose(ours_grad, x.grad.numpy(), rtol=1e-4, atol=1e-5)
  assert not np.any(grads[2]) and not np.any(grads[3])  # the teacher is frozen


def test_bad_arguments_name_what_is_accepted():
  student, teacher = map(jnp.asarray, _logits())
  with pytest.raises(ValueError, match=r"beta=1.5 must be in \[0, 1\]"):
    generalized_jsd(student, teacher, 1.5)
  with pytest.raises(ValueError, match="temperature=0 must be positive"):
    generalized_jsd(student, teacher, 0.5, temperature=0)
  with pytest.raises(ValueError, match="student vocabulary 50 != teacher vocabulary 49; slice both"):
    generalized_jsd(student, teacher[..., :49], 0.5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_divergence_is_the_divergence_over_the_topk_and_the_rest(beta):
  """Against the teacher's stored top-k: both distributions over k + 1 outcomes (the k tokens and the rest), in
  NumPy; with k = V - 1 the rest is one token and the divergence is the full one. Logits halved so every tail
  holds well over fp32's resolution of the mass (2**-24): a tail of 2e-7 is known to a quarter of itself only."""
  from jalign.losses.distill import topk_divergence
  student, teacher = (z / 2 for z in _logits(3, (2, 5, 12)))
  log_softmax = lambda z: z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(  # noqa
      -1, keepdims=True)
  ls, lt = log_softmax(np.float64(student)), log_softmax(np.float64(teacher))
  for k in (3, 11):
    ids = np.argsort(-lt, -1)[..., :k]
    s_k, t_k = np.take_along_axis(ls, ids, -1), np.take_along_axis(lt, ids, -1)
    cat = lambda lk: np.concatenate([np.exp(lk), 1 - np.exp(lk).sum(-1, keepdims=True)], -1)  # noqa: E731
    p, q = cat(s_k), cat(t_k)
    if beta == 0:
      want = np.sum(q * np.log(q / p), -1)
    elif beta == 1:
      want = np.sum(p * np.log(p / q), -1)
    else:
      m = (1 - beta) * p + beta * q
      want = beta * np.sum(q * np.log(q / m), -1) + (1 - beta) * np.sum(p * np.log(p / m), -1)
    got = topk_divergence(jnp.asarray(s_k, jnp.float32), jnp.asarray(t_k, jnp.float32), beta)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    if k == 11:
      np.testing.assert_allclose(want, np_generalized_jsd(student, teacher, beta, 1.0), rtol=1e-9)
