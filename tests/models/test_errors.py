"""Bad checkpoints fail with an error that names what is wrong, and where."""
import json
import os
import shutil

import numpy as np
import pytest
import safetensors.numpy
from tokenizers import Tokenizer
from tokenizers import models as tk_models

from jalign import models
from tests import hf_reference as ref


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  return ref.save(ref.build("llama"), tmp_path_factory.mktemp("good"))


@pytest.fixture
def ckpt(good, tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(good, path)
  return path


def _edit_config(path, **changes):
  cfg = json.load(open(path / "config.json"))
  cfg.update(changes)
  json.dump(cfg, open(path / "config.json", "w"))


def _edit_tensors(path, fn):
  tensors = safetensors.numpy.load_file(path / "model.safetensors")
  fn(tensors)
  safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_model_type_lists_supported(ckpt):
  _edit_config(ckpt, model_type="gpt2")
  with pytest.raises(models.ConfigError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral, "
                                               r"qwen2, qwen3, gemma2"):
    models.from_pretrained(str(ckpt))


def test_unsupported_rope_scaling(ckpt):
  _edit_config(ckpt, rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4})
  with pytest.raises(models.ConfigError,
                     match="rope type 'longrope' is not supported; accepted: default, linear, llama3, yarn"):
    models.from_pretrained(str(ckpt))
  _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
  with pytest.raises(models.ConfigError, match="yarn rope scaling needs key 'original_max_position_embeddings'"):
    models.from_pretrained(str(ckpt))


def test_malformed_config_json_names_line(ckpt):
  (ckpt / "config.json").write_text('{\n "model_type": "llama",\n "vocab_size": ,\n}')
  with pytest.raises(models.ConfigError, match=r"config.json:3: not valid JSON"):
    models.from_pretrained(str(ckpt))


def test_wrong_shape_names_tensor_expected_and_found(ckpt):
  _edit_tensors(ckpt, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((60, 32), np.float32)}))
  with pytest.raises(models.CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(60, 32\), "
                                                   r"expected \(64, 32\)"):
    models.from_pretrained(str(ckpt))


def test_missing_weight(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
  with pytest.raises(models.CheckpointError, match=r"missing weight 'model.layers.2.self_attn.k_proj.weight'"):
    models.from_pretrained(str(ckpt))


def test_unexpected_weight(ckpt):
  _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros((2,), np.float32)}))
  with pytest.raises(models.CheckpointError, match=r"unexpected weights for model_type 'llama': "
                                                   r"model.layers.0.self_attn.extra.weight"):
    models.from_pretrained(str(ckpt))


def test_missing_shard_file(tmp_path):
  path = ref.save(ref.build("llama"), tmp_path / "sharded", max_shard_size="30KB")
  index = json.load(open(f"{path}/model.safetensors.index.json"))
  victim = sorted(set(index["weight_map"].values()))[1]
  os.remove(os.path.join(path, victim))
  with pytest.raises(models.CheckpointError, match=f"lists shard '{victim}', which is missing"):
    models.from_pretrained(path)


def test_truncated_safetensors_file(ckpt):
  data = (ckpt / "model.safetensors").read_bytes()
  (ckpt / "model.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(models.CheckpointError, match="model.safetensors: truncated: tensor"):
    models.from_pretrained(str(ckpt))
  (ckpt / "model.safetensors").write_bytes(data[:5])
  with pytest.raises(models.CheckpointError, match="truncated safetensors file"):
    models.from_pretrained(str(ckpt))


def test_no_safetensors(ckpt):
  os.remove(ckpt / "model.safetensors")
  with pytest.raises(models.CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
    models.from_pretrained(str(ckpt))


def test_tokenizer_larger_than_vocab(ckpt):
  vocab = {f"t{i}": i for i in range(200)}  # the model's vocab_size is 96
  Tokenizer(tk_models.WordLevel(vocab, unk_token="t0")).save(str(ckpt / "tokenizer.json"))
  with pytest.raises(models.CheckpointError, match="the tokenizer has 200 tokens but config.json vocab_size is 96"):
    models.from_pretrained(str(ckpt))


def test_failed_save_leaves_previous_files_intact(good, tmp_path, monkeypatch):
  lm = models.from_pretrained(good)
  out = tmp_path / "out"
  models.save_pretrained(lm, out)
  before = (out / "model.safetensors").read_bytes()
  from jalign.models import safetensors_io
  real = safetensors_io.np.ascontiguousarray
  calls = {"n": 0}

  def failing(*a, **k):
    calls["n"] += 1
    if calls["n"] == 5:
      raise OSError("disk full")
    return real(*a, **k)

  monkeypatch.setattr(safetensors_io.np, "ascontiguousarray", failing)
  with pytest.raises(OSError, match="disk full"):
    models.save_pretrained(lm, out)
  assert (out / "model.safetensors").read_bytes() == before
