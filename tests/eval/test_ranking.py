"""Rank correlations against scipy's definitions, ties included."""
import numpy as np
import pytest
from scipy import stats

from jalign.eval import ranking


@pytest.mark.parametrize("seed", range(4))
def test_spearman_and_kendall_match_scipy(seed):
  rng = np.random.RandomState(seed)
  gold = np.round(rng.randn(200), 1)               # many ties, as in graded gold scores
  gold[:50] = 0.0
  scores = gold + rng.randn(200) * (0.3 + seed)
  if seed == 3:
    scores = np.round(scores)                      # ties on the model side too
  assert ranking.spearman(scores, gold) == pytest.approx(stats.spearmanr(scores, gold).statistic, abs=1e-12)
  assert ranking.kendall_tau_b(scores, gold) == pytest.approx(stats.kendalltau(scores, gold).statistic, abs=1e-12)


def test_constant_side_is_nan():
  assert np.isnan(ranking.spearman([1, 1, 1], [1, 2, 3]))
  assert np.isnan(ranking.kendall_tau_b([1, 2, 3], [5, 5, 5]))
