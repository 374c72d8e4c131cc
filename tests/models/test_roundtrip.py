"""save_pretrained -> transformers loads the same model; sharded checkpoints; both config.json layouts."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jalign import models
from tests import hf_reference as ref


@pytest.mark.parametrize("family", sorted(ref.FAMILIES))
def test_save_pretrained_reloads_in_transformers(family, tmp_path):
  model = ref.build(family)
  lm = models.from_pretrained(ref.save(model, tmp_path / "in"))
  models.save_pretrained(lm, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
  ids, mask = ref.batch(model.config.vocab_size)
  assert ref.max_diff(ref.hf_logits(back, ids, mask), ref.hf_logits(model, ids, mask), mask) <= 1e-5
  assert type(back) is type(model)
  assert os.path.exists(tmp_path / "out" / "generation_config.json")


def test_sharded_checkpoint_with_index_loads(tmp_path):
  model = ref.build("qwen2")
  src = ref.save(model, tmp_path / "hf_sharded", max_shard_size="30KB")
  assert os.path.exists(f"{src}/model.safetensors.index.json")
  assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) > 2
  lm = models.from_pretrained(src)
  ids, mask = ref.batch(model.config.vocab_size)
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), ref.hf_logits(model, ids, mask), mask) <= 1e-4

  # jalign writes sharded checkpoints too, which both jalign and transformers read.
  models.save_pretrained(lm, tmp_path / "ours", max_shard_size="30KB")
  index = json.load(open(tmp_path / "ours" / "model.safetensors.index.json"))
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and all(os.path.exists(tmp_path / "ours" / s) for s in shards)
  again = models.from_pretrained(str(tmp_path / "ours"))
  np.testing.assert_array_equal(again(jnp.asarray(ids), jnp.asarray(mask)), lm(jnp.asarray(ids), jnp.asarray(mask)))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
  assert ref.max_diff(ref.hf_logits(back, ids, mask), ref.hf_logits(model, ids, mask), mask) <= 1e-5
  # A smaller re-save into the same directory leaves no stale shard behind.
  models.save_pretrained(lm, tmp_path / "ours")
  assert sorted(f for f in os.listdir(tmp_path / "ours") if f.endswith(".safetensors")) == ["model.safetensors"]
  assert not os.path.exists(tmp_path / "ours" / "model.safetensors.index.json")


def _to_old_layout(config: dict) -> dict:
  """The keys most published checkpoints carry: rope_theta / rope_scaling / torch_dtype (Gemma 3:
  rope_local_base_freq and sliding_window_pattern instead of per-layer-type rope_parameters / layer_types)."""
  config = dict(config)
  params = config.pop("rope_parameters")
  if "full_attention" in params:
    full, local = dict(params["full_attention"]), params["sliding_attention"]
    config["rope_local_base_freq"] = local["rope_theta"]
    params = full
  config["rope_theta"] = params.pop("rope_theta")
  if params.get("rope_type", "default") != "default":
    config["rope_scaling"] = params
  config["torch_dtype"] = config.pop("dtype", "float32")
  return config


@pytest.mark.parametrize("family", ["llama3_rope_tied", "llama_linear_rope_bias", "gemma3"])
def test_older_config_layout_reads_the_same(family, tmp_path):
  model = ref.build(family)
  path = ref.save(model, tmp_path / "m")
  new = models.from_pretrained(path)
  cfg_file = os.path.join(path, "config.json")
  old_cfg = _to_old_layout(json.load(open(cfg_file)))
  if family == "gemma3":  # layer pattern every 2nd layer global, as the reference model has
    old_cfg.pop("layer_types")
    old_cfg["sliding_window_pattern"] = 2
  json.dump(old_cfg, open(cfg_file, "w"))
  old = models.from_pretrained(path)
  assert old.cfg.rope == new.cfg.rope and old.cfg.local_rope == new.cfg.local_rope
  assert old.cfg.layer_types == new.cfg.layer_types
  ids, mask = ref.batch(model.config.vocab_size)
  np.testing.assert_array_equal(old(jnp.asarray(ids), jnp.asarray(mask)), new(jnp.asarray(ids), jnp.asarray(mask)))


def test_jalign_initialised_model_exports(tmp_path):
  """A model created from a jalign config (no HF origin) exports to a checkpoint transformers runs identically."""
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=1, head_dim=8, model_type="qwen3", qk_norm=True, tie_embeddings=True,
                           eos_token_id=(1, 2), bos_token_id=0)
  lm = models.Decoder(cfg, rngs=nnx.Rngs(3))
  models.save_pretrained(lm, tmp_path / "ex", dtype="float32")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ex", attn_implementation="eager").eval()
  ids, mask = ref.batch(64)
  assert ref.max_diff(ref.hf_logits(back, ids, mask), lm(jnp.asarray(ids), jnp.asarray(mask)), mask) <= 1e-5
  assert json.load(open(tmp_path / "ex" / "generation_config.json"))["eos_token_id"] == [1, 2]
