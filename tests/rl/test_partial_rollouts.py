"""Partial rollouts (`grpo.partial_rollouts`): responses sampled a segment at a time, each segment by another policy,
keep per token the log-prob of the policy that drew it (checked against transformers on the prompt and all earlier
tokens, so a continued response is conditioned on everything before it); in a run, the rollout metrics report each
token's lag, none beyond the staleness bound, and a run killed with responses half sampled resumes bitwise."""
import json
import os
import signal

import jax
import numpy as np
import pytest
import torch

from jalign import models
from jalign.data.prompts import Prompt
from jalign.rl.partial import Partial
from jalign.rl.rollout import SamplingSection
from tests import hf_reference as ref
from tests.train.crash_util import hf_weights, run_faulty

STOP, MAX_NEW, SEGMENT = 7, 12, 4


class _Ids:
  """The token ids as they are (the models here are random: no text to decode)."""
  pad_id, eos_id = 0, STOP

  def decode(self, ids, **_):
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
  """Three policies (random llamas, seeds 0-2) standing for versions 0, 1, 2: (transformers, jalign) each."""
  out = []
  for seed in range(3):
    hf = ref.build("llama", seed=seed)
    out.append((hf, models.from_pretrained(ref.save(hf, tmp_path_factory.mktemp("m") / f"v{seed}"))))
  return out


def _reference_logp(hf, ids: list[int], start: int) -> np.ndarray:
  """log p(ids[t] | ids[:t]) for t >= start under the transformers model, fp32."""
  with torch.no_grad():
    logits = hf(torch.tensor([ids])).logits[0].float()
  return torch.log_softmax(logits, -1)[torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])].numpy()


@pytest.mark.parametrize("switch", [True, False], ids=["three-policies", "one-policy"])
def test_each_token_keeps_the_log_prob_and_version_of_the_policy_that_drew_it(versions, switch):
  rng = np.random.RandomState(0)
  prompts = [Prompt(i, rng.randint(8, 96, n).tolist(), "", None, f"t:{i}") for i, n in enumerate((5, 11, 8))]
  spec = SamplingSection(MAX_NEW, temperature=1.0, num_samples=3, slots=4)
  p = Partial.start(prompts, 3, MAX_NEW, pad_id=0)
  for v, limit in ((0, SEGMENT), (1, SEGMENT), (2, None)):
    p.advance(versions[v if switch else 0][1], _Ids(), jax.random.key(v), spec, v, limit)
  assert p.segments == 3 and not p.open().any()
  continued = 0
  for row in range(9):
    n, ids = int(p.lengths[row]), list(prompts[row // 3].ids)
    tokens, v = p.tokens[row, :n].tolist(), p.versions[row, :n]
    assert (p.versions[row, n:] == -1).all() and (p.tokens[row, n:] == 0).all()
    assert bool(p.stopped[row]) == (tokens[-1] == STOP) and STOP not in tokens[:-1]
    assert n == MAX_NEW or p.stopped[row]
    # segment j holds versions j: at most SEGMENT tokens each before the last, in order
    assert (np.diff(v) >= 0).all() and (v[:SEGMENT] == 0).all() and (v[SEGMENT:2 * SEGMENT] == 1).all()
    assert (v[2 * SEGMENT:] == 2).all()
    continued += int(n > 2 * SEGMENT)
    for version in np.unique(v):
      first = int(np.flatnonzero(v == version)[0])
      want = _reference_logp(versions[version if switch else 0][0], ids + tokens[:first + (v == version).sum()],
                             len(ids) + first)
      np.testing.assert_allclose(p.logprobs[row, first:first + len(want)], want, atol=2e-5,
                                 err_msg=f"row {row} version {version}")
  assert continued >= 3  # most rows ran into their third segment (random models seldom draw the stop token)


def test_partial_state_round_trips_through_json_exactly(versions):
  p = Partial.start([Prompt(0, [9, 10, 11], "q", "5", "t:0")], 2, MAX_NEW, pad_id=0)
  p.advance(versions[0][1], _Ids(), jax.random.key(0), SamplingSection(MAX_NEW, num_samples=2), 3, SEGMENT)
  back = Partial.from_json(json.loads(json.dumps(p.to_json())))
  assert back.prompts == p.prompts and back.n == 2 and back.segments == 1 and back.seconds == p.seconds
  for name in ("tokens", "logprobs", "versions", "lengths", "stopped"):
    a, b = getattr(p, name), getattr(back, name)
    assert a.dtype == b.dtype and np.array_equal(a, b), name


PARTIAL = ("--config.grpo.async_staleness=2", "--config.grpo.partial_rollouts=True", "--config.train.steps=5",
           "--config.checkpoint.async_save=False", "--config.policy_loss.rollout_is=token")
TIMING = ("timing_s/", "perf/", "time")


def _steps(run_dir):
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return {r["step"]: r for r in rows if "actor/pg_loss" in r}


def test_partial_rollouts_lag_per_token_within_the_bound_and_resume_bitwise(tmp_path):
  """Staleness 2, segments of 4 of the 8 new tokens: step 1 trains on the initial policy's rollout (lag 0), step 2 on
  one sampled wholly before step 1's update (lag 1); from step 3 each rollout's first segment is 2 updates old and
  the rest 1 (the responses that run past 4 tokens continued under the next policy). Killed after step 2's
  checkpoint, with step 3's rollout sampled and step 4's half sampled, the run resumes bitwise."""
  run_faulty("grpo", tmp_path / "straight", *PARTIAL)
  straight = _steps(tmp_path / "straight")
  lags = {s: (r["rollout/policy_lag_min"], r["rollout/policy_lag_max"]) for s, r in straight.items()}
  assert lags[1] == (0.0, 0.0) and lags[2] == (1.0, 1.0)
  for step in (3, 4, 5):
    assert lags[step] == (1.0, 2.0), (step, lags[step])
    assert 1.0 < straight[step]["rollout/policy_lag"] < 2.0
    # the token-level correction weights each token by pi_old / pi_its_version, all of them older policies here
    assert straight[step]["mismatch/rollout_is_mean"] != 1.0

  killed = run_faulty("grpo", tmp_path / "resumed", *PARTIAL, env={"KILL_AFTER_SAVE": "2"}, check=False)
  assert killed.returncode == -signal.SIGKILL
  host = tmp_path / "resumed" / "checkpoints" / "2" / "host"
  assert host.is_dir()
  drained = [a for a in PARTIAL if "partial_rollouts" not in a] + ["--config.grpo.partial_rollouts=False"]
  refused = run_faulty("grpo", tmp_path / "resumed", *drained, check=False)
  assert refused.returncode != 0
  assert "the checkpoint holds the half-sampled responses of steps [4]" in refused.stdout + refused.stderr
  run_faulty("grpo", tmp_path / "resumed", *PARTIAL)
  resumed = _steps(tmp_path / "resumed")
  for step in (3, 4, 5):
    for key, value in straight[step].items():
      if not key.startswith(TIMING):
        assert resumed[step][key] == value, (step, key)
  assert hf_weights(tmp_path / "resumed") == hf_weights(tmp_path / "straight")
