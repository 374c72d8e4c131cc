"""llama.cpp GGUF files in (`from_pretrained` on a `.gguf`): SmolLM2-135M-Instruct's Q4_1 file against transformers'
own GGUF import, then the model as a user drives it: chat-templated GSM8K prompts, left-padded, greedy for 64 tokens
against transformers' `generate`."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jalign import models, sampling, tokenizer
from jalign.data.sources import open_source
from jalign.models.safetensors_io import CheckpointError
from jalign.rl.rollout import encode_prompt, left_pad
from tests import realdata
from tests.realdata import smollm2_hf  # noqa: F401  (the session fixture)


def test_gguf_import_equals_transformers_conversion(smollm2_hf):  # noqa: F811
  path, _ = smollm2_hf   # transformers' GGUF import, saved as an HF directory in fp32
  ours = models.from_pretrained(realdata.path(realdata.SMOLLM2_GGUF), dtype="float32")
  theirs = models.from_pretrained(path, dtype="float32")
  assert ours.cfg == theirs.cfg
  a, b = nnx.to_pure_dict(nnx.state(ours, nnx.Param)), nnx.to_pure_dict(nnx.state(theirs, nnx.Param))
  leaves = jax.tree.leaves_with_path(a)
  assert len(leaves) == len(jax.tree.leaves(b)) > 5
  for (where, x), y in zip(leaves, jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(where))


def test_smollm2_greedy_equals_generate_on_gsm8k_prompts(smollm2_hf):  # noqa: F811
  path, model = smollm2_hf
  tok = tokenizer.load(path)
  source = open_source(realdata.path("gsm8k/train.jsonl"))
  prompts = [encode_prompt(source[i], tok, index=i, where=source.where(i), max_length=512) for i in (0, 7, 300, 4000)]
  assert len({len(p.ids) for p in prompts}) > 1          # uneven: rows are left-padded
  ids, mask = left_pad(prompts, tok.pad_id)
  lm = models.from_pretrained(realdata.path(realdata.SMOLLM2_GGUF), dtype="float32")
  with torch.no_grad():
    logits = model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
  ours = np.asarray(lm(jnp.asarray(ids), jnp.asarray(mask)))
  real = mask.astype(bool)
  assert np.abs(ours[real] - logits[real]).max() <= 2e-4 * max(1.0, np.abs(logits[real]).max() / 40)
  out = sampling.generate(lm, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0), max_new_tokens=64,
                          temperature=0.0, stop_token_ids=(tok.eos_id,), pad_id=tok.pad_id)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  with torch.no_grad():
    want = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask), do_sample=False,
                          max_new_tokens=64, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id).numpy()[:, ids.shape[1]:]
  for row in range(len(prompts)):
    theirs = list(want[row])
    if tok.eos_id in theirs:
      theirs = theirs[:theirs.index(tok.eos_id) + 1]
    assert list(tokens[row, :lengths[row]]) == theirs, (row, tok.decode(theirs))
  assert lengths.max() == 64 or (tokens == tok.eos_id).any()


def test_bad_gguf_files_are_named(tmp_path):
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"GGUF" + os.urandom(64))
  with pytest.raises(CheckpointError, match="junk.gguf: not a readable GGUF file"):
    models.from_pretrained(str(junk))
  import gguf
  writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
  writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(CheckpointError, match="GGUF architecture 'phi2' is not supported; supported: llama, qwen2"):
    models.from_pretrained(str(tmp_path / "phi.gguf"))
