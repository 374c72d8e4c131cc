"""The MoE kernels: grouped matmul and the dropless experts MLP against dense NumPy / all-experts references (value
and gradient, ragged groups with empty experts), routing against the softmax-top-k formula, and the megablox kernel
in interpret mode and compiled for a TPU."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.kernels import moe

SWIGLU = moe.gated(jax.nn.silu)


def _groups(sizes, k=12, n=20, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(sum(sizes), k).astype(np.float32)
  w = rng.randn(len(sizes), k, n).astype(np.float32)
  return x, w, np.asarray(sizes, np.int32)


def _np_grouped(x, w, sizes):
  out, start = [], 0
  for g, size in enumerate(sizes):
    out.append(x[start:start + size] @ w[g])
    start += size
  return np.concatenate(out)


@pytest.mark.parametrize("impl", ["xla", "ragged"])
@pytest.mark.parametrize("sizes", [(5, 0, 7, 1, 0, 3), (0, 0, 16, 0), (4, 4, 4, 4), (130, 0, 1, 260)])
def test_grouped_matmul_equals_a_matmul_per_group_value_and_gradient(sizes, impl):
  """Ragged groups, empty ones, groups that straddle the `xla` form's 128-row blocks."""
  x, w, s = _groups(sizes)
  np.testing.assert_allclose(moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), impl=impl),
                             _np_grouped(x, w, s), rtol=1e-5, atol=1e-5)
  g = np.random.RandomState(1).randn(sum(sizes), w.shape[-1]).astype(np.float32)
  dx, dw = jax.grad(lambda a, b: jnp.sum(moe.grouped_matmul(a, b, jnp.asarray(s), impl=impl) * g),
                    argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
  want_dx, want_dw, start = np.zeros_like(x), np.zeros_like(w), 0
  for e, size in enumerate(s):  # d(x_g w_e)/dx = g w_e^T, /dw_e = x_g^T g: an empty expert gets a zero gradient
    want_dx[start:start + size] = g[start:start + size] @ w[e].T
    want_dw[e] = x[start:start + size].T @ g[start:start + size]
    start += size
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_megablox_in_interpret_mode_equals_ragged_dot():
  """Rows not a multiple of the 128-row tile (padded inside), groups that straddle tiles, empty groups."""
  x, w, s = _groups((70, 0, 100, 30), k=128, n=128)
  got = moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), impl="megablox", interpret=True)
  np.testing.assert_allclose(got, _np_grouped(x, w, s), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="needs a TPU target"):
    moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), impl="megablox")
  with pytest.raises(ValueError, match="accepted: auto, xla, ragged, megablox"):
    moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), impl="dense")


def test_rows_past_the_groups_come_back_as_zeros():
  x, w, s = _groups((3, 0, 4))
  for impl in ("xla", "ragged"):
    got = np.asarray(moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(np.array([3, 0, 2])), impl=impl))
    np.testing.assert_allclose(got[:5], _np_grouped(x[:5], w, np.array([3, 0, 2])), rtol=1e-5, atol=1e-5)
    assert np.all(got[5:] == 0), impl


@pytest.mark.parametrize("normalize", [False, True])
def test_route_is_softmax_top_k(normalize):
  logits = np.random.RandomState(2).randn(9, 6).astype(np.float32) * 2
  weights, ids = moe.route(jnp.asarray(logits), 2, normalize=normalize)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want_ids = np.argsort(-p, -1)[:, :2]
  want = np.take_along_axis(p, want_ids, -1)
  if normalize:
    want = want / want.sum(-1, keepdims=True)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want, rtol=1e-6)
  # Replaying the same choices gives the same gate values.
  np.testing.assert_allclose(moe.replayed_weights(jnp.asarray(logits), ids, normalize=normalize), weights, rtol=1e-6)


def _np_group_limited(logits, bias, k, groups, kept, normalize, factor):
  """DeepSeek-V3's routing per token, as its paper states it (arXiv:2412.19437 eqs. 13-16, node-limited routing
  sec. 2.1.2) and transformers' `DeepseekV3TopkRouter` computes it, one token at a time in NumPy."""
  E = logits.shape[1]
  ids, weights = [], []
  for row in logits:
    s = 1 / (1 + np.exp(-row.astype(np.float64)))
    choice = s + bias
    per_group = choice.reshape(groups, E // groups)
    group_score = np.sort(per_group, axis=1)[:, -2:].sum(1)
    allowed = np.zeros(E, bool)
    for g in np.argsort(-group_score, kind="stable")[:kept]:
      allowed[g * E // groups:(g + 1) * E // groups] = True
    top = [e for e in np.argsort(-np.where(allowed, choice, -np.inf), kind="stable")[:k]]
    w = s[top] / (s[top].sum() + 1e-20) if normalize else s[top]
    ids.append(top)
    weights.append(w * factor)
  return np.array(ids), np.array(weights)


@pytest.mark.parametrize("groups,kept,normalize", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_sigmoid_routing_with_groups_and_a_correction_bias_equals_numpy(groups, kept, normalize):
  """The bias moves choices but never weights; gates are sigmoid scores, renormalised or not, times the factor;
  only experts of the `kept` best groups (ranked by their two best biased scores) are chosen; replaying the choices
  gives the same gates, and the bias gets no gradient."""
  rng = np.random.RandomState(5)
  logits = rng.randn(64, 16).astype(np.float32)
  bias = (rng.randn(16) * 0.5).astype(np.float32)
  kw = dict(normalize=normalize, score="sigmoid", factor=2.5)
  weights, ids = moe.route(jnp.asarray(logits), 3, bias_E=jnp.asarray(bias), groups=groups, groups_kept=kept, **kw)
  want_ids, want = _np_group_limited(logits, bias, 3, groups, kept, normalize, 2.5)
  np.testing.assert_array_equal(np.sort(ids, 1), np.sort(want_ids, 1))
  order = lambda i, w: np.take_along_axis(w, np.argsort(i, 1), 1)  # noqa: E731
  np.testing.assert_allclose(order(ids, weights), order(want_ids, want), rtol=1e-5)
  unbiased = moe.route(jnp.asarray(logits), 3, groups=groups, groups_kept=kept, **kw)[1]
  assert np.mean(np.sort(unbiased, 1) != np.sort(ids, 1)) > 0.05  # the bias steers choices
  np.testing.assert_allclose(moe.replayed_weights(jnp.asarray(logits), ids, **kw), weights, rtol=1e-6)
  grad = jax.grad(lambda b: jnp.sum(moe.route(jnp.asarray(logits), 3, bias_E=b, groups=groups, groups_kept=kept,
                                               **kw)[0]))(jnp.asarray(bias))
  assert not np.any(np.asarray(grad))


def _experts(t=40, d=16, f=24, e=8, k=2, seed=3):
  rng = np.random.RandomState(seed)
  x = rng.randn(t, d).astype(np.float32)
  gate, up = (rng.randn(e, d, f).astype(np.float32) * 0.3 for _ in range(2))
  down = rng.randn(e, f, d).astype(np.float32) * 0.3
  # Tokens only ever pick experts 0..e-3: the last two are empty (their gradients must be exactly zero).
  ids = np.stack([rng.choice(e - 2, k, replace=False) for _ in range(t)]).astype(np.int32)
  weights = rng.rand(t, k).astype(np.float32)
  return x, ids, weights, gate, up, down


def test_experts_mlp_equals_numpy_per_token_and_the_dense_reference_with_gradients():
  x, ids, weights, gate, up, down = _experts()
  silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
  want = np.stack([sum(weights[t, j] * (silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e]
                       for j, e in enumerate(ids[t])) for t in range(len(x))])
  args = tuple(map(jnp.asarray, (x, ids, weights, gate, up, down)))
  got = moe.experts_mlp(*args, SWIGLU, impl="xla")
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(moe.reference(*args, SWIGLU), want, rtol=1e-4, atol=1e-5)

  cot = jnp.asarray(np.random.RandomState(4).randn(*x.shape).astype(np.float32))
  wrt = (0, 2, 3, 4, 5)  # x, gate values, the three expert weights
  grouped = jax.grad(lambda *a: jnp.sum(moe.experts_mlp(*a, SWIGLU, impl="xla") * cot), argnums=wrt)(*args)
  dense = jax.grad(lambda *a: jnp.sum(moe.reference(*a, SWIGLU) * cot), argnums=wrt)(*args)
  for a, b in zip(grouped, dense):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for dw in grouped[2:]:
    assert np.all(np.asarray(dw)[-2:] == 0)  # the unchosen experts


def _clamped(limit=0.3, alpha=1.702):
  """gpt-oss's expert activation, in NumPy (its model card / transformers `GptOssExperts._apply_gate`)."""
  def glu(gate, up):
    gate = np.minimum(gate, limit)
    return (np.clip(up, -limit, limit) + 1) * gate / (1 + np.exp(-alpha * gate))
  return glu


@pytest.mark.parametrize("shape", [None, (2, 1, 2, 2)])
def test_biased_experts_with_a_clamped_glu_equal_numpy_per_token(shape):
  """gpt-oss's experts: gate, up and down biases, its clamped SwiGLU; on one device and on a mesh with expert and
  tensor axes (the down bias outside the tensor-split partial sums), value and gradient against the dense form."""
  from jalign.models.sharding import make_mesh
  x, ids, weights, gate, up, down = _experts(t=16)
  e, f, d = gate.shape[0], gate.shape[2], gate.shape[1]
  rng = np.random.RandomState(7)
  biases = (rng.randn(e, f).astype(np.float32) * 0.3, rng.randn(e, f).astype(np.float32) * 0.3,
            rng.randn(e, d).astype(np.float32) * 0.3)
  glu = _clamped()
  want = np.stack([sum(weights[t, j] * (glu(x[t] @ gate[i] + biases[0][i], x[t] @ up[i] + biases[1][i]) @ down[i]
                                        + biases[2][i]) for j, i in enumerate(ids[t])) for t in range(len(x))])
  jglu = lambda g, u: (jnp.clip(u, -0.3, 0.3) + 1) * jnp.minimum(g, 0.3) * jax.nn.sigmoid(  # noqa: E731
      1.702 * jnp.minimum(g, 0.3))
  args = tuple(map(jnp.asarray, (x, ids, weights, gate, up, down)))
  b = tuple(map(jnp.asarray, biases))
  cot = jnp.asarray(np.random.RandomState(4).randn(*x.shape).astype(np.float32))
  grouped = lambda a, b: jnp.sum(moe.experts_mlp(*a, jglu, impl="xla", biases=b) * cot)  # noqa: E731
  dense = lambda a, b: jnp.sum(moe.reference(*a, jglu, biases=b) * cot)  # noqa: E731
  want_grad = jax.grad(dense, argnums=1)(args, b)
  with jax.set_mesh(make_mesh(shape, jax.devices()[:8]) if shape else jax.sharding.Mesh(jax.devices()[:1], ("x",))):
    got = moe.experts_mlp(*args, jglu, impl="xla", biases=b)
    got_grad = jax.jit(jax.grad(grouped, argnums=1))(args, b)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(moe.reference(*args, jglu, biases=b), want, rtol=1e-4, atol=1e-5)
  for a, c in zip(got_grad, want_grad):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(got_grad[2])).max() > 0


@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 1, 2, 2), (1, 2, 1, 4)])
def test_expert_parallel_experts_mlp_equals_one_device_under_skewed_routing(shape):
  """8 experts split over the mesh's `expert` axis (2 per device at 4): every token's copies go to the first three
  experts, all on one device (the worst case for the exchange: one device receives every copy, the others none),
  and experts 6-7 stay empty. Value and gradient equal the dense reference on one device; an expert count the axis
  does not divide is refused by name."""
  from jalign.models.sharding import make_mesh
  x, ids, weights, gate, up, down = _experts(t=48)
  ids = np.stack([np.random.RandomState(t).choice(3, 2, replace=False) for t in range(48)]).astype(np.int32)
  args = tuple(map(jnp.asarray, (x, ids, weights, gate, up, down)))
  cot = jnp.asarray(np.random.RandomState(4).randn(*x.shape).astype(np.float32))
  wrt = (0, 2, 3, 4, 5)

  def value_and_grad(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a, SWIGLU) * cot), argnums=wrt))(*args)

  want = value_and_grad(moe.reference)
  mesh = make_mesh(shape, jax.devices()[:int(np.prod(shape))])
  with jax.set_mesh(mesh):
    got = value_and_grad(functools.partial(moe.experts_mlp, impl="xla"))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b in zip(got[1], want[1]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  with jax.set_mesh(make_mesh((1, 1, 1, 3), jax.devices()[:3])):
    with pytest.raises(ValueError, match="8 experts do not split over the mesh's expert axis of 3"):
      moe.experts_mlp(*args, SWIGLU)


def test_expert_adapters_equal_numpy_lora_per_token_on_one_device_and_a_mesh():
  """Per-expert LoRA (A [E, in, r], B [E, r, out]) on gate, up and down: each copy computes x (W_e + s A_e B_e),
  against the per-token NumPy formula; on a mesh with expert, tensor and fsdp axes the value and the adapters'
  gradients equal one device's."""
  from jalign.models.sharding import make_mesh
  x, ids, weights, gate, up, down = _experts(t=32)
  rng, r, s = np.random.RandomState(7), 3, 0.5
  e, d, f = gate.shape
  adapters = tuple((rng.randn(e, i, r).astype(np.float32) * 0.3, rng.randn(e, r, o).astype(np.float32) * 0.3)
                   for i, o in ((d, f), (d, f), (f, d)))
  merged = [w + s * np.einsum("eir,ero->eio", a, b) for w, (a, b) in zip((gate, up, down), adapters)]
  silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
  want = np.stack([sum(weights[t, j] * (silu(x[t] @ merged[0][e_]) * (x[t] @ merged[1][e_])) @ merged[2][e_]
                       for j, e_ in enumerate(ids[t])) for t in range(len(x))])
  args = tuple(map(jnp.asarray, (x, ids, weights, gate, up, down)))
  ad = jax.tree.map(jnp.asarray, adapters)
  cot = jnp.asarray(rng.randn(*x.shape).astype(np.float32))

  def value_and_grad(adapters):
    return jax.jit(jax.value_and_grad(lambda a: jnp.sum(moe.experts_mlp(
        *args, SWIGLU, impl="xla", adapters=a, adapter_scale=s) * cot)))(adapters)

  np.testing.assert_allclose(moe.experts_mlp(*args, SWIGLU, impl="xla", adapters=ad, adapter_scale=s), want,
                             rtol=1e-4, atol=1e-5)
  one = value_and_grad(ad)
  with jax.set_mesh(make_mesh((1, 2, 2, 2))):
    meshed = value_and_grad(ad)
  np.testing.assert_allclose(meshed[0], one[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(meshed[1]), jax.tree.leaves(one[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(one[1][0][0])[-2:] == 0)  # unchosen experts' adapters get no gradient


def test_megablox_experts_mlp_compiles_for_a_tpu_with_its_gradient():
  """The experts MLP, forward and backward, at Qwen3-30B-A3B's expert shapes (128 experts, top 8, D 2048, F 768) for
  2k tokens, compiled for one TPU v5e chip: the program calls the Mosaic grouped-matmul kernel and its memory is
  read from XLA's analysis."""
  from jalign.parallel import tpu_target
  t, d, f, e, k = 2048, 2048, 768, 128, 8
  mesh = jax.sharding.Mesh(np.asarray(tpu_target.target("v5e:2x2").devices).reshape(-1)[:1], ("x",))
  rep = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731

  def loss(x, weights, gate, up, down, ids):
    return jnp.sum(moe.experts_mlp(x, ids, weights, gate, up, down, SWIGLU).astype(jnp.float32))

  bf = jnp.bfloat16
  with jax.set_mesh(mesh):
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
        sd((t, d), bf), sd((t, k), bf), sd((e, d, f), bf), sd((e, d, f), bf), sd((e, f, d), bf),
        sd((t, k), jnp.int32))
    assert lowered.as_text().count("tpu_custom_call") >= 3  # the forward's three grouped matmuls at least
    mem = lowered.compile().memory_analysis()
  weights_bytes = 3 * e * d * f * 2
  assert mem.argument_size_in_bytes >= weights_bytes
  # The dense all-experts form would hold [E, T, F] activations (805 MB in bf16); the grouped one holds [T*k, F].
  assert mem.temp_size_in_bytes < e * t * f * 2


@pytest.mark.parametrize("shape", [None, pytest.param((1, 2, 1, 4), marks=pytest.mark.long)])  # CI time: the mesh one
def test_expert_adapter_dropout_is_inverted_dropout_of_each_copys_adapter_input(shape):
  """Dropout on the experts' adapters (PEFT's lora_dropout on per-expert modules): rate 0 changes nothing; each key
  draws other masks; the down projection's adapter is linear in its dropped-out input, so over many keys its mean is
  the no-dropout value (inverted dropout is unbiased), on one device and on a mesh (each device its own masks)."""
  from jalign.models.sharding import make_mesh
  x, ids, weights, gate, up, down = _experts(t=32)
  rng, r, s = np.random.RandomState(7), 3, 0.5
  e, d, f = gate.shape
  down_only = (None, None, (jnp.asarray(rng.randn(e, f, r).astype(np.float32) * 0.3),
                            jnp.asarray(rng.randn(e, r, d).astype(np.float32) * 0.3)))
  args = tuple(map(jnp.asarray, (x, ids, weights, gate, up, down)))
  with jax.set_mesh(make_mesh(shape, jax.devices()[:8]) if shape else jax.sharding.Mesh(jax.devices()[:1], ("x",))):
    run = jax.jit(lambda key, rate: moe.experts_mlp(*args, SWIGLU, impl="xla", adapters=down_only,
                                                   adapter_scale=s, adapter_dropout=(rate, key)), static_argnums=1)
    want = np.asarray(moe.experts_mlp(*args, SWIGLU, impl="xla", adapters=down_only, adapter_scale=s))
    base = np.asarray(moe.experts_mlp(*args, SWIGLU, impl="xla"))
    np.testing.assert_array_equal(np.asarray(run(jax.random.key(0), 0.0)), want)
    samples = np.stack([np.asarray(run(jax.random.key(i), 0.5)) for i in range(300)])
  assert np.abs(samples[0] - samples[1]).max() > 1e-3  # other keys, other masks
  mean, sem = samples.mean(0), samples.std(0) / np.sqrt(len(samples))
  assert np.all(np.abs(mean - want) <= 4.5 * sem + 1e-6), np.abs(mean - want).max()
  assert np.abs(want - base).max() > 10 * sem.max()  # the adapter's share is well above the test's noise
