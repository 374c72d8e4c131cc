"""Decoder mechanics: mesh sharding, KV-cache decoding, packed sequences, scan vs loop, remat, scalar head."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jalign import models
from tests import hf_reference as ref


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  out = {}
  for family in ("llama", "gemma3", "mistral"):
    model = ref.build(family)
    out[family] = (model, ref.save(model, tmp_path_factory.mktemp(family)))
  return out


def test_mesh_loading_splits_every_large_param_and_keeps_logits(checkpoints):
  model, path = checkpoints["llama"]
  assert len(jax.devices()) == 8
  mesh = models.make_mesh((1, 4, 2))  # data x fsdp x tensor
  lm1 = models.from_pretrained(path)
  lm8 = models.from_pretrained(path, mesh=mesh)
  ids, mask = ref.batch(model.config.vocab_size)
  np.testing.assert_allclose(lm8(jnp.asarray(ids), jnp.asarray(mask)), lm1(jnp.asarray(ids), jnp.asarray(mask)),
                             atol=1e-5)
  cfg = lm8.cfg
  expected_shard = {  # fsdp=4 on the model dim, tensor=2 on heads / kv heads / mlp / vocab
      "q": (cfg.num_layers, 32 // 4, 4 // 2, cfg.head_dim), "k": (cfg.num_layers, 32 // 4, 2 // 2, cfg.head_dim),
      "o": (cfg.num_layers, 4 // 2, cfg.head_dim, 32 // 4), "gate": (cfg.num_layers, 32 // 4, 64 // 2),
      "down": (cfg.num_layers, 64 // 2, 32 // 4)}
  for name, shard_shape in expected_shard.items():
    arr = getattr(lm8.layers, name)[...]
    shards = arr.addressable_shards
    assert len(shards) == 8 and {s.data.shape for s in shards} == {shard_shape}, name
    assert len({str(s.index) for s in shards}) == 8, name  # each device holds a different piece
    whole = np.asarray(getattr(lm1.layers, name)[...])
    for s in shards:
      np.testing.assert_array_equal(np.asarray(s.data), whole[s.index])
  embed = lm8.embed[...]
  assert {s.data.shape for s in embed.addressable_shards} == {(96 // 2, 32 // 4)}
  # Norm scales stay replicated.
  assert {s.data.shape for s in lm8.layers.attn_norm[...].addressable_shards} == {(cfg.num_layers, 32)}


def test_sharding_rules_drop_axes_that_do_not_divide():
  mesh = models.make_mesh((1, 4, 2))
  assert models.logical_to_spec(("vocab", "embed"), (96, 32), mesh) == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert models.logical_to_spec(("vocab", "embed"), (95, 30), mesh) == jax.sharding.PartitionSpec(None, None)
  assert models.make_mesh((2, -1, 2)).shape == {"data": 2, "fsdp": 2, "expert": 1, "sequence": 1,
                                                 "tensor": 2}
  assert models.make_mesh((1, 2, 2, -1)).shape == {"data": 1, "fsdp": 2, "expert": 2, "sequence": 1, "tensor": 2}
  # An expert axis: dense weights' model dimension over fsdp x expert; experts over expert, their model dim over fsdp.
  ep = models.make_mesh((1, 2, 1, 2), jax.devices()[:4])
  P = jax.sharding.PartitionSpec
  assert models.logical_to_spec(("vocab", "embed"), (96, 32), ep) == P(None, ("fsdp", "expert"))
  assert models.logical_to_spec(("layers", "experts", "embed", "expert_mlp"), (3, 6, 32, 24), ep) == \
      P(None, "expert", "fsdp", None)
  sampling = models.without_fsdp()
  assert models.logical_to_spec(("vocab", "embed"), (96, 32), ep, sampling) == P(None, None)
  assert models.logical_to_spec(("layers", "experts", "embed", "expert_mlp"), (3, 6, 32, 24), ep, sampling) == \
      P(None, "expert", None, None)
  # A sequence axis shares out the weights like fsdp in training, not for sampling.
  cp = models.make_mesh((1, 2, 1, 1, 2), jax.devices()[:4])
  assert models.logical_to_spec(("vocab", "embed"), (96, 32), cp) == P(None, ("fsdp", "sequence"))
  assert models.logical_to_spec(("vocab", "embed"), (96, 32), cp, sampling) == P(None, None)
  with pytest.raises(ValueError, match="needs 16 devices"):
    models.make_mesh((4, 2, 2))


@pytest.mark.parametrize("max_len", [16, 600])
@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_kv_cache_decoding_matches_full_forward(checkpoints, family, max_len):
  """Prefill a left-padded batch, then decode token by token: logits equal the full forward's (sliding windows
  included, since the sequence outgrows the window of 4). A cache of 600 slots takes the prefill through the
  chunked attention kernel (over the empty slots too), 16 through the dense form."""
  model, path = checkpoints[family]
  lm = models.from_pretrained(path)
  ids, mask = ref.batch(model.config.vocab_size, pads=(0, 3), length=12)
  full = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  prompt_len = 6
  cache = models.KVCache.init(lm.cfg, batch=2, max_len=max_len)
  hidden, cache = lm.forward(jnp.asarray(ids[:, :prompt_len]), jnp.asarray(mask[:, :prompt_len]), cache=cache)
  assert ref.max_diff(lm.logits(hidden), full[:, :prompt_len], mask[:, :prompt_len]) <= 1e-5
  next_pos = jnp.asarray(mask[:, :prompt_len].sum(1))
  graphdef, params = nnx.split(lm)
  step = jax.jit(lambda params, tok, pos, cache: nnx.merge(graphdef, params).forward(
      tok, positions=pos, cache=cache), donate_argnums=3)
  for t in range(prompt_len, 12):
    hidden, cache = step(params, jnp.asarray(ids[:, t:t + 1]), next_pos[:, None], cache)
    np.testing.assert_allclose(lm.logits(hidden)[:, 0], full[:, t], atol=1e-5, err_msg=f"{family} step {t}")
    next_pos = next_pos + 1
  assert int(cache.index) == 12


def test_packed_sequences_equal_separate_runs(checkpoints):
  model, path = checkpoints["gemma3"]
  lm = models.from_pretrained(path)
  a, b = np.arange(3, 10), np.arange(20, 25)  # lengths 7 and 5, packed into one row of 14 with 2 pads
  packed = np.concatenate([a, b, [0, 0]])[None]
  segments = np.array([[1] * 7 + [2] * 5 + [0, 0]])
  positions = np.array([list(range(7)) + list(range(5)) + [0, 0]])
  got = np.asarray(lm(jnp.asarray(packed), segment_ids=jnp.asarray(segments),
                      positions=jnp.asarray(positions)))
  np.testing.assert_allclose(got[0, :7], np.asarray(lm(jnp.asarray(a[None])))[0], atol=1e-5)
  np.testing.assert_allclose(got[0, 7:12], np.asarray(lm(jnp.asarray(b[None])))[0], atol=1e-5)
  assert np.isfinite(got).all()  # padding rows attend to nothing but stay finite


def test_scan_loop_and_remat_agree(checkpoints):
  model, path = checkpoints["gemma3"]
  ids, mask = ref.batch(model.config.vocab_size)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)

  def loss_and_grad(lm):
    graphdef, params = nnx.split(lm)
    def loss(params):
      return jnp.mean(nnx.merge(graphdef, params)(ids, mask) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  base_loss, base_grad = loss_and_grad(models.from_pretrained(path, scan_layers=True))
  for knobs in (dict(scan_layers=False), dict(remat="full"), dict(remat="dots", scan_layers=False)):
    l, g = loss_and_grad(models.from_pretrained(path, **knobs))
    np.testing.assert_allclose(l, base_loss, rtol=1e-6, err_msg=str(knobs))
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(base_grad)):
      np.testing.assert_allclose(x, y, atol=1e-6, err_msg=str(knobs))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_scalar_head_matches_numpy(kind):
  head = models.ScalarHead(16, kind=kind, mlp_size=8, rngs=nnx.Rngs(0))
  hidden = np.random.RandomState(0).randn(2, 5, 16).astype(np.float32)
  got = np.asarray(head(jnp.asarray(hidden)))
  h = hidden
  if kind == "mlp":
    h = np.tanh(h @ np.asarray(head.w_hidden[...]) + np.asarray(head.b_hidden[...]))
  want = (h @ np.asarray(head.w_out[...]))[..., 0] + np.asarray(head.b_out[...])[0]
  assert got.shape == (2, 5)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_create_on_mesh_initialises_sharded():
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8)
  mesh = models.make_mesh((2, 2, 2))
  lm = models.create(cfg, seed=1, mesh=mesh)
  assert lm.layers.gate[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  ref_lm = models.create(cfg, seed=1)
  np.testing.assert_allclose(np.asarray(lm.layers.gate[...]), np.asarray(ref_lm.layers.gate[...]), rtol=1e-6)
