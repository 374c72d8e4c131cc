"""Evaluation metrics against independent references: pass@k against the exact combinatorial probability, win
rates with ties, and configs/eval.py on a tiny transformers checkpoint (not made by jalign): its perplexity equals the
one computed from transformers' own logits, and against itself the win rate is 1/2 and the KL 0."""
import itertools
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
import transformers

from jalign.data import sft as sft_data
from jalign.data.sources import open_source
from jalign.eval.policy import pass_at_k, win_rate
from jalign.tokenizers import tokenizer as tokenizer_lib
from tests import cli
from tests.configs_util import ROOT

ARITH_TOKENIZER = os.path.join(ROOT, "jalign", "assets", "arith_tokenizer")


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 2), (4, 4, 4), (8, 1, 8), (7, 5, 3)])
def test_pass_at_k_is_the_probability_that_k_draws_contain_a_correct_one(n, c, k):
  samples = [1] * c + [0] * (n - c)
  draws = list(itertools.combinations(range(n), k))
  exact = sum(any(samples[i] for i in d) for d in draws) / len(draws)
  assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
  assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_win_rate_counts_ties_half():
  r = win_rate([1, 0, 1, 0.5, 0.2], [0, 0, 1, 0.7, 0.1])
  assert (r["wins"], r["ties"], r["losses"]) == pytest.approx((0.4, 0.4, 0.2))
  assert r["win_rate"] == pytest.approx(0.6)


def _foreign_checkpoint(path):
  """A tiny random Llama saved by transformers, with the arithmetic tokenizer's files beside it."""
  tok = tokenizer_lib.load(ARITH_TOKENIZER)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=128, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                                    bos_token_id=None)
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(path)
  for name in os.listdir(ARITH_TOKENIZER):
    shutil.copy(os.path.join(ARITH_TOKENIZER, name), path)
  return model, tok


def _transformers_perplexity(model, tok, spec, max_length=128):
  source = open_source(spec)
  nll, count = 0.0, 0
  for i in range(len(source)):
    e = sft_data.encode(source[i], tok, max_length=max_length)
    ids = torch.tensor(np.asarray(e["tokens"])[None].astype(np.int64))
    with torch.no_grad():
      logp = torch.log_softmax(model(ids).logits.double(), -1)[0]
    target = ids[0, 1:]
    mask = torch.tensor(np.asarray(e["loss_mask"])[1:].astype(np.float64))
    nll -= float((logp[:-1].gather(1, target[:, None])[:, 0] * mask).sum())
    count += float(mask.sum())
  return math.exp(nll / count)


def test_eval_config_on_a_transformers_checkpoint(tmp_path):
  ckpt = str(tmp_path / "foreign")
  model, tok = _foreign_checkpoint(ckpt)
  # held-out SFT data: a small JSONL of prompt/completion records
  sft_file = tmp_path / "heldout.jsonl"
  with open(sft_file, "w") as f:
    for a, b in [(3, 4), (12, 30), (7, 8), (45, 2), (9, 9)]:
      f.write(json.dumps({"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"}) + "\n")
  run_dir = tmp_path / "eval"
  proc = cli.run("eval.py:tiny", run_dir, f"--config.model.path={ckpt}", f"--config.eval.reference={ckpt}",
                 f"--config.eval.sft_data={sft_file}")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  out = json.loads((run_dir / "eval.json").read_text())
  assert out["eval/prompts"] == 16
  assert out["eval/win_rate"] == 0.5 and out["eval/ties"] == 1.0  # the same greedy answers
  assert abs(out["eval/kl_to_reference"]) < 1e-4
  assert 0 <= out["eval/pass@1"] <= out["eval/pass@2"] <= 1
  assert out["eval/perplexity"] == pytest.approx(_transformers_perplexity(model, tok, str(sft_file)), rel=1e-4)
