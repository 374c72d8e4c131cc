"""A KV cache with one write index per row (the groundwork of continuous batching: slots at different lengths):
decoding rows that stand at different slots gives each row exactly what it gives decoded alone, and a per-row index
equal across rows reproduces the shared-index path (bitwise up to decode attention's own rounding)."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign.models.config import ModelConfig
from jalign.models.decoder import Decoder
from jalign.models.kv_cache import KVCache


def _model():
  cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=64, dtype="float32")
  return Decoder(cfg, rngs=nnx.Rngs(0))


def test_rows_at_different_slots_equal_their_solo_runs():
  lm = _model()
  # jitted, one program per shape: run op by op, the dozen forwards take half a minute
  forward = nnx.jit(lambda m, ids, positions, cache: m.forward(ids, positions=positions, cache=cache))
  rng = np.random.RandomState(0)
  a, b = rng.randint(1, 64, 7).tolist(), rng.randint(1, 64, 3).tolist()  # prompts of different lengths
  follow = rng.randint(1, 64, (2, 5))

  def solo(prompt, tokens):
    cache = KVCache.init(lm.cfg, 1, 32, jnp.float32)
    ids = jnp.asarray([prompt])
    _, cache = forward(lm, ids, jnp.arange(len(prompt))[None], cache)
    out = []
    for t, tok in enumerate(tokens):
      h, cache = forward(lm, jnp.asarray([[tok]]), jnp.asarray([[len(prompt) + t]]), cache)
      out.append(np.asarray(h[0, -1]))
    return np.stack(out)

  # Both rows in one cache, each prefilled on its own (row 0 at slots 0..6, row 1 at slots 0..2), then decoded
  # together with per-row write indices 7.. and 3..
  cache = KVCache.init(lm.cfg, 2, 32, jnp.float32).per_row()
  for row, prompt in enumerate((a, b)):
    one = KVCache(tuple(k[row:row + 1] for k in cache.k), tuple(v[row:row + 1] for v in cache.v),
                  cache.segment_BxS[row:row + 1], cache.index[row:row + 1])
    _, one = forward(lm, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], one)
    cache = KVCache(tuple(k.at[row:row + 1].set(o) for k, o in zip(cache.k, one.k)),
                    tuple(v.at[row:row + 1].set(o) for v, o in zip(cache.v, one.v)),
                    cache.segment_BxS.at[row:row + 1].set(one.segment_BxS), cache.index.at[row].set(one.index[0]))
  assert cache.index.tolist() == [7, 3]
  together = []
  for t in range(follow.shape[1]):
    positions = jnp.asarray([[len(a) + t], [len(b) + t]])
    h, cache = forward(lm, jnp.asarray(follow[:, t:t + 1]), positions, cache)
    together.append(np.asarray(h[:, -1]))
  together = np.stack(together, 1)
  assert cache.index.tolist() == [12, 8]
  np.testing.assert_allclose(together[0], solo(a, follow[0]), atol=1e-5)
  np.testing.assert_allclose(together[1], solo(b, follow[1]), atol=1e-5)


def test_equal_per_row_indices_are_the_shared_index():
  """Bitwise for a prefill (the same masked form) and for the cache writes; a decode step over a per-row cache runs
  `kernels.decode_attention` (by length, no query axis), which rounds apart from the shared-index form."""
  lm = _model()
  ids = jnp.asarray(np.random.RandomState(1).randint(1, 64, (3, 6)))
  shared = KVCache.init(lm.cfg, 3, 16, jnp.float32)
  h1, c1 = lm.forward(ids, positions=jnp.broadcast_to(jnp.arange(6), (3, 6)), cache=shared)
  h2, c2 = lm.forward(ids, positions=jnp.broadcast_to(jnp.arange(6), (3, 6)), cache=shared.per_row())
  assert np.array_equal(h1, h2) and c2.index.tolist() == [6, 6, 6] and int(c1.index) == 6
  step = jnp.asarray([[5], [9], [11]])
  g1, _ = lm.forward(step, positions=jnp.full((3, 1), 6), cache=c1)
  g2, _ = lm.forward(step, positions=jnp.full((3, 1), 6), cache=c2)
  np.testing.assert_allclose(g1, g2, atol=1e-6)
  assert all(np.array_equal(a, b) for a, b in zip(c1.k + c1.v, c2.k + c2.v))
