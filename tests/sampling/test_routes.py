"""The experts an MoE model's sampler used for each token (`generate(record_routes=True)`), for routing replay: the
static path and the continuous-batching engine (DeepSeek-V3: decoding over its latent cache) record the same ones,
laid out like the prompt and response columns; a teacher-forced forward over the same tokens routes each recorded
token the same way (fp32), and replaying them changes nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign import models, sampling
from jalign.rl.batch import RolloutBatch
from tests import hf_reference as ref

MAX_NEW = 12


# CI time: a dense layer between MoE ones in the long tier; deepseek_v3's first layer is dense
@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("qwen3_moe_dense_layers", marks=pytest.mark.long),
                                        "deepseek_v3"])
def moe(request, tmp_path_factory):
  model = ref.build(request.param)
  return models.from_pretrained(ref.save(model, tmp_path_factory.mktemp("m") / "moe"), dtype="float32")


def _prompts(vocab, n=5, width=14, seed=0):
  rng = np.random.RandomState(seed)
  ids, mask = np.zeros((n, width), np.int32), np.zeros((n, width), np.int32)
  for b, length in enumerate(rng.randint(3, width + 1, n)):
    ids[b, width - length:], mask[b, width - length:] = rng.randint(3, vocab, length), 1
  return ids, mask


def _generate(lm, ids, mask, **kw):
  budgets = np.resize(np.arange(3, MAX_NEW + 1), 2 * len(ids))  # rows stop at different lengths
  return sampling.generate(lm, ids, mask, jax.random.key(3), max_new_tokens=MAX_NEW, temperature=1.0,
                           num_samples=2, budgets=budgets, record_routes=True, **kw)


def test_static_and_engine_record_the_experts_a_forward_over_the_same_tokens_uses(moe):
  lm = moe
  ids, mask = _prompts(lm.cfg.vocab_size)
  static = _generate(lm, ids, mask)
  engine = _generate(lm, ids, mask, slots=4, chunk=3)
  np.testing.assert_array_equal(engine.tokens, static.tokens)
  L, k = len(lm.cfg.moe_layers), lm.cfg.experts_per_token  # routes of the MoE layers only
  n, width = 2 * len(ids), ids.shape[1]
  assert static.routes.shape == engine.routes.shape == (n, width + MAX_NEW, L, k)
  lengths = np.asarray(static.lengths)
  rows_mask = np.repeat(mask, 2, 0)
  for routes in (np.asarray(static.routes), np.asarray(engine.routes)):
    np.testing.assert_array_equal(routes[:, :width, 0, 0] >= 0, rows_mask > 0)  # the prompt's real tokens
    # Each response token fed back: all but the last, which the static path also feeds when its loop runs on
    recorded = routes[:, width:, 0, 0] >= 0
    column = np.arange(MAX_NEW)[None]
    assert recorded[column < lengths[:, None] - 1].all() and not recorded[column >= lengths[:, None]].any()
  assert not (np.asarray(engine.routes)[np.arange(n), width + lengths - 1] >= 0).any()
  both = (np.asarray(static.routes) >= 0) & (np.asarray(engine.routes) >= 0)
  np.testing.assert_array_equal(np.where(both, static.routes, -1), np.where(both, engine.routes, -1))

  batch = RolloutBatch.of_rows(np.repeat(ids, 2, 0), rows_mask, np.asarray(static.tokens), lengths)
  _, _, own = lm.forward_routed(jnp.asarray(batch.tokens), segment_ids=jnp.asarray(batch.segment_ids),
                                positions=jnp.asarray(batch.positions), route_ids=jnp.moveaxis(static.routes, 2, 0),
                                replay=False)
  assert float(jnp.sum(own.mismatch_sum)) == 0.0
  assert float(jnp.sum(own.recorded)) == L * (rows_mask.sum() + (lengths - 1).sum()) + L * np.sum(
      np.asarray(static.routes)[np.arange(n), width + lengths - 1, 0, 0] >= 0)
  got = np.asarray(jnp.moveaxis(own.ids_BxTxK, 0, 2))
  rec = np.asarray(static.routes)
  has = rec[..., :1] >= 0
  np.testing.assert_array_equal(np.sort(np.where(has, got, -1), -1), np.sort(rec, -1))


def test_recording_needs_experts(tmp_path):
  lm = models.from_pretrained(ref.save(ref.build("llama"), tmp_path / "llama"))
  ids, mask = _prompts(lm.cfg.vocab_size)
  with pytest.raises(ValueError, match="no experts"):
    _generate(lm, ids, mask)
