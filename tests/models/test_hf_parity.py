"""Logits match transformers on tiny random models of every supported family, with left padding."""
import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jalign import models
from tests import hf_reference as ref

FAMILIES = sorted(ref.FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request, tmp_path_factory):
  model = ref.build(request.param)
  path = ref.save(model, tmp_path_factory.mktemp(request.param))
  return request.param, model, path


def test_fp32_logits_match_transformers_with_left_padding(family_ckpt):
  family, model, path = family_ckpt
  lm = models.from_pretrained(path, dtype="float32")
  ids, mask = ref.batch(model.config.vocab_size)
  want = ref.hf_logits(model, ids, mask)
  got = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  assert got.shape == want.shape
  assert ref.max_diff(got, want, mask) <= 1e-4, family
  # Left padding changes nothing: the padded row equals the same tokens run alone.
  alone = np.asarray(lm(jnp.asarray(ids[2:, 5:])))
  np.testing.assert_allclose(got[2, 5:], alone[0], atol=1e-4)


def test_chunked_attention_logits_match_transformers(family_ckpt, monkeypatch):
  """The flash-attention form, in blocks of 4 (so windows, padding and causality skip some block pairs)."""
  from jalign.kernels import attn as attention_lib
  monkeypatch.setattr(attention_lib, "BLOCKS", (4, 4))
  family, model, path = family_ckpt
  lm = models.from_pretrained(path, dtype="float32", attention="chunked")
  ids, mask = ref.batch(model.config.vocab_size)
  want = ref.hf_logits(model, ids, mask)
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), want, mask) <= 1e-4, family


def test_bf16_stored_weights_load_exactly(family_ckpt, tmp_path):
  family, model, _ = family_ckpt
  # An fp32 reference whose weights are exactly bf16 values, saved as bf16. (Converting the bf16 model back with
  # .float() would keep HF buffers such as Gemma's embedding scale rounded to bf16.)
  model_fp32 = ref.build(family)
  with torch.no_grad():
    for p in model_fp32.parameters():
      p.copy_(p.to(torch.bfloat16).float())
  path = ref.save(copy.deepcopy(model_fp32).to(torch.bfloat16), tmp_path / "bf16")
  assert json.load(open(f"{path}/config.json")).get("dtype") == "bfloat16"
  lm = models.from_pretrained(path, dtype="float32")
  ids, mask = ref.batch(model.config.vocab_size)
  want = ref.hf_logits(model_fp32, ids, mask)
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), want, mask) <= 1e-4, family
  # Loaded without a dtype, the checkpoint's bf16 is kept.
  assert models.from_pretrained(path).layers.o[...].dtype == jnp.bfloat16


def test_bf16_compute_is_close(family_ckpt):
  family, model, path = family_ckpt
  lm = models.from_pretrained(path, dtype="bfloat16")
  ids, mask = ref.batch(model.config.vocab_size)
  want = ref.hf_logits(model, ids, mask)
  routes = None
  if lm.cfg.num_experts:  # the fp32 choices: a near-tie token routed elsewhere in bf16 is not a precision error
    _, _, routing = models.from_pretrained(path, dtype="float32").forward_routed(jnp.asarray(ids), jnp.asarray(mask))
    routes = routing.ids_BxTxK
  got = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask), route_ids=routes))
  scale = np.abs(want).max()
  assert ref.max_diff(got, want, mask) <= 0.05 * scale, family
