"""LoRA adapters: the adapter-on forward against an independent torch LoRA on the transformers model (forward hooks
adding scale * x @ A @ B to each targeted Linear), merged export loaded back by transformers, target selection."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jalign import models
from jalign.models import lora
from jalign.models.kv_cache import KVCache
from tests import hf_reference as ref

HF_NAMES = {name: hf for name, (hf, _) in lora.PROJECTIONS.items()}


def _randomise_adapters(lm, seed=1, scale=0.2):
  rng = np.random.RandomState(seed)
  for name in vars(lm.layers):
    if name.endswith(lora.SUFFIX_B) or name.endswith(lora.SUFFIX_A):
      p = getattr(lm.layers, name)
      p[...] = jnp.asarray(rng.normal(0, scale, p.shape), p[...].dtype)


def _torch_lora_logits(model, lm, cfg: lora.LoraConfig, ids, mask):
  """transformers logits with LoRA added by hooks from the adapter tensors (per layer, flattened to 2-D)."""
  hooks = []
  for name in lora.model_targets(lm.layers, cfg):
    if name in lora.EXPERTS:  # routed experts: no Linear modules to hook (transformers 5 fuses them)
      continue
    a = np.asarray(getattr(lm.layers, name + lora.SUFFIX_A)[...], np.float32)
    b = np.asarray(getattr(lm.layers, name + lora.SUFFIX_B)[...], np.float32)
    for j, i in enumerate(lm.cfg.stacked_layers(name)):  # the layers this projection (and adapter) has
      hf = HF_NAMES[name]
      if lm.cfg.model_type == "deepseek_v3":  # its shared experts' module
        hf = hf.replace("mlp.shared_expert.", "mlp.shared_experts.")
      module = model.model.layers[i].get_submodule(hf)
      a_i = torch.tensor(a[j].reshape(-1, cfg.rank))
      b_i = torch.tensor(b[j].reshape(cfg.rank, -1))
      hooks.append(module.register_forward_hook(
          lambda mod, inp, out, a_i=a_i, b_i=b_i: out + cfg.scale * (inp[0] @ a_i) @ b_i))
  try:
    return ref.hf_logits(model, ids, mask)
  finally:
    for h in hooks:
      h.remove()


@pytest.mark.parametrize("family,targets", [("llama", ("all-linear",)), ("qwen2", ("q_proj", "v_proj", "down")),
                                            ("qwen2_moe", ("all-linear",)), ("qwen3_moe", ("all-linear",)),
                                            ("qwen3_moe_dense_layers", ("all-linear",)), ("gpt_oss", ("all-linear",)),
                                            ("deepseek_v3", ("all-linear",))])
def test_adapter_forward_matches_torch_lora_and_merged_export(family, targets, tmp_path):
  """MoE models: all-linear takes the attention (DeepSeek-V3's latent projections), the shared expert (Qwen2-MoE,
  DeepSeek-V3) and the dense layers' MLP, and the routed experts (one adapter each). The hooks add the dense
  projections' adapters; with the experts' own randomised too, the reference is transformers on the merged export
  (its expert loop over W + scale A B, ours the grouped matmuls of W and of A, B). DeepSeek-V3's decoding folds
  kv_b's adapter into its absorbed form: a prefill into a cache gives the same logits."""
  model = ref.build(family)
  lm = models.from_pretrained(ref.save(model, tmp_path / "in"))
  ids, mask = ref.batch(model.config.vocab_size)
  base = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=targets)
  lora.add_adapters(lm, cfg, seed=3)
  fresh = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  np.testing.assert_allclose(fresh, base, atol=1e-6)  # B starts at zero: a fresh adapter changes nothing

  experts, attn, mlp = ("expert_gate", "expert_up", "expert_down"), ("q", "k", "v", "o"), ("gate", "up", "down")
  shared = ("shared_gate", "shared_up", "shared_down")
  want = {"llama": attn + mlp, "qwen2": ("q", "v", "down"), "qwen2_moe": attn + experts + shared,
          "qwen3_moe": attn + experts, "qwen3_moe_dense_layers": attn + mlp + experts, "gpt_oss": attn + experts,
          "deepseek_v3": ("o",) + mlp + experts + shared + ("q_a", "q_b", "kv_a", "kv_b")}[family]
  assert lora.model_targets(lm.layers, cfg) == want
  _randomise_adapters(lm)
  if lm.cfg.num_experts:
    assert lm.layers.expert_gate_lora_a.shape == (*lm.layers.expert_gate.shape[:3], 4)
    with_experts = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
    for name in experts:  # the hooked reference covers the dense projections' adapters
      getattr(lm.layers, name + lora.SUFFIX_B)[...] = jnp.zeros_like(getattr(lm.layers, name + lora.SUFFIX_B)[...])
  ours = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  theirs = _torch_lora_logits(model, lm, cfg, ids, mask)
  assert ref.max_diff(ours, theirs, mask) <= 1e-4
  assert ref.max_diff(ours, base, mask) > 1e-2  # the adapters do something
  if lm.cfg.num_experts:
    _randomise_adapters(lm)
    ours = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_array_equal(ours, with_experts)
    assert ref.max_diff(ours, theirs, mask) > 1e-3  # the experts' adapters do something

  models.save_pretrained(lm, tmp_path / "merged")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
  assert ref.max_diff(ref.hf_logits(back, ids, mask), ours, mask) <= 1e-4
  if family == "deepseek_v3":  # a prefill into a decoding cache: the absorbed form, kv_b's adapter folded in
    hidden, _ = lm.forward(jnp.asarray(ids), jnp.asarray(mask), cache=KVCache.init(lm.cfg, *ids.shape))
    assert ref.max_diff(lm.logits(hidden), ours, mask) <= 1e-4


def test_partition_disable_and_targets():
  cfg = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=8)
  lm = lora.add_adapters(models.create(cfg), lora.LoraConfig(rank=2, targets=("self_attn.(q|v)_proj",)))
  params = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
  trainable, frozen = lora.partition(params)
  assert sorted(trainable["layers"]) == ["q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b"]
  assert "q_lora_a" not in frozen["layers"] and "q" in frozen["layers"] and "embed" in frozen
  whole = lora.combine(trainable, frozen)
  assert jax.tree.structure(whole) == jax.tree.structure(params)
  assert whole["layers"]["q"] is params["layers"]["q"]  # nothing copied
  off = lora.disabled(params)
  assert not np.any(np.asarray(off["layers"]["q_lora_b"])) and off["embed"] is params["embed"]
  assert off["layers"]["q_lora_a"] is not params["layers"]["q_lora_a"]  # never aliases the trained adapters
  assert lora.resolve_targets(("all-linear",)) == tuple(lora.PROJECTIONS)
  # An HF module name matches the routed and shared experts' projections of that name too (as PEFT's modules).
  assert lora.resolve_targets(("gate_proj", "up")) == ("gate", "up", "expert_gate", "shared_gate")
  with pytest.raises(ValueError, match="matches no projection; accepted: 'all-linear', q_proj"):
    lora.resolve_targets(("qkv_proj",))
  with pytest.raises(ValueError, match="already has LoRA"):
    lora.add_adapters(lm, lora.LoraConfig(rank=2))


def test_dropout_only_with_a_key():
  cfg = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=8)
  lm = lora.add_adapters(models.create(cfg), lora.LoraConfig(rank=2, dropout=0.5))
  _randomise_adapters(lm)
  ids = jnp.arange(12).reshape(2, 6)
  plain, _ = lm.forward(ids)
  again, _ = lm.forward(ids)
  dropped, _ = lm.forward(ids, dropout_rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(again))
  assert float(jnp.max(jnp.abs(dropped - plain))) > 1e-3


@pytest.mark.long  # CI time; kernels/test_moe checks routed-expert adapter dropout
def test_dropout_with_adapters_on_routed_experts_acts_only_in_training_forwards():
  """all-linear with dropout on an MoE model: the experts' adapters too (tests/kernels/test_moe.py checks the
  masks); a forward without a dropout key is the eval forward, one with a key differs, and gradients reach every
  adapter through it."""
  cfg = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=8, model_type="mixtral", num_experts=4, experts_per_token=2,
                           moe_intermediate_size=8, norm_topk_prob=True)
  lm = lora.add_adapters(models.create(cfg), lora.LoraConfig(rank=2, dropout=0.3))
  assert lora.model_targets(lm.layers, lm.layers.lora) == ("q", "k", "v", "o") + lora.EXPERTS
  _randomise_adapters(lm)
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 9)))
  plain = lm.forward(ids)[0]
  np.testing.assert_array_equal(lm.forward(ids)[0], plain)
  dropped = lm.forward(ids, dropout_rng=jax.random.key(1))[0]
  assert float(jnp.abs(dropped - plain).max()) > 1e-4
  graphdef, params = nnx.split(lm)
  grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p).forward(ids, dropout_rng=jax.random.key(1))[0] ** 2))(
      params)
  for name in lora.EXPERTS:
    assert float(jnp.abs(grads["layers"][name + lora.SUFFIX_A][...]).max()) > 0, name