"""The shipped tiny policy is what `python -m jalign.run --config=configs/sft.py` produces."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests import cli
from tests.cli import ROOT

SHIPPED = os.path.join(ROOT, "jalign", "assets", "tiny_policy")


def test_shipped_policy_loads_and_solves_some_but_not_all():
  from flax import nnx

  from jalign import models
  from jalign.data import sft as sft_data
  from jalign.data import synthetic
  from jalign.objectives import sft
  from jalign.tokenizers import tokenizer

  lm = models.from_pretrained(SHIPPED)
  tok = tokenizer.load(SHIPPED)
  examples = [sft_data.encode(r, tok, max_length=64) for r in synthetic.records("test")]
  graphdef, params = nnx.split(lm)
  acc = sft.exact_match(graphdef, nnx.to_pure_dict(params), examples)
  recorded = json.load(open(os.path.join(SHIPPED, "..", "tiny_policy.json")))
  assert acc == pytest.approx(recorded["eval/exact_match"], abs=1e-9)
  assert 0.05 < acc < 0.9  # some but not all held-out prompts


@pytest.mark.long  # 11 minutes alone on 2 AVX2 cores: `python -m pytest -m long`
def test_sft_config_reproduces_the_shipped_policy(tmp_path):
  cli.run("sft.py", tmp_path, "--config.log.tensorboard=False", one_device=True, check=True, timeout=1800)
  recorded = json.load(open(os.path.join(SHIPPED, "..", "tiny_policy.json")))
  final = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if "eval/exact_match" in l][-1]
  got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(os.path.join(SHIPPED, "model.safetensors"))
  assert set(got) == set(want)
  drift = max(float(np.abs(got[k] - want[k]).max()) for k in want)
  acc = final["eval/exact_match"]
  print(f"max |weight difference| vs shipped: {drift:.3g}; held-out exact match {acc} (shipped: "
        f"{recorded['eval/exact_match']})")
  if drift < 0.05:  # a CPU that rounds as the recording one did: the same policy
    assert abs(acc - recorded["eval/exact_match"]) <= 0.05
  else:
    # A CPU whose kernels round differently (another vector width): 1500 steps of this recipe, still climbing
    # steeply at its end, carry that elsewhere (a rounding change alone once ended it at 49.8%; benchmarks/README.md).
    # It must still train a policy that solves many but not all held-out prompts.
    assert 0.3 < acc < 0.9
