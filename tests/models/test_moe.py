"""Mixture-of-Experts models beyond the per-family parity tests (tests/models/test_hf_parity.py, test_roundtrip.py):
transformers 5's fused expert tensors read like the hub's per-expert ones, parameter counts equal transformers',
an MoE model sharded over an 8-device mesh equals one device (value and gradient), layouts not supported yet are
refused by name."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
from flax import nnx

from jalign import models
from jalign.core.errors import ConfigError
from jalign.models.hf_config import from_hf_config
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
  f = getattr(c, "moe_intermediate_size", None) or c.intermediate_size  # Mixtral, gpt-oss: intermediate_size
  per_expert = 3 * c.hidden_size * f + (2 * f + c.hidden_size if family == "gpt_oss" else 0)  # gpt-oss: biases
  sparse = c.num_hidden_layers - len(getattr(c, "mlp_only_layers", None) or []) - getattr(c, "first_k_dense_replace", 0)
  assert cfg.num_params() - cfg.num_params(active=True) == sparse * per_expert * (
      cfg.num_experts - cfg.experts_per_token)


def test_gpt_oss_mxfp4_experts_dequantise_on_load(tmp_path):
  """A gpt-oss checkpoint in the hub's layout: experts as MXFP4 `*_blocks` / `*_scales` (uint8). Loaded, they equal
  transformers' own dequantisation (`integrations.mxfp4.convert_moe_packed_tensors`) exactly, and the logits equal
  transformers' model holding those weights; an export writes the plain bf16 / fp32 layout."""
  import torch
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  model = ref.build("gpt_oss", intermediate_size=32)  # MXFP4 blocks of 32 along each projection's input
  rng = np.random.RandomState(0)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    e, d_in, d_out = state[name].shape
    blocks = torch.tensor(rng.randint(0, 256, (e, d_out, d_in // 32, 16)), dtype=torch.uint8)
    scales = torch.tensor(rng.randint(121, 125, (e, d_out, d_in // 32)), dtype=torch.uint8)
    plain = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert plain.shape == state[name].shape
    with torch.no_grad():
      model.get_parameter(name).copy_(plain)
    del state[name]
    state[name + "_blocks"], state[name + "_scales"] = blocks, scales
  hub = tmp_path / "hub"
  hub.mkdir()
  safetensors.torch.save_file(state, str(hub / "model.safetensors"))
  ref.save(model, tmp_path / "plain")  # the same weights, dequantised
  config = json.loads((tmp_path / "plain" / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
  (hub / "config.json").write_text(json.dumps(config))
  lm = models.from_pretrained(str(hub), dtype="float32")
  dense = models.from_pretrained(str(tmp_path / "plain"), dtype="float32")
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(lm)), nnx.to_pure_dict(nnx.state(dense)))
  ids, mask = ref.batch(model.config.vocab_size)
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), ref.hf_logits(model, ids, mask), mask) <= 1e-4
  models.save_pretrained(lm, tmp_path / "out")
  back = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))
  torch.testing.assert_close(back["model.layers.0.mlp.experts.gate_up_proj"],
                             model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"], rtol=0, atol=0)


# CI time: an expert axis alone (1, 1, 1, 6) in the long tier; (2, 1, 1, 3) splits the experts too
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 2, 2), (2, 1, 1, 3),
                                   pytest.param((1, 1, 1, 6), marks=pytest.mark.long)])
def test_an_moe_model_on_a_mesh_equals_one_device_value_and_gradient(shape, tmp_path):
  """fsdp over the model dimension, tensor over each expert's hidden dimension (and heads / shared MLP), expert over
  the 6 experts (expert parallelism: token copies exchanged by all-to-all; with 6 the batch's rows do not split over
  the data-parallel axes, so each device routes every row). Traced under the mesh, the experts run in `shard_map`;
  without it XLA partitions them."""
  model = ref.build("qwen2_moe")
  path = ref.save(model, tmp_path / "m")
  lm1 = models.from_pretrained(path)
  devices = jax.devices()[:int(np.prod(shape))]
  mesh = models.make_mesh(shape, devices)
  lm8 = models.from_pretrained(path, mesh=mesh)
  shards = lm8.layers.expert_gate[...].addressable_shards
  data, fsdp, tensor, expert = (tuple(shape) + (1,))[:4]
  assert {s.data.shape for s in shards} == {(3, 6 // expert, 32 // fsdp, 24 // tensor)}
  ids, mask = ref.batch(model.config.vocab_size)
  cot = jnp.asarray(np.random.RandomState(0).randn(*ids.shape, model.config.vocab_size), jnp.float32)

  def value_and_grad(lm, hlo=None):
    graphdef, params = nnx.split(lm)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(ids), jnp.asarray(mask)) * cot)  # noqa: E731
    step = jax.jit(jax.value_and_grad(loss))
    if hlo is not None:
      hlo.append(step.lower(params).as_text())
    return step(params)

  v1, g1 = value_and_grad(lm1)
  hlo = []
  with jax.set_mesh(mesh):
    in_mesh = value_and_grad(lm8, hlo)
  # Expert parallelism: the copies go out and come back by all-to-all, forward and backward (per layer, scanned).
  assert hlo[0].count("all_to_all") >= (4 if expert > 1 else 0) and ("all_to_all" in hlo[0]) == (expert > 1)
  for v8, g8 in (value_and_grad(lm8), in_mesh):
    np.testing.assert_allclose(v8, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _value_and_grad(model):
  """value_and_grad(lm): the jitted value and gradient of sum(logits x a fixed random cotangent) over `ref.batch`
  for `model`'s vocabulary (left-padded rows)."""
  ids, mask = (jnp.asarray(a) for a in ref.batch(model.config.vocab_size))
  cot = jnp.asarray(np.random.RandomState(0).randn(*ids.shape, model.config.vocab_size), jnp.float32)

  def value_and_grad(lm):
    graphdef, params = nnx.split(lm)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids, mask) * cot)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)
  return value_and_grad


def test_dense_and_sparse_layers_scanned_unrolled_rematerialised_and_sharded_agree(tmp_path):
  """A model whose dense layer sits between MoE ones runs as three scans (runs of alike layers); unrolled, with
  full remat, and on a (1, 2, 1, 2) mesh (expert parallel) it gives the same value and gradient."""
  model = ref.build("qwen3_moe_dense_layers")
  path = ref.save(model, tmp_path / "m")
  value_and_grad = _value_and_grad(model)
  lm = models.from_pretrained(path, dtype="float32")
  assert lm.layers.gate.shape == (1, 32, 64) and lm.layers.expert_gate.shape == (3, 6, 32, 24)
  v1, g1 = value_and_grad(lm)
  mesh = models.make_mesh((1, 2, 1, 2), jax.devices()[:4])
  with jax.set_mesh(mesh):
    sharded = value_and_grad(models.from_pretrained(path, dtype="float32", mesh=mesh))
  for knobs in (dict(scan_layers=False), dict(remat="full")):
    other = models.from_pretrained(path, dtype="float32")
    other.cfg = other.cfg.replace(**knobs)
    for v, g in (value_and_grad(other), sharded):
      np.testing.assert_allclose(v, v1, rtol=1e-5)
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_dense_and_sparse_layer_settings_and_unsupported_layouts():
  """transformers' rule: layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
  hf = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)
  assert from_hf_config(hf).num_experts == 6 and from_hf_config(hf).moe_layers == (0, 1, 2, 3)
  cfg = from_hf_config({**hf, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
  assert cfg.mlp_only_layers == (0, 2, 3) and cfg.moe_layers == (1,) and cfg.mlp_size == 64
  assert cfg.layer_runs() == [(0, 1), (1, 2), (2, 4)]
  assert cfg.stacked_layers("expert_up_lora_a") == (1,) and cfg.stacked_layers("down") == (0, 2, 3)
  assert cfg.stacked_layers("q") == (0, 1, 2, 3)
  with pytest.raises(ConfigError, match=r"m/config.json: decoder_sparse_step=1, mlp_only_layers=\[0, 1, 2, 3\] leave no"):
    from_hf_config({**hf, "mlp_only_layers": [0, 1, 2, 3]}, where="m/config.json")
  shared = {**hf, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 40}
  assert from_hf_config(shared).shared_expert_gate
  both = from_hf_config({**shared, "decoder_sparse_step": 2})  # dense layers beside MoE ones with a shared expert
  assert both.mlp_only_layers == (0, 2) and both.stacked_layers("shared_up") == (1, 3)
  assert both.stacked_layers("up") == (0, 2) and both.mlp_size == 64
  deepseek = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                  n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=8,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
  assert from_hf_config(deepseek).moe_layers == (1, 2, 3)
  with pytest.raises(ConfigError, match=r"n_group=3, topk_group=2: groups must split num_experts=8 evenly"):
    from_hf_config({**deepseek, "n_group": 3})
  with pytest.raises(ConfigError, match=r"the kept groups hold at least num_experts_per_tok=6"):
    from_hf_config({**deepseek, "num_experts_per_tok": 6})
  with pytest.raises(ConfigError, match=r"scoring_func='softmax'.*DeepSeek-V3 routing is scoring_func 'sigmoid'"):
    from_hf_config({**deepseek, "scoring_func": "softmax"})
  with pytest.raises(ConfigError, match=r"attention_bias=true"):
    from_hf_config({**deepseek, "attention_bias": True})
  with pytest.raises(ConfigError, match=r"mlp_only_layers=\[2, 1\]: must be distinct, ascending"):
    cfg.replace(mlp_only_layers=(2, 1))
  with pytest.raises(ConfigError, match=r"num_experts_per_tok=7: must be in \[1, num_experts=6\]"):
    from_hf_config({**hf, "num_experts_per_tok": 7})
  with pytest.raises(ConfigError, match="missing required key 'num_experts'"):
    from_hf_config({k: v for k, v in hf.items() if k != "num_experts"})


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_moe_dense_layers", "gpt_oss"])
def test_router_terms_equal_transformers_load_balancing_loss_with_padding(family, tmp_path):
  """`moe/aux_loss` is transformers 5's `load_balancing_loss_func` over every layer's router logits (padding masked),
  the z-loss ST-MoE's mean logsumexp^2, from the same forward."""
  import torch

  from jalign.objectives import router
  model = ref.build(family)
  lm = models.from_pretrained(ref.save(model, tmp_path / "m"), dtype="float32")
  ids, mask = ref.batch(model.config.vocab_size)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(positions), output_router_logits=True)
  _, _, routing = lm.forward_routed(jnp.asarray(ids), jnp.asarray(mask))
  penalty, metrics = router.terms(routing, lm.cfg, router.RouterLoss(aux=0.5, z=0.25))
  np.testing.assert_allclose(metrics["moe/aux_loss"], out.aux_loss.item(), rtol=1e-5)
  logits = np.stack([r.numpy() for r in out.router_logits]).astype(np.float64)  # [L, B*T, E]
  m = max_ = logits.max(-1, keepdims=True)
  lse = (np.log(np.exp(logits - m).sum(-1)) + max_[..., 0]).reshape(len(logits), *ids.shape)
  z = (lse ** 2 * mask).sum() / (mask.sum() * len(logits))
  np.testing.assert_allclose(metrics["moe/z_loss"], z, rtol=1e-5)
  np.testing.assert_allclose(penalty, 0.5 * out.aux_loss.item() + 0.25 * z, rtol=1e-5)
  assert float(metrics["moe/routing_mismatch"]) == 0.0
  assert 1.0 <= float(metrics["moe/expert_load_max"]) <= lm.cfg.num_experts / lm.cfg.experts_per_token
  assert 0 < float(metrics["moe/router_entropy"]) <= np.log(lm.cfg.num_experts)
  # The checkpoint's coefficient applies where transformers would train with it (output_router_logits), not in RL.
  assert router.coefficients(lm.cfg, router.RouterLoss(None)) == (0.0, 0.0)
  cfg = lm.cfg.replace(output_router_logits=True)
  aux, _ = router.coefficients(cfg, router.RouterLoss(None))
  assert aux == cfg.router_aux_loss_coef == model.config.router_aux_loss_coef
  assert router.coefficients(cfg, router.RouterLoss(None, rl=True)) == (0.0, 0.0)


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("qwen3_moe_dense_layers", marks=pytest.mark.long),
                                    "gpt_oss", "deepseek_v3"])  # CI time: dense layers next to sparse ones:
# test_dense_and_sparse_*
def test_routing_replay_routes_by_the_given_experts_and_changes_nothing_when_they_agree(family, tmp_path):
  """Replaying a forward's own choices gives the same hidden states (mismatch exactly 0); replaying another
  model's choices routes every token by them (the layer reports them as used, the mismatch counts the differences)
  and the router still gets gradients through the replayed experts' gate values. With dense layers between the MoE
  ones, routes cover the MoE layers only."""
  from jalign.objectives import router
  model = ref.build(family)
  lm = models.from_pretrained(ref.save(model, tmp_path / "m"), dtype="float32")
  ids, mask = ref.batch(model.config.vocab_size)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  hidden, _, own = lm.forward_routed(ids, mask)
  again, _, replayed = lm.forward_routed(ids, mask, route_ids=own.ids_BxTxK)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(hidden))
  np.testing.assert_array_equal(replayed.ids_BxTxK, own.ids_BxTxK)
  assert float(jnp.sum(replayed.mismatch_sum)) == 0.0

  assert own.ids_BxTxK.shape[0] == len(lm.cfg.moe_layers)
  other = models.from_pretrained(ref.save(ref.build(family, seed=5), tmp_path / "o"), dtype="float32")
  _, _, theirs = other.forward_routed(ids, mask)
  _, _, used = lm.forward_routed(ids, mask, route_ids=theirs.ids_BxTxK)
  np.testing.assert_array_equal(used.ids_BxTxK, theirs.ids_BxTxK)
  real = np.asarray(mask, bool)[None, :, :, None]
  differ_L = np.sum(np.any(np.asarray(own.ids_BxTxK)[..., :, None] == np.asarray(theirs.ids_BxTxK)[..., None, :],
                           axis=-2) == 0, axis=(1, 2, 3), where=real)
  # Compared, not replayed: the router's own choices are the plain forward's, so every layer's count is exact;
  # replayed, later layers see other inputs, so only the first layer's count is the plain forward's.
  _, _, compared = lm.forward_routed(ids, mask, route_ids=theirs.ids_BxTxK, replay=False)
  np.testing.assert_array_equal(compared.mismatch_sum, differ_L)
  assert float(used.mismatch_sum[0]) == differ_L[0] > 0
  _, metrics = router.terms(compared, lm.cfg, router.RouterLoss())
  np.testing.assert_allclose(metrics["moe/routing_mismatch"],
                             differ_L.sum() / (np.sum(mask) * len(lm.cfg.moe_layers) * 2), rtol=1e-6)

  graphdef, params = nnx.split(lm)
  grad = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p).forward_routed(ids, mask, route_ids=theirs.ids_BxTxK)[0]
                                    ** 2))(params)
  assert float(jnp.abs(grad["layers"]["router"][...]).max()) > 0
  if lm.cfg.router_score == "sigmoid":  # DeepSeek-V3's correction bias only steers the choice: never trained
    assert not np.any(np.asarray(grad["layers"]["router_correction_bias"][...]))


def test_deepseek_v3_multi_token_prediction_layers_are_skipped_by_name(tmp_path):
  """The hub's DeepSeek-V3 files carry its multi-token-prediction module as layer num_hidden_layers (transformers
  ignores it too): loading says so and skips it; any other stray tensor is still an error."""
  model = ref.build("deepseek_v3")
  path = ref.save(model, tmp_path / "m")
  file = str(tmp_path / "m" / "model.safetensors")
  state = safetensors.torch.load_file(file)
  n = model.config.num_hidden_layers
  state[f"model.layers.{n}.eh_proj.weight"] = state["model.layers.0.self_attn.o_proj.weight"].clone()
  safetensors.torch.save_file(state, file)
  with pytest.warns(UserWarning, match=rf"1 tensors of DeepSeek-V3's multi-token-prediction layers \(past layer {n-1}"):
    lm = models.from_pretrained(path, dtype="float32")
  ids, mask = ref.batch(model.config.vocab_size)
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), ref.hf_logits(model, ids, mask), mask) <= 1e-4
  state["model.layers.0.mlp.stray.weight"] = state.pop(f"model.layers.{n}.eh_proj.weight")
  safetensors.torch.save_file(state, file)
  with pytest.raises(Exception, match="unexpected weights for model_type 'deepseek_v3': model.layers.0.mlp.stray"):
    models.from_pretrained(path)


def test_deepseek_v3_on_an_expert_parallel_mesh_equals_one_device_value_and_gradient(tmp_path):
  """Multi-head latent attention with its heads over `tensor`, the shared experts and the dense first layer over
  fsdp x tensor, the routed experts over `expert` (all-to-all): value and gradient equal one device."""
  model = ref.build("deepseek_v3")
  path = ref.save(model, tmp_path / "m")
  value_and_grad = _value_and_grad(model)
  v1, g1 = value_and_grad(models.from_pretrained(path))
  mesh = models.make_mesh((1, 2, 2, 2), jax.devices()[:8])
  lm8 = models.from_pretrained(path, mesh=mesh)
  assert lm8.layers.kv_b[...].sharding.spec[2] == "tensor" and lm8.layers.expert_up[...].sharding.spec[1] == "expert"
  with jax.set_mesh(mesh):
    v8, g8 = value_and_grad(lm8)
  np.testing.assert_allclose(v8, v1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_router_settings_on_a_dense_model_or_a_task_without_router_terms_are_errors():
  from jalign.objectives import router
  from tests.configs_util import run_config
  dense = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=8)
  with pytest.raises(ConfigError, match=r"router_aux_loss=0.01, router_z_loss=0.0: the model \(llama\) has no experts"):
    router.coefficients(dense, router.RouterLoss(0.01, 0.0))
  assert router.coefficients(dense, router.RouterLoss(None)) == (0.0, 0.0)
  with pytest.raises(ConfigError, match=r"config.model.router_z_loss.*MoE router terms train with SFT, RM, DPO"):
    run_config("rollout", model__router_z_loss=0.001)
  for task, arg in (("grpo", "tiny"), ("rm", "tiny"), ("distill", "tiny,offline"), ("distill", "tiny,gkd")):
    run_config(task, arg, model__router_z_loss=0.001)


def test_upcycling_a_dense_model_keeps_its_function_and_exports(tmp_path):
  """Every expert a copy of the dense MLP, renormalised top-k gates: the upcycled model computes the dense one's
  logits (fp32, 1e-5); with noise the experts differ; the result saves and transformers loads it as Mixtral."""
  import transformers

  from jalign.models.upcycle import upcycle
  dense = models.from_pretrained(ref.save(ref.build("llama"), tmp_path / "dense"), dtype="float32")
  ids, mask = (jnp.asarray(a) for a in ref.batch(dense.cfg.vocab_size))
  moe = upcycle(dense, num_experts=4, experts_per_token=2)
  assert moe.cfg.model_type == "mixtral" and moe.cfg.num_experts == 4
  want = np.asarray(dense(ids, mask))
  np.testing.assert_allclose(np.asarray(moe(ids, mask)), want, atol=1e-5)
  noisy = upcycle(dense, num_experts=4, experts_per_token=2, noise=0.05, seed=1)
  gate = np.asarray(noisy.layers.expert_gate[...])
  assert np.abs(gate[:, 0] - gate[:, 1]).max() > 0
  assert 0 < np.abs(np.asarray(noisy(ids, mask)) - want).max() < 1.0
  models.save_pretrained(noisy, str(tmp_path / "moe"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe"), attn_implementation="eager").eval()
  assert type(hf).__name__ == "MixtralForCausalLM"
  assert ref.max_diff(noisy(ids, mask), ref.hf_logits(hf, np.asarray(ids), np.asarray(mask)), np.asarray(mask)) <= 1e-4
  with pytest.raises(ConfigError, match="already has 4 experts"):
    upcycle(noisy, num_experts=8, experts_per_token=2)


def _numpy_capacity_keep(ids, real, E, factor):
  """GShard's order, one choice at a time: all first choices (token order), then all second ones, ..."""
  N, K = ids.shape
  capacity = np.ceil(factor * real.sum() * K / E)
  used, keep = np.zeros(E), np.zeros((N, K), bool)
  for j in range(K):
    for n in range(N):
      if real[n] and used[ids[n, j]] < capacity:
        used[ids[n, j]] += 1
        keep[n, j] = True
  return keep


def test_capacity_drops_choices_past_each_experts_share_in_gshard_order(tmp_path):
  from jalign.models import moe as moe_block
  from jalign.objectives import router
  rng = np.random.RandomState(0)
  ids = np.stack([rng.choice(6, 2, replace=False, p=[.4, .3, .1, .1, .05, .05]) for _ in range(50)])
  real = (rng.rand(50) > 0.2).astype(np.float32)
  for factor in (0.5, 1.0, 1.25, 3.0):
    got = moe_block.capacity_keep(jnp.asarray(ids), jnp.asarray(real), 6, factor)
    np.testing.assert_array_equal(np.asarray(got), _numpy_capacity_keep(ids, real, 6, factor))

  path = ref.save(ref.build("qwen3_moe"), tmp_path / "m")
  ids_, mask = (jnp.asarray(a) for a in ref.batch(ref.build("qwen3_moe").config.vocab_size))
  dropless = models.from_pretrained(path, dtype="float32")
  hidden, _, own = dropless.forward_routed(ids_, mask)
  roomy = models.from_pretrained(path, dtype="float32", moe_capacity_factor=100.0)
  real = np.asarray(mask) > 0  # (padding's choices never count, so they are dropped: its states change)
  np.testing.assert_array_equal(np.asarray(roomy.forward_routed(ids_, mask)[0])[real], np.asarray(hidden)[real])
  tight = models.from_pretrained(path, dtype="float32", moe_capacity_factor=0.5)
  tight_hidden, _, routing = tight.forward_routed(ids_, mask)
  _, metrics = router.terms(routing, tight.cfg, router.RouterLoss())
  k, E = tight.cfg.experts_per_token, tight.cfg.num_experts
  # Layer 0 sees the same input either way: its drops are the numpy ones over the dropless routing's choices.
  keep0 = _numpy_capacity_keep(np.asarray(own.ids_BxTxK[0]).reshape(-1, k), np.asarray(mask).reshape(-1), E, 0.5)
  assert float(routing.dropped[0]) == float((~keep0 & (np.asarray(mask).reshape(-1, 1) > 0)).sum()) > 0
  assert 0.5 <= float(metrics["moe/dropped_tokens"]) < 1.0
  assert np.abs(np.asarray(tight_hidden) - np.asarray(hidden))[real].max() > 1e-3
  with pytest.raises(ConfigError, match="model.moe_capacity_factor.*RL and sampling route dropless"):
    from tests.configs_util import run_config
    run_config("grpo", model__moe_capacity_factor=1.25)


@pytest.mark.parametrize("arch, hf", [
    ("qwen3-30b-a3b", dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                           num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                           rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    ("gpt-oss-20b", dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                         num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         num_local_experts=32, num_experts_per_tok=4))])
def test_fit_presets_count_the_parameters_transformers_builds(arch, hf):
  """The `--arch` presets against transformers' models of the published shapes, built on the meta device (no
  memory): total parameters, and the config read back from the HF form equals the preset's checkpoint fields."""
  import torch
  import transformers

  from jalign import fit
  config = transformers.AutoConfig.for_model(**hf)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config)
  cfg = fit.arch_config(arch)
  assert cfg.num_params() == sum(p.numel() for p in model.parameters())
  back = from_hf_config(config.to_dict())
  for key in ("num_experts", "moe_intermediate_size", "attn_sinks", "router_bias", "expert_bias", "swiglu_limit",
              "layer_types", "sliding_window", "rope", "qkv_bias", "out_bias", "norm_topk_prob"):
    assert getattr(back, key) == getattr(cfg, key), key


def test_deepseek_v3_layers_compile_for_a_tpu_slice():
  """DeepSeek-V3's attention at its own head sizes (query/key heads of 128 + 64 RoPE dims, values of 128, a latent
  of 512, a query bottleneck) with its routing (sigmoid, 4 groups, 2 kept) and shared experts, a dense first layer,
  bf16, compiled for a v5e-4 slice over fsdp: a training step's value and gradient runs splash attention (at
  query/key heads of 192) and the megablox grouped matmuls (Mosaic kernels), and a decode step reads the latent cache,
  one head of 576 per token. Small model dims otherwise (CI time: the step's compile is about 100 s here)."""
  from jalign.models.kv_cache import KVCache
  from jalign.models.sharding import state_shardings
  from jalign.parallel import tpu_target
  cfg = models.ModelConfig(
      model_type="deepseek_v3", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2,
      num_heads=8, num_kv_heads=8, head_dim=192, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
      v_head_dim=128, rope_interleave=True, num_experts=8, experts_per_token=2, moe_intermediate_size=256,
      shared_expert_size=256, mlp_only_layers=(0,), router_score="sigmoid", expert_groups=4, groups_per_token=2,
      routed_scaling_factor=2.5, norm_topk_prob=True, param_dtype="bfloat16", dtype="bfloat16")
  assert cfg.cache_shape == (1, 576)
  mesh = models.make_mesh((1, 4, 1), tpu_target.target("v5e-4").devices)
  abstract = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(state),
                        nnx.to_pure_dict(state_shardings(abstract, mesh)))
  rows = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp")))
  ids = jax.ShapeDtypeStruct((4, 1024), jnp.int32, sharding=rows)

  def loss(p, ids):
    hidden = nnx.merge(graphdef, p).forward(ids)[0]
    return jnp.mean(hidden.astype(jnp.float32) ** 2)

  def decode(p, cache, token, position):
    return nnx.merge(graphdef, p).forward(token, positions=position, cache=cache)[0]

  with jax.set_mesh(mesh):
    step = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
    cache = jax.eval_shape(lambda: KVCache.init(cfg, 4, 1024))
    one = jax.ShapeDtypeStruct((4, 1), jnp.int32, sharding=rows)
    decoded = jax.jit(decode).lower(params, cache, one, one).compile()
  text = step.as_text()
  assert text.count("tpu_custom_call") >= 4  # splash forward and backward, megablox per projection
  assert tpu_target.temporaries(step.memory_analysis()) < 256 * 2**20
  assert cache.k[0].shape == (4, 1, 1024, 576) and decoded.memory_analysis() is not None

