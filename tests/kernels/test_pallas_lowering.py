"""The Pallas kernels lower for the chips they are written for, on a machine without them: Triton (GPU) and Mosaic
(TPU) lowering check block shapes, memory layouts and every op in the kernels, which interpret mode does not."""
import jax
import jax.numpy as jnp
import pytest

from jalign.kernels.pallas import token_logprobs_pallas

PLATFORM = {"gpu": ("cuda", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("shape,dtype", [((8192, 2048, 128256), jnp.bfloat16), ((300, 576, 32003), jnp.float32)])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_value_and_gradient_lower_for_the_chip(backend, shape, dtype, softcap):
  t, d, v = shape
  platform, custom_call = PLATFORM[backend]
  f = jax.jit(jax.value_and_grad(
      lambda h, w, y: jnp.sum(token_logprobs_pallas(h, w, y, backend=backend, softcap=softcap)[0]), argnums=(0, 1)))
  sd = jax.ShapeDtypeStruct
  text = f.trace(sd((t, d), dtype), sd((d, v), dtype), sd((t,), jnp.int32)).lower(
      lowering_platforms=(platform,)).as_text()
  # One forward kernel; the backward is one kernel on GPU, two on TPU.
  assert text.count(custom_call) == (2 if backend == "gpu" else 3)


def _tpu_compile(impl, shape, mesh_shape=(1, 1, 1)):
  """value + gradient of token_logprobs (logp + 0.1 entropy) compiled for TPU v5e chips: the compiled program and
  the bytes it needs beyond arguments and outputs (`tpu_target.temporaries`)."""
  from jalign import parallel
  from jalign.kernels import token_logprobs
  from jalign.parallel import tpu_target
  t, d, v = shape
  mesh = parallel.mesh_from_config(mesh_shape, devices=tpu_target.target("v5e:2x2").devices)
  rows = jax.sharding.PartitionSpec(("data", "fsdp"))

  def sd(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, spec))

  def loss(h, w, y):
    logp, entropy, _ = token_logprobs(h, w, y, impl=impl)
    return jnp.sum(logp) + 0.1 * jnp.sum(entropy)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        sd((t, d), jnp.bfloat16, rows), sd((d, v), jnp.bfloat16, jax.sharding.PartitionSpec()),
        sd((t,), jnp.int32, rows)).compile()
  return compiled, tpu_target.temporaries(compiled.memory_analysis())


@pytest.mark.parametrize("shape", [(8192, 2048, 128256), (8192, 3584, 151936), (8192, 3584, 152064)])
def test_pallas_tpu_compiled_for_a_tpu_needs_under_2_percent_of_xla(shape):
  """The statistics stay on chip as [tokens, 1] accumulators and the gradients are written once in bf16 from fp32
  VMEM scratch: per-tile [vocab blocks, tokens, 1] statistics padded to 128 lanes needed 8,016 MiB here, twice
  `xla`'s 4,008 MiB, at the first shape."""
  _, dense = _tpu_compile("xla", shape)
  _, fused = _tpu_compile("pallas_tpu", shape)
  assert fused <= 0.02 * dense, (fused, dense)


def test_auto_picks_the_tpu_kernel_for_a_tpu_target_on_a_sharded_mesh():
  """On four chips with the rows split over fsdp the kernel runs under shard_map (Mosaic is not auto-partitioned)."""
  compiled, _ = _tpu_compile("auto", (1024, 256, 8192), mesh_shape=(1, 4, 1))
  assert "tpu_custom_call" in compiled.as_text()
