"""Mixture-of-Experts models beyond the per-family parity tests (tests/models/test_hf_parity.py, test_roundtrip.py):
transformers 5's fused expert tensors read like the hub's per-expert ones, parameter counts equal transformers',
an MoE model sharded over an 8-device mesh equals one device (value and gradient), layouts not supported yet are
refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
from flax import nnx

from jalign import models
from jalign.core.errors import ConfigError
from jalign.models.config import from_hf_config
from tests import hf_reference as ref


@pytest.mark.parametrize("family", ref.MOE_FAMILIES)
def test_fused_expert_tensors_load_like_the_hub_layout(family, tmp_path):
  """transformers 5 holds every expert of a layer in `mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj`
  [E, D, F] (Mixtral's router as `mlp.gate`); a checkpoint written in that form loads to the same model."""
  model = ref.build(family)
  hub = ref.save(model, tmp_path / "hub")
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
  (tmp_path / "fused").mkdir()
  safetensors.torch.save_file(state, str(tmp_path / "fused" / "model.safetensors"))
  (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
  a = nnx.to_pure_dict(nnx.state(models.from_pretrained(hub, dtype="float32")))
  b = nnx.to_pure_dict(nnx.state(models.from_pretrained(str(tmp_path / "fused"), dtype="float32")))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  ids, mask = ref.batch(model.config.vocab_size)
  lm = models.from_pretrained(str(tmp_path / "fused"), dtype="float32")
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), ref.hf_logits(model, ids, mask), mask) <= 1e-4


@pytest.mark.parametrize("family", ref.MOE_FAMILIES)
def test_parameter_counts_equal_transformers(family, tmp_path):
  model = ref.build(family)
  cfg = models.from_pretrained(ref.save(model, tmp_path / "m")).cfg
  assert cfg.num_params() == sum(p.numel() for p in model.parameters())
  c = model.config
  per_expert = 3 * c.hidden_size * (c.moe_intermediate_size if family != "mixtral" else c.intermediate_size)
  assert cfg.num_params() - cfg.num_params(active=True) == c.num_hidden_layers * per_expert * (
      cfg.num_experts - cfg.experts_per_token)


def test_an_moe_model_on_an_8_device_mesh_equals_one_device_value_and_gradient(tmp_path):
  """fsdp=4 over the model dimension, tensor=2 over each expert's hidden dimension (and heads / shared MLP)."""
  model = ref.build("qwen2_moe")
  path = ref.save(model, tmp_path / "m")
  lm1 = models.from_pretrained(path)
  lm8 = models.from_pretrained(path, mesh=models.make_mesh((1, 4, 2)))
  shards = lm8.layers.expert_gate[...].addressable_shards
  assert {s.data.shape for s in shards} == {(3, 6, 32 // 4, 24 // 2)}
  ids, mask = ref.batch(model.config.vocab_size)
  cot = jnp.asarray(np.random.RandomState(0).randn(*ids.shape, model.config.vocab_size), jnp.float32)

  def value_and_grad(lm):
    graphdef, params = nnx.split(lm)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(ids), jnp.asarray(mask)) * cot)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)

  (v1, g1), (v8, g8) = value_and_grad(lm1), value_and_grad(lm8)
  np.testing.assert_allclose(v8, v1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_unsupported_moe_layouts_are_refused_by_name():
  hf = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)
  assert from_hf_config(hf).num_experts == 6
  with pytest.raises(ConfigError, match=r"mlp_only_layers=\[0\] make layers \[1, 2, 3\] sparse"):
    from_hf_config({**hf, "mlp_only_layers": [0]}, where="m/config.json")
  with pytest.raises(ConfigError, match=r"decoder_sparse_step=2.*layers \[1, 3\] sparse"):
    from_hf_config({**hf, "decoder_sparse_step": 2})
  with pytest.raises(ConfigError, match=r"num_experts_per_tok=7: must be in \[1, num_experts=6\]"):
    from_hf_config({**hf, "num_experts_per_tok": 7})
  with pytest.raises(ConfigError, match="missing required key 'num_experts'"):
    from_hf_config({k: v for k, v in hf.items() if k != "num_experts"})
