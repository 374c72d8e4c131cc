"""Decode attention over a packed per-row cache, each row read up to its own length: the dense form and the Pallas
kernels (GPU's in Pallas' interpret mode, TPU's in TPU interpret mode) against NumPy softmax attention; both kernels
lower for their chips, and the engine's decode step compiled for TPU v5e runs the TPU kernel in every layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jalign.kernels import decode_attention

B, N, K, S, H = 4, 8, 2, 256, 64
LENGTHS = np.asarray([1, 130, 256, 77], np.int32)  # one key, two pages and a bit, all pages, under one page


def _inputs(dtype=np.float32, seed=0):
  rng = np.random.RandomState(seed)
  q, k, v = rng.randn(B, N, H), rng.randn(B, K, S, H), rng.randn(B, K, S, H)
  return [np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (q, k, v)]  # exactly representable


def _numpy(q, k, v, lengths, scale, softcap=None, window=None, sinks=None):
  """Softmax attention of each row's query over its first `length` keys (a window: the last `window` of them);
  `sinks` [N]: each head's logit in the denominator."""
  out = np.zeros_like(q, dtype=np.float64)
  for b in range(B):
    lo = 0 if window is None else max(0, lengths[b] - window)
    for n in range(N):
      keys, values = k[b, n // (N // K), lo:lengths[b]], v[b, n // (N // K), lo:lengths[b]]
      scores = keys.astype(np.float64) @ q[b, n] * scale
      if softcap:
        scores = np.tanh(scores / softcap) * softcap
      top = scores.max() if sinks is None else max(scores.max(), sinks[n])
      p = np.exp(scores - top)
      out[b, n] = (p / (p.sum() + (0 if sinks is None else np.exp(sinks[n] - top)))) @ values
  return out


@pytest.mark.parametrize("softcap, window", [(None, None), (30.0, None), (None, 50)])
def test_dense_form_is_softmax_over_each_rows_length(softcap, window):
  q, k, v = _inputs()
  got = decode_attention(*map(jnp.asarray, (q, k, v, LENGTHS)), scale=0.125, softcap=softcap, window=window,
                         impl="xla")
  np.testing.assert_allclose(np.asarray(got), _numpy(q, k, v, LENGTHS, 0.125, softcap, window), atol=1e-5)


def test_sinks_in_the_dense_form():
  q, k, v = _inputs()
  sinks = np.random.RandomState(3).randn(N).astype(np.float32) * 2
  got = decode_attention(*map(jnp.asarray, (q, k, v, LENGTHS)), scale=0.125, window=50, impl="auto",
                         sinks=jnp.asarray(sinks))
  np.testing.assert_allclose(np.asarray(got), _numpy(q, k, v, LENGTHS, 0.125, None, 50, sinks), atol=1e-5)
  with pytest.raises(ValueError, match="decode attention impl 'pallas_gpu' has no sinks; use impl='xla'"):
    decode_attention(*map(jnp.asarray, (q, k, v, LENGTHS)), scale=0.125, impl="pallas_gpu", sinks=jnp.asarray(sinks))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_kernel_in_interpret_mode_matches_numpy(softcap):
  q, k, v = _inputs()
  got = decode_attention(*map(jnp.asarray, (q, k, v, LENGTHS)), scale=0.125, softcap=softcap, impl="pallas_gpu",
                         interpret=True)
  np.testing.assert_allclose(np.asarray(got), _numpy(q, k, v, LENGTHS, 0.125, softcap), atol=1e-5)


def test_tpu_kernel_in_tpu_interpret_mode_matches_numpy():
  """bf16, as a TPU cache is: the kernel's matmuls round probabilities to bf16 (TPU semantics), so the tolerance is
  bf16's (the dense form in fp32 on the same inputs is within 1e-5)."""
  from jax.experimental.pallas import tpu as pltpu
  q, k, v = _inputs(jnp.bfloat16)
  h = 128  # the TPU kernel's head_dim
  q, k, v = (np.concatenate([a, a[..., ::-1]], axis=-1) for a in (q, k, v))
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  with pltpu.force_tpu_interpret_mode():
    got = decode_attention(bf(q), bf(k), bf(v), jnp.asarray(LENGTHS), scale=h ** -0.5, impl="pallas_tpu")
  want = _numpy(q, k, v, LENGTHS, h ** -0.5)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)
  assert np.abs(np.asarray(got, np.float32) - want).mean() < 3e-3


def test_kernels_lower_for_their_chips():
  sd = jax.ShapeDtypeStruct
  args = (sd((8, 32, 128), jnp.bfloat16), sd((8, 8, 2048, 128), jnp.bfloat16), sd((8, 8, 2048, 128), jnp.bfloat16),
          sd((8,), jnp.int32))
  chips = (("pallas_gpu", "cuda", "__gpu$xla.gpu.triton"), ("pallas_tpu", "tpu", "tpu_custom_call"))
  for impl, platform, call in chips:
    f = jax.jit(lambda q, k, v, n, impl=impl: decode_attention(q, k, v, n, scale=0.1, impl=impl))
    assert f.trace(*args).lower(lowering_platforms=(platform,)).as_text().count(call) == 1, impl


def test_bad_uses_say_what_is_accepted():
  q, k, v = (jnp.zeros(s) for s in ((2, 4, 64), (2, 2, 200, 64), (2, 2, 200, 64)))
  n = jnp.ones(2, jnp.int32)
  with pytest.raises(ValueError, match="available: xla, pallas_tpu, pallas_gpu, auto"):
    decode_attention(q, k, v, n, scale=1.0, impl="flash")
  with pytest.raises(ValueError, match="pages of 128 slots; the cache has 200"):
    decode_attention(q, k, v, n, scale=1.0, impl="pallas_gpu", interpret=True)
  with pytest.raises(ValueError, match="sliding window"):
    decode_attention(q, k, v, n, scale=1.0, impl="pallas_gpu", window=16, interpret=True)
  with pytest.raises(ValueError, match="head_dim a multiple of 128; this model's is 64"):
    decode_attention(q, k, v, n, scale=1.0, impl="pallas_tpu")
  with pytest.raises(ValueError, match=r"k \(2, 2, 200, 64\) and v \(2, 2, 100, 64\)"):
    decode_attention(q, k, v[:, :, :100], n, scale=1.0)


def test_auto_takes_the_chips_kernel_only_where_it_applies():
  from jalign.kernels import decode_impl
  from jalign.parallel import tpu_target
  assert decode_impl("auto", None, 128, 256) == "xla"  # CPU
  with jax.set_mesh(jax.sharding.Mesh(np.asarray(tpu_target.target("v5e:2x2").devices), ("data",))):
    assert decode_impl("auto", None, 128, 256) == "pallas_tpu"
    assert decode_impl("auto", 0, 256, 1024) == "pallas_tpu"  # a window of 0 is none
    for window, head_dim, cache_len in ((4096, 128, 256), (None, 64, 256), (None, 128, 200)):
      assert decode_impl("auto", window, head_dim, cache_len) == "xla", (window, head_dim, cache_len)
    assert decode_impl("auto", None, 128, 256, sinks=True) == "xla"  # gpt-oss: the kernels have no sinks


def _engine_decode_for_tpu(head_dim: int, mesh_shape=(1, 1, 1), slots=64, max_len=4096):
  """The continuous engine's decode chunk (4 layers of a 1B-class Llama, bf16, `slots` x `max_len` cache) compiled
  for TPU v5e chips, slots split over 'data'."""
  from jalign.models.config import ModelConfig
  from jalign.models.decoder import Decoder
  from jalign.models.kv_cache import KVCache
  from jalign.parallel import tpu_target
  from jalign.sampling import engine
  from jalign.sampling.settings import Settings
  cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=4,
                    num_heads=2048 // head_dim, num_kv_heads=4, head_dim=head_dim, max_position_embeddings=8192,
                    dtype="bfloat16", param_dtype="bfloat16")
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  s = Settings(max_new=max_len - 256, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, stop_ids=(2,), pad_id=0,
               cache_dtype=jnp.bfloat16, num_samples=1)
  devices = tpu_target.target("v5e:2x2").devices
  mesh = jax.sharding.Mesh(np.asarray(devices[:int(np.prod(mesh_shape))]).reshape(mesh_shape),
                           ("data", "fsdp", "tensor"))
  lay = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(  # noqa: E731
      mesh, P("data") if a.ndim and a.shape[0] == slots else P()))
  cache = lambda: KVCache.init(cfg, slots, max_len, s.cache_dtype).per_row()  # noqa: E731
  state = jax.tree.map(lay, jax.eval_shape(lambda: engine._init(cfg, cache(), 256, s)))
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
  scalar = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
  with jax.set_mesh(mesh):
    return engine._decode_program(graphdef, s).lower(params, state, scalar((2,), jnp.uint32),
                                                    scalar((), jnp.int32), kv_len=max_len, chunk=8).compile()


def test_engine_decode_compiled_for_tpu_runs_the_kernel_in_every_layer():
  """head_dim 128: one Mosaic kernel per layer, on one chip and with the slots split over four; head_dim 64 (which
  the TPU kernel does not lower for) falls back to the dense form."""
  from jalign.parallel import tpu_target
  one = _engine_decode_for_tpu(128)
  assert one.as_text().count("tpu_custom_call") == 4
  four = _engine_decode_for_tpu(128, mesh_shape=(4, 1, 1))
  assert four.as_text().count("tpu_custom_call") == 4
  assert tpu_target.temporaries(four.memory_analysis()) < tpu_target.temporaries(one.memory_analysis())
  assert "tpu_custom_call" not in _engine_decode_for_tpu(64).as_text()


def test_tpu_kernel_keeps_no_score_tensor():
  """Decode attention alone on four v5e chips, 64 slots x 4096 positions, bf16: the kernel's temporaries are its
  VMEM-sized blocks (measured 0.3 MiB per chip), the dense form's the fp32 scores and probabilities (68 MiB)."""
  from jalign.parallel import tpu_target
  mesh = jax.sharding.Mesh(np.asarray(tpu_target.target("v5e:2x2").devices).reshape(4, 1, 1),
                           ("data", "fsdp", "tensor"))
  sd = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dtype, sharding=NamedSharding(mesh, P("data")))
  args = (sd((64, 16, 128)), sd((64, 4, 4096, 128)), sd((64, 4, 4096, 128)), sd((64,), jnp.int32))
  temp = {}
  for impl in ("auto", "xla"):
    with jax.set_mesh(mesh):
      compiled = jax.jit(lambda *a, impl=impl: decode_attention(*a, scale=0.1, impl=impl)).lower(*args).compile()
    temp[impl] = tpu_target.temporaries(compiled.memory_analysis())
    assert ("tpu_custom_call" in compiled.as_text()) == (impl == "auto")
  assert temp["auto"] < 0.02 * temp["xla"], temp
