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
