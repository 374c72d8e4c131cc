"""A real pretrained model at a long context: SmolLM2-135M-Instruct (30 layers, 9 heads over 3) on chat-templated
GSM8K conversations of ~1,000 tokens, left-padded, through the flash-attention kernel, against transformers."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jalign import models
from jalign.tokenizers import tokenizer
from tests import hf_reference as ref
from tests import realdata
from tests.realdata import smollm2_hf  # noqa: F401  (the session fixture)


def _long_conversations(tok, rows: int, tokens: int):
  """Each row: GSM8K question/answer pairs as user/assistant turns, rendered by the model's chat template, until
  `tokens` ids; row i keeps i * 150 fewer (left padding)."""
  records = [json.loads(line) for line in open(realdata.path("gsm8k/train.jsonl"), encoding="utf-8")][:80]
  ids = np.zeros((rows, tokens), np.int64)
  mask = np.zeros((rows, tokens), np.int64)
  for r in range(rows):
    messages, row = [], []
    for rec in records[r * 40:]:
      messages += [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
      row = tok.apply_chat_template(messages)
      if len(row) >= tokens:
        break
    keep = tokens - 150 * r
    ids[r, tokens - keep:], mask[r, tokens - keep:] = row[:keep], 1
  return ids, mask


@pytest.mark.parametrize("impl", [pytest.param("chunked", marks=pytest.mark.long), "auto"])  # auto takes chunked here
def test_smollm2_logits_at_1k_tokens_match_transformers(smollm2_hf, impl):  # noqa: F811
  path, model = smollm2_hf
  tok = tokenizer.load(path)
  ids, mask = _long_conversations(tok, rows=2, tokens=1024)
  lm = models.from_pretrained(path, dtype="float32", attention=impl)
  got = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  with torch.no_grad():
    want = ref.hf_logits(model, ids, mask)
  scale = np.abs(want[mask.astype(bool)]).max()
  # Measured: 1.45e-4 on logits of scale 44.4, with either impl (auto takes chunked at 1024 keys).
  assert ref.max_diff(got, want, mask) <= 2e-5 * scale, (ref.max_diff(got, want, mask), scale)


@pytest.mark.long  # CI time: the zig-zag path on tiny models: tests/train/test_context_parallel.py
def test_smollm2_over_four_sequence_shards_matches_transformers(smollm2_hf):  # noqa: F811
  """The same conversations with the tokens over a `sequence` axis of 4 (rows over 2 data shards): zig-zag order in
  the decoder, ring attention between the shards; the logits in the tokens' own order match transformers as closely
  as one device's do."""
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  from jalign.kernels.zigzag import balanced_order
  path, model = smollm2_hf
  tok = tokenizer.load(path)
  ids, mask = _long_conversations(tok, rows=2, tokens=1024)
  lm = models.from_pretrained(path, dtype="float32", attention="chunked")
  mesh = models.make_mesh((2, 1, 1, 1, 4))
  with jax.set_mesh(mesh):
    assert balanced_order(1024)  # the decoder lays the tokens out in zig-zag order
    graphdef, params = nnx.split(lm)
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    forward = jax.jit(lambda p, i, m: nnx.merge(graphdef, p)(i, m))
    got = np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(mask)))
  with torch.no_grad():
    want = ref.hf_logits(model, ids, mask)
  scale = np.abs(want[mask.astype(bool)]).max()
  assert ref.max_diff(got, want, mask) <= 2e-5 * scale, (ref.max_diff(got, want, mask), scale)
