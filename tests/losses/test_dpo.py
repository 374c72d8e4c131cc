"""DPO-family losses against NumPy transcriptions of TRL's definitions and the papers' formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.losses import dpo

B = 16


def _logsig(x):
  return -np.logaddexp(0.0, -x)


def _sig(x):
  return 1 / (1 + np.exp(-x))


def _inputs(seed=0):
  rng = np.random.RandomState(seed)
  c, r, rc, rr = (-(rng.rand(B) * 30 + 1) for _ in range(4))
  lc, lr = rng.randint(1, 40, B).astype(np.float64), rng.randint(1, 40, B).astype(np.float64)
  return c, r, rc, rr, lc, lr


def np_dpo(loss_type, c, r, rc, rr, lc, lr, beta, eps):
  clr, rlr = c - rc, r - rr
  d = clr - rlr
  if loss_type == "sigmoid":
    return -(1 - eps) * _logsig(beta * d) - eps * _logsig(-beta * d)
  if loss_type == "hinge":
    return np.maximum(0, 1 - beta * d)
  if loss_type == "ipo":
    return (clr / lc - rlr / lr - 1 / (2 * beta)) ** 2
  if loss_type == "sigmoid_norm":
    return -_logsig(beta * (clr / lc - rlr / lr))
  if loss_type == "exo_pair":
    qw, ql = _sig(beta * d), _sig(-beta * d)
    return qw * (_logsig(beta * d) - np.log(1 - eps)) + ql * (_logsig(-beta * d) - np.log(eps))
  if loss_type == "nca_pair":
    return -_logsig(beta * clr) - 0.5 * _logsig(-beta * clr) - 0.5 * _logsig(-beta * rlr)
  if loss_type == "robust":
    return (-(1 - eps) * _logsig(beta * d) + eps * _logsig(-beta * d)) / (1 - 2 * eps)
  if loss_type == "bco_pair":
    return -_logsig(beta * clr) - _logsig(-beta * rlr)
  if loss_type == "sppo_hard":
    return (clr - 0.5 / beta) ** 2 + (rlr + 0.5 / beta) ** 2
  if loss_type == "apo_zero":
    return 1 - _sig(beta * clr) + _sig(beta * rlr)
  if loss_type == "apo_down":
    return _sig(beta * clr) + 1 - _sig(beta * d)
  if loss_type == "discopop":
    x = beta * d
    m = _sig(x / 0.05)
    return -_logsig(x) * (1 - m) + np.exp(-x) * m
  raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", dpo.PAIRED)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_paired_losses(loss_type, beta):
  c, r, rc, rr, lc, lr = _inputs()
  eps = 0.1 if loss_type in ("sigmoid", "robust", "exo_pair") else 0.0
  losses, cr, rr_ = dpo.dpo_loss(*(jnp.asarray(x, jnp.float32) for x in (c, r, rc, rr)), beta=beta,
                                 loss_type=loss_type, label_smoothing=eps, chosen_lengths=jnp.asarray(lc),
                                 rejected_lengths=jnp.asarray(lr))
  np.testing.assert_allclose(losses, np_dpo(loss_type, c, r, rc, rr, lc, lr, beta, eps), rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(cr, beta * (c - rc), rtol=1e-5)
  np.testing.assert_allclose(rr_, beta * (r - rr), rtol=1e-5)


def test_sigmoid_gradient_is_dpo():
  """d loss / d chosen_logps = -beta * sigmoid(-beta * delta) (Rafailov et al. 2023, eq. 7)."""
  c, r, rc, rr, _, _ = _inputs(1)
  g = jax.grad(lambda x: jnp.sum(dpo.dpo_loss(x, jnp.asarray(r), jnp.asarray(rc), jnp.asarray(rr), beta=0.2)[0]))(
      jnp.asarray(c))
  d = (c - rc) - (r - rr)
  np.testing.assert_allclose(g, -0.2 * _sig(-0.2 * d), rtol=1e-4)


def test_reference_free_losses():
  c, r, _, _, lc, lr = _inputs(2)
  nll = np.abs(np.random.RandomState(3).randn(B))
  losses, _, _ = dpo.simpo_loss(jnp.asarray(c), jnp.asarray(r), jnp.asarray(lc), jnp.asarray(lr), beta=2.0, gamma=0.5)
  np.testing.assert_allclose(losses, -_logsig(2.0 * (c / lc - r / lr - 0.25)), rtol=1e-4)
  losses, _, _ = dpo.cpo_loss(jnp.asarray(c), jnp.asarray(r), jnp.asarray(nll), beta=0.1, alpha=1.0)
  np.testing.assert_allclose(losses, -_logsig(0.1 * (c - r)) + nll, rtol=1e-4)
  losses, log_odds = dpo.orpo_loss(jnp.asarray(c), jnp.asarray(r), jnp.asarray(lc), jnp.asarray(lr),
                                   jnp.asarray(nll), lam=0.1)
  ac, ar = c / lc, r / lr
  want_odds = (ac - ar) - (np.log1p(-np.exp(ac)) - np.log1p(-np.exp(ar)))
  np.testing.assert_allclose(log_odds, want_odds, rtol=1e-4)
  np.testing.assert_allclose(losses, nll - 0.1 * _logsig(want_odds), rtol=1e-4)


def test_kto():
  rng = np.random.RandomState(4)
  lp, ref = -rng.rand(B) * 20, -rng.rand(B) * 20
  kl_lp, kl_ref = -rng.rand(B) * 20, -rng.rand(B) * 20
  desirable = rng.rand(B) < 0.5
  losses, _, kl = dpo.kto_loss(*(jnp.asarray(x) for x in (lp, ref, desirable, kl_lp, kl_ref)), beta=0.1,
                               desirable_weight=1.0, undesirable_weight=1.33)
  z = max(np.mean(kl_lp - kl_ref), 0.0)
  want = np.where(desirable, 1 - _sig(0.1 * (lp - ref - z)), 1.33 * (1 - _sig(0.1 * (z - (lp - ref)))))
  np.testing.assert_allclose(kl, z, rtol=1e-5)
  np.testing.assert_allclose(losses, want, rtol=1e-4)


def test_errors():
  x = jnp.zeros(3)
  with pytest.raises(ValueError, match="accepted: sigmoid, hinge, ipo"):
    dpo.dpo_loss(x, x, x, x, beta=0.1, loss_type="dpo2")
  with pytest.raises(ValueError, match="pass chosen_lengths and rejected_lengths"):
    dpo.dpo_loss(x, x, x, x, beta=0.1, loss_type="ipo")
  with pytest.raises(ValueError, match="exo_pair needs 0 < label_smoothing < 1"):
    dpo.dpo_loss(x, x, x, x, beta=0.1, loss_type="exo_pair")
