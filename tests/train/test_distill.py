"""The distillation task: its loss against TRL's divergence on transformers' logits, on-policy advantages against
the NumPy reverse-KL rewards of transformers' log-probs, GKD's samples against transformers' greedy decoding, the
teacher's vocabulary check, the config checks, and each mode end to end."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jalign import models
from jalign.core.errors import ConfigError
from jalign.losses.distill import on_policy_advantages
from jalign.objectives import distill as objective
from jalign.tasks import distill as distill_task
from jalign.train import loop
from jalign.train import optimizer as optim_lib
from tests import cli, hf_reference
from tests.configs_util import run_config
from tests.losses.test_distill import np_generalized_jsd

POLICY = os.path.join(os.path.dirname(models.__file__), "..", "assets", "tiny_policy")


def _log_softmax(z):
  z = np.float64(z)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("beta,temperature,sft_weight", [(0.0, 1.0, 0.0), (0.5, 2.0, 0.5), (1.0, 1.0, 0.0)])
def test_offline_loss_is_trls_divergence_of_transformers_logits(tmp_path, beta, temperature, sft_weight):
  """The offline / GKD loss over a batch: the generalized JSD (TRL 1.16's formula, in NumPy) of transformers' logits
  of a student and a wider teacher with 8 padded vocabulary rows (left out), summed over the completion tokens (the
  next token's loss mask, within its packed segment), plus sft_weight x their NLL; the weight is their count."""
  student_hf = hf_reference.build("llama", seed=1)
  teacher_hf = hf_reference.build("llama", seed=2, hidden_size=48, vocab_size=104)
  student = models.from_pretrained(hf_reference.save(student_hf, tmp_path / "s"))
  teacher = models.from_pretrained(hf_reference.save(teacher_hf, tmp_path / "t"))
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, 96, (2, 12)).astype(np.int32)
  segment = np.array([[1] * 7 + [2] * 5, [1] * 10 + [0] * 2], np.int32)  # two packed examples; padding
  positions = np.array([list(range(7)) + list(range(5)), list(range(10)) + [0, 0]], np.int32)
  loss_mask = np.array([[0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
  batch = {k: jnp.asarray(v) for k, v in dict(tokens=tokens, segment_ids=segment, positions=positions,
                                              loss_mask=loss_mask).items()}
  d = objective.DistillSection(teacher="t", beta=beta, temperature=temperature, sft_weight=sft_weight)
  s_graphdef, s_params = _split(student)
  t_graphdef, t_params = _split(teacher)
  loss_fn = objective.make_loss_fn(s_graphdef, t_graphdef, d, vocab=96)
  loss, weight, sums = jax.jit(loss_fn)((s_params, t_params), batch)

  expected, count, nll = 0.0, 0, 0.0
  for row in range(2):
    for seg in (1, 2):
      idx = np.flatnonzero(segment[row] == seg)
      if not len(idx):
        continue
      ids = tokens[row, idx][None].astype(np.int64)
      with torch.no_grad():
        zs = student_hf(input_ids=torch.tensor(ids)).logits[0].double().numpy()[:, :96]
        zt = teacher_hf(input_ids=torch.tensor(ids)).logits[0].double().numpy()[:, :96]
      div = np_generalized_jsd(zs, zt, beta, temperature)
      logp = _log_softmax(zs)
      for j in range(len(idx) - 1):
        if loss_mask[row, idx[j + 1]]:
          expected += div[j]
          nll -= logp[j, tokens[row, idx[j + 1]]]
          count += 1
  assert float(weight) == count == 13
  np.testing.assert_allclose(float(sums["distill/divergence"]), expected, rtol=2e-4)
  np.testing.assert_allclose(float(loss), expected + sft_weight * nll, rtol=2e-4)


def _split(lm):
  from flax import nnx
  graphdef, params = nnx.split(lm)
  return graphdef, nnx.to_pure_dict(params)


def test_on_policy_advantages_are_the_numpy_reverse_kl_rewards():
  rng = np.random.RandomState(0)
  student, teacher = rng.randn(3, 5) - 2, rng.randn(3, 5) - 2
  mask = (np.arange(5)[None] < np.array([[5], [3], [1]])).astype(np.int32)
  outcome = rng.randn(3, 1)
  got = on_policy_advantages(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask), coef=0.7,
                             outcome_BxT=jnp.asarray(outcome))
  np.testing.assert_allclose(got, (-0.7 * (student - teacher) + outcome) * mask, rtol=1e-6, atol=1e-7)
  got = on_policy_advantages(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask))
  np.testing.assert_allclose(got, (teacher - student) * mask, rtol=1e-6, atol=1e-7)


def _perturbed_teacher(path, seed=3, scale=0.05) -> str:
  """The shipped tiny policy with noise on every weight: a teacher that shares its tokenizer, distributions apart."""
  hf = transformers.AutoModelForCausalLM.from_pretrained(POLICY)
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in hf.parameters():
      p.add_(scale * torch.randn_like(p))
  hf.save_pretrained(path)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(POLICY, name), path)
  return str(path)


def _hf_response_logp(hf, batch) -> np.ndarray:
  """transformers' log-probs [N, R] of each row's response tokens after its left-padded prompt."""
  tokens, segment = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
  r = batch.response.shape[1]
  positions = np.maximum(np.cumsum(segment, 1) - 1, 0)
  with torch.no_grad():
    logits = hf(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(segment),
                position_ids=torch.tensor(positions)).logits.double().numpy()
  logp = _log_softmax(logits[:, -r - 1:-1])
  return np.take_along_axis(logp, np.asarray(batch.response)[..., None].astype(np.int64), -1)[..., 0]


def test_on_policy_step_advantages_are_the_reverse_kl_of_transformers_logprobs(tmp_path, monkeypatch):
  """One on-policy step: every sampled token's advantage is log pi_teacher - log pi_student of that token, both
  recomputed by transformers on the step's own rows (student: the shipped policy; teacher: a perturbed copy)."""
  teacher = _perturbed_teacher(tmp_path / "teacher")
  cfg = run_config("distill", "tiny", run_dir=str(tmp_path / "run"), model__path=POLICY, model__arch=None,
                   tokenizer="", distill__teacher=teacher, train__steps=1, grpo__eval_examples=0)
  seen = []
  original = distill_task.OnPolicyDistillTask.advantages

  def capture(self, batch, trained, kl_coef):
    out = original(self, batch, trained, kl_coef)
    seen.append(jax.device_get(out[0]))
    return out

  monkeypatch.setattr(distill_task.OnPolicyDistillTask, "advantages", capture)
  distill_task.run(cfg)
  (batch,) = seen
  mask = np.asarray(batch.response_mask)
  assert mask.sum() > 0
  student = _hf_response_logp(transformers.AutoModelForCausalLM.from_pretrained(POLICY), batch)
  teacher_logp = _hf_response_logp(transformers.AutoModelForCausalLM.from_pretrained(teacher), batch)
  expected = (teacher_logp - student) * mask
  assert np.abs(expected).max() > 1e-2  # the models differ where it counts
  np.testing.assert_allclose(np.asarray(batch.advantages), expected, atol=2e-4)


def test_a_buffer_with_teacher_logprobs_resumes_bitwise_and_teaches_without_a_live_teacher(tmp_path, monkeypatch):
  """The rollout task with rollout.teacher: SIGKILLed before its third part, then rerun, it writes the buffer an
  uninterrupted run writes, bit for bit (teacher log-probs included); those equal transformers' log-probs of the
  teacher; on-policy distillation from that buffer, with no live teacher, takes each token's advantage as the stored
  teacher log-prob minus the stored behaviour log-prob."""
  import signal

  from jalign.rl import buffer
  teacher = _perturbed_teacher(tmp_path / "teacher")
  flags = (f"--config.rollout.teacher={teacher}", "--config.rollout.teacher_top_k=4")
  cli.run("rollout.py:tiny", tmp_path / "clean", *flags, program=cli.FAULTY, check=True)
  killed = cli.run("rollout.py:tiny", tmp_path / "r", *flags, program=cli.FAULTY, env={"KILL_AT_PART": "2"})
  assert killed.returncode == -signal.SIGKILL
  assert sorted(os.listdir(tmp_path / "r" / "buffer")) == ["part-000000.parquet", "part-000001.parquet"]
  cli.run("rollout.py:tiny", tmp_path / "r", *flags, program=cli.FAULTY, check=True)
  want, got = buffer.read_all(str(tmp_path / "clean" / "buffer")), buffer.read_all(str(tmp_path / "r" / "buffer"))
  assert len(want) == 256 and got == want  # every field, floats bit for bit
  assert {r["teacher"] for r in want} == {os.path.abspath(teacher)}

  hf = transformers.AutoModelForCausalLM.from_pretrained(teacher)
  for r in want[:8]:
    ids = np.asarray(r["prompt_ids"] + r["response_ids"])[None]
    with torch.no_grad():
      logp = _log_softmax(hf(input_ids=torch.tensor(ids)).logits[0].double().numpy())
    p = len(r["prompt_ids"])
    expected = [logp[p - 1 + j, t] for j, t in enumerate(r["response_ids"])]
    np.testing.assert_allclose(r["teacher_logprobs"], expected, atol=2e-4)
    top = np.argsort(-logp[p - 1:-1], -1)[:, :4]
    np.testing.assert_array_equal(r["teacher_topk_ids"], top)
    np.testing.assert_allclose(r["teacher_topk_logprobs"], np.take_along_axis(logp[p - 1:-1], top, -1), atol=2e-4)

  cfg = run_config("distill", "tiny", run_dir=str(tmp_path / "run"), model__path=POLICY, model__arch=None,
                   tokenizer="", distill__teacher="", grpo__buffer=str(tmp_path / "clean" / "buffer"), grpo__prompts="",
                   train__steps=1, grpo__eval_examples=0)
  seen = []
  original = distill_task.OnPolicyDistillTask.advantages

  def capture(self, batch, trained, kl_coef):
    out = original(self, batch, trained, kl_coef)
    seen.append((jax.device_get(out[0]), trained))
    return out

  monkeypatch.setattr(distill_task.OnPolicyDistillTask, "advantages", capture)
  distill_task.run(cfg)
  ((batch, trained),) = seen
  mask = np.asarray(batch.response_mask)
  np.testing.assert_array_equal(np.asarray(batch.advantages), (trained.teacher_logp - trained.behaviour) * mask)
  assert np.abs(np.asarray(batch.advantages)).max() > 1e-2


  # Offline KD from the buffer's top-k, no teacher: one batch's loss against NumPy over transformers' student logits
  spec = str(tmp_path / "clean" / "buffer" / "*.parquet")
  cfg = run_config("distill", "tiny,offline", run_dir=str(tmp_path / "kd"), model__path=POLICY, model__arch=None,
                   tokenizer="", distill__teacher="", distill__beta=0.5, data__train=spec, data__eval="",
                   data__packing=False, data__buckets=(32, 64), train__steps=2)
  task, setup, optimizer, schedule = _setup(cfg)
  task.start(setup)
  examples = [task.encode_fn()(r) for r in want[:8]]
  examples = [{**e, "record": np.full(len(e["tokens"]), i + 1)} for i, e in enumerate(examples)]  # as the pipeline
  batch = task.batch_fn(examples)
  loss_fn = task.make_loss_fn(setup.graphdef)
  loss, weight, _ = jax.jit(loss_fn)((setup.full(setup.state.params), None),
                                     {k: jnp.asarray(v) for k, v in batch.items() if k != "record"})
  student_hf = transformers.AutoModelForCausalLM.from_pretrained(POLICY)
  total, count = 0.0, 0
  for r in want[:8]:
    with torch.no_grad():
      ls = _log_softmax(student_hf(input_ids=torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0].numpy())
    p = len(r["prompt_ids"])
    for j in range(len(r["response_ids"])):
      s_k = ls[p - 1 + j, r["teacher_topk_ids"][j]]
      t_k = np.asarray(r["teacher_topk_logprobs"][j], np.float64)
      cat = lambda lk: np.concatenate([np.exp(lk), [1 - np.exp(lk).sum()]])  # noqa: E731
      sp, tq = cat(s_k), cat(t_k)
      m = 0.5 * sp + 0.5 * tq
      total += 0.5 * np.sum(tq * np.log(tq / m)) + 0.5 * np.sum(sp * np.log(sp / m))
      count += 1
  assert float(weight) == count
  np.testing.assert_allclose(float(loss), total, rtol=1e-3)
  distill_task.run(cfg)  # and the run end to end
  rows = [json.loads(line) for line in open(tmp_path / "kd" / "metrics.jsonl")]
  assert [np.isfinite(r["distill/divergence"]) for r in rows if "distill/divergence" in r] == [True, True]


def test_without_a_teacher_or_a_buffer_with_its_logprobs_distillation_says_which(tmp_path):
  from jalign.rl import buffer
  with pytest.raises(ConfigError, match="config.distill.teacher: empty"):
    run_config("distill", "tiny", distill__teacher="")
  cli.run("rollout.py:tiny", tmp_path / "plain", "--config.rollout.limit=4", check=True)
  assert all(r["teacher_logprobs"] is None for r in buffer.read_all(str(tmp_path / "plain" / "buffer")))
  cfg = run_config("distill", "tiny", run_dir=str(tmp_path / "run"), distill__teacher="", grpo__prompts="",
                   grpo__buffer=str(tmp_path / "plain" / "buffer"))
  with pytest.raises(ConfigError, match="grpo.buffer=.*holds no teacher log-probs"):
    distill_task.run(cfg)
  cfg = run_config("distill", "tiny,offline", run_dir=str(tmp_path / "kd"), distill__teacher="")
  with pytest.raises(ConfigError, match="data.train='synthetic:arith:train' has no teacher_topk_ids"):
    distill_task.run(cfg)


def _setup(cfg):
  task = distill_task.task(cfg)
  optimizer, schedule = optim_lib.make(cfg.optim, cfg.train.steps)
  setup = loop.setup(cfg, optimizer, task)
  return task, setup, optimizer, schedule


def test_gkd_rows_are_the_students_greedy_completions(tmp_path):
  """GKD's on-policy batch: each row keeps its prompt (the tokens before its first loss token) and gets the
  student's completion (greedy here: transformers' `generate` must give the same), the loss mask on it alone."""
  cfg = run_config("distill", "tiny,gkd", run_dir=str(tmp_path), model__path=POLICY, model__arch=None, tokenizer="",
                   sampling__temperature=0.0)
  task, setup, optimizer, schedule = _setup(cfg)
  task.start(setup)
  task.build(setup, optimizer, schedule)
  local = next(task.iterator)
  rows = task.student_rows(local, setup.full(setup.state.params), jax.random.key(0))
  hf = transformers.AutoModelForCausalLM.from_pretrained(POLICY)
  for i in range(len(local["tokens"])):
    start = int(np.argmax(local["loss_mask"][i] != 0))
    prompt = local["tokens"][i, :start]
    with torch.no_grad():
      out = hf.generate(torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=8, do_sample=False,
                        eos_token_id=2, pad_token_id=0)[0, start:].numpy()
    n = int(rows["segment_ids"][i].sum())
    np.testing.assert_array_equal(rows["tokens"][i, :start], prompt)
    np.testing.assert_array_equal(rows["tokens"][i, start:n], out[:n - start])
    assert len(out) == n - start or out[n - start - 1] == 2  # all of it, or up to its stop token
    np.testing.assert_array_equal(rows["loss_mask"][i, :n], [0] * start + [1] * (n - start))


def test_a_teacher_with_another_vocabulary_is_a_clear_error(tmp_path):
  teacher = tmp_path / "teacher"
  shutil.copytree(POLICY, teacher)
  tok = json.load(open(teacher / "tokenizer.json"))
  vocab = tok["model"]["vocab"]
  a, b = [t for t, i in vocab.items() if i in (100, 101)]
  vocab[a], vocab[b] = vocab[b], vocab[a]
  json.dump(tok, open(teacher / "tokenizer.json", "w"))
  cfg = run_config("distill", "tiny,offline", run_dir=str(tmp_path / "run"), distill__teacher=str(teacher))
  task, setup, _, _ = _setup(cfg)
  with pytest.raises(ConfigError, match=r"config.distill.teacher=.*differ at id 100.*in the student's"):
    task.start(setup)


@pytest.mark.parametrize("arg,overrides,message", [
    ("tiny,gkd", dict(distill__teacher=""), "config.distill.teacher: empty"),
    ("tiny,gkd", dict(data__packing=True), "packing=True with distill.mode='gkd'"),
    ("tiny,offline", dict(grpo__prompts="synthetic:arith:train"), "does not read config.grpo"),
    ("tiny", dict(kl__coef=0.1), "in mode 'on_policy' does not read config.kl"),
    ("tiny,offline", dict(distill__teacher="no/such/dir"), None),
])
def test_bad_distill_configs(arg, overrides, message):
  if message is None:  # a missing teacher is named before anything loads
    from jalign.config import check_paths
    with pytest.raises(ConfigError, match="config.distill.teacher='no/such/dir': not found"):
      check_paths(run_config("distill", arg, **overrides))
    return
  with pytest.raises(ConfigError, match=message):
    run_config("distill", arg, **overrides)


@pytest.mark.parametrize("mode", ["offline", "gkd", "on_policy"])
def test_each_mode_runs_and_exports(tmp_path, mode):
  cli.run(f"distill.py:tiny,{mode}", tmp_path, one_device=True, check=True)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  key = "actor/kl_loss" if mode == "on_policy" else "distill/divergence"
  assert all(np.isfinite(r[key]) for r in rows if key in r) and any(key in r for r in rows)
  if mode == "gkd":  # lmbda 0.5: some steps on the student's samples, drawn from the seed and the step
    drawn = [r["distill/student_samples"] for r in rows if "distill/student_samples" in r]
    assert drawn == [float(np.random.default_rng([0, s]).random() < 0.5) for s in range(1, 5)]
  assert os.path.exists(tmp_path / "hf" / "model.safetensors")
