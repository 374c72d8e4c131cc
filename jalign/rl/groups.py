"""Sampled groups as the GRPO/PPO update consumes them: n completions per prompt, scored; the selection of
informative groups (DAPO's dynamic sampling), the replay buffer's groups served as steps (offline), and the
mini-batch split that keeps a prompt's samples together."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jalign.core.errors import DataError
from jalign.data.prompts import Prompt
from jalign.rl import buffer as buffer_lib
from jalign.rl.batch import pad_routes


@dataclasses.dataclass(kw_only=True)
class Groups:
  """Sampled groups, on the host: prompt i's completions are rows i*size .. i*size+size-1 (built with keyword
  arguments; the update's device batch is `rl.batch.RolloutBatch.of_groups` of them)."""
  prompts: list[Prompt]
  size: int
  response: np.ndarray                  # [N, R] token ids
  lengths: np.ndarray                   # [N]
  scores: np.ndarray                    # [N]
  behaviour: np.ndarray | None = None   # [N, R] stored log-probs (offline)
  teacher_logp: np.ndarray | None = None  # [N, R] a teacher's log-probs of the response tokens (a buffer's)
  rm_scores: np.ndarray | None = None   # [N] reward-model share of the scores
  baselines: np.ndarray | None = None   # [N] reward of the prompt's greedy response (remax)
  sampler_logp: np.ndarray | None = None   # [N, R] the sampler's log-probs of the response tokens (online)
  versions: np.ndarray | None = None    # [N, R] int32: the policy version (updates applied) that sampled each token
  loss_mask: np.ndarray | None = None   # [N, R] multi-turn: 1 on the model's tokens (observations excluded)
  counts: np.ndarray | None = None      # [N, 4] multi-turn: turns, tool calls, tool errors, truncated
  token_rewards: np.ndarray | None = None  # [N, R] multi-turn: each turn's reward on its last token
  # MoE: the experts the sampler used, [N, P, L, k] over each row's prompt (right-aligned) and [N, R, L, k] over its
  # response (`rl.rollout.Samples`; a buffer's as its rollout recorded them)
  prompt_routes: np.ndarray | None = None
  response_routes: np.ndarray | None = None

  def shown(self, tok, k: int) -> list[dict]:
    """The first completion of each of the first `k` groups, decoded, with its reward (the run's samples log)."""
    rows = []
    for i, prompt in enumerate(self.prompts[:k]):
      j = i * self.size
      completion = tok.decode(self.response[j, :int(self.lengths[j])].tolist(), skip_special_tokens=False)
      rows.append({"prompt": prompt.text, "completion": completion, "reward": float(self.scores[j]),
                   "ground_truth": prompt.ground_truth, "where": prompt.where})
    return rows

  def example(self, tok, weights) -> str:
    """The rewards (`weights`: (name, weight) pairs) and the first scored completion, for messages about them."""
    p = self.prompts[0]
    text = tok.decode(self.response[0, :self.lengths[0]])
    names = ", ".join(f"{name} x {w:g}" for name, w in weights)
    return (f"Rewards: {names}. For example {p.where} (ground truth {p.ground_truth!r}) scored "
            f"{float(self.scores[0]):g} for the completion {text[:160]!r}.")

  def stamped(self, version: int) -> "Groups":
    """These groups with every response token marked as sampled by policy `version` (-1 past each length), unless
    they carry their tokens' versions already (partial rollouts)."""
    if self.versions is not None:
      return self
    return dataclasses.replace(self, versions=np.where(self._real(), version, -1).astype(np.int32))

  def lags(self, trained_version: int) -> np.ndarray:
    """Each real response token's staleness: the updates between the policy that sampled it and
    `trained_version`, the policy the update starts from."""
    return trained_version - self.versions[self._real()]

  def _real(self) -> np.ndarray:
    """[N, R] bool: the response tokens within each length."""
    return np.arange(self.response.shape[1])[None, :] < np.asarray(self.lengths)[:, None]

  def informative(self) -> np.ndarray:
    """[B] bool: the group's rewards differ (else its advantages are all 0: no signal)."""
    grouped = self.scores.reshape(len(self.prompts), self.size)
    return grouped.max(1) > grouped.min(1)

  @staticmethod
  def select(batches: list["Groups"], want: int) -> "Groups":
    """`want` groups from several batches: informative ones first, in sampling order; if there are too few,
    uninformative ones fill the rest (they stay in the batch, masked out of the loss)."""
    pool = [(b, i) for b in batches for i in np.flatnonzero(b.informative())]
    pool += [(b, i) for b in batches for i in np.flatnonzero(~b.informative())]
    picked = pool[:want]
    rows = lambda b, i: slice(i * b.size, (i + 1) * b.size)  # noqa: E731
    width = max(b.response.shape[1] for b in batches)  # multi-turn batches differ; padding is masked out

    def cat(name):
      if getattr(batches[0], name) is None:
        return None
      parts = [getattr(b, name)[rows(b, i)] for b, i in picked]
      if name.endswith("routes"):
        return pad_routes(parts, left=name == "prompt_routes")
      if parts[0].ndim == 2 and name != "counts":
        fill = -1 if name == "versions" else 0
        parts = [np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=fill) for p in parts]
      return np.concatenate(parts)
    return Groups(prompts=[b.prompts[i] for b, i in picked], size=batches[0].size,
                  **{f.name: cat(f.name) for f in dataclasses.fields(Groups)[2:]})

  def to_json(self) -> dict:
    """A JSON-able copy (arrays with their dtype and shape; float32 values round-trip exactly through JSON)."""
    out = {"prompts": [dataclasses.asdict(p) for p in self.prompts], "size": self.size}
    for f in dataclasses.fields(self)[2:]:
      a = getattr(self, f.name)
      out[f.name] = None if a is None else {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.ravel().tolist()}
    return out

  @classmethod
  def from_json(cls, obj: dict) -> "Groups":
    arrays = {f.name: None if obj.get(f.name) is None else np.asarray(obj[f.name]["data"], obj[f.name]["dtype"])
              .reshape(obj[f.name]["shape"]) for f in dataclasses.fields(cls)[2:]}  # a field added since: None
    return cls(prompts=[Prompt(**p) for p in obj["prompts"]], size=obj["size"], **arrays)


class OfflineBuffer:
  """Groups of a replay buffer written by the rollout task, served as GRPO steps (offline mode)."""

  def __init__(self, directory: str, num_samples: int, max_new: int):
    records = buffer_lib.read_all(directory)
    groups: dict[int, list[dict]] = {}
    for r in records:
      groups.setdefault(int(r["group_id"]), []).append(r)
    self.groups = [sorted(v, key=lambda r: r["sample"]) for _, v in sorted(groups.items())]
    self.max_new, self.directory = max_new, directory
    self._has_teacher = all(r.get("teacher_logprobs") is not None for r in records)  # read once, not per batch
    self._has_routes = bool(records) and all(r.get("routes") is not None for r in records)
    for members in self.groups:
      if len(members) != num_samples:
        raise DataError(f"{directory}: group {members[0]['group_id']} has {len(members)} completions, "
                         f"sampling.num_samples is {num_samples} (filtered buffers need a matching group size)")
      longest = max(len(m["response_ids"]) for m in members)
      if longest > max_new:
        raise DataError(f"{directory}: group {members[0]['group_id']} has a {longest}-token response, longer than "
                         f"sampling.max_new_tokens={max_new}; set sampling.max_new_tokens to at least the rollout's "
                         f"(here >= {longest}), or write the buffer with the training run's")

  def __len__(self) -> int:
    return len(self.groups)

  def has_teacher(self) -> bool:
    """Every record carries a teacher's log-probs of its response (written with `rollout.teacher`)."""
    return self._has_teacher

  def has_routes(self) -> bool:
    """Every record carries the experts its rollout used per token (an MoE policy's buffer)."""
    return self._has_routes

  def check_routes(self, model_cfg) -> None:
    """Routing replay from this buffer: its records carry experts for `model_cfg`'s layers and top-k."""
    want = (len(model_cfg.moe_layers), len(model_cfg.moe_layers) * model_cfg.experts_per_token)
    if not self.has_routes():
      raise DataError(f"{self.directory}: grpo.routing_replay replays the experts each token used in the rollout; "
                      "these records have none (`routes`: the rollout task writes them for an MoE policy); set "
                      "routing_replay=False or write the buffer with the MoE policy")
    first = self.groups[0][0]
    got = (int(first["route_layers"]), len(first["routes"][0]))
    if got != want:
      raise DataError(f"{self.directory}: group {first['group_id']}'s routes cover {got[0]} layers x "
                      f"{got[1] // max(got[0], 1)} experts per token; the policy has {want[0]} layers x "
                      f"{model_cfg.experts_per_token}: written by another model")

  def batch(self, indices, pad_id: int) -> Groups:
    """The groups `indices` (their behaviour log-probs; a teacher's log-probs and the recorded experts when every
    record has them)."""
    members = [m for i in indices for m in self.groups[i]]
    prompts = [Prompt(int(self.groups[i][0]["prompt_index"]), list(self.groups[i][0]["prompt_ids"]),
                      self.groups[i][0]["prompt"], self.groups[i][0]["ground_truth"],
                      f"{self.directory}:group {self.groups[i][0]['group_id']}") for i in indices]
    n = len(members)
    response = np.full((n, self.max_new), pad_id, np.int32)
    behaviour = np.zeros((n, self.max_new), np.float32)
    teacher = np.zeros((n, self.max_new), np.float32) if self.has_teacher() else None
    lengths = np.zeros(n, np.int32)
    for row, m in enumerate(members):
      k = len(m["response_ids"])
      response[row, :k], behaviour[row, :k], lengths[row] = m["response_ids"], m["behaviour_logprobs"], k
      if teacher is not None:
        teacher[row, :k] = m["teacher_logprobs"]
    scores = np.asarray([m["reward"] for m in members], np.float32)
    routes = {}
    if self.has_routes():
      whole = [np.asarray(m["routes"], np.int16).reshape(len(m["routes"]), m["route_layers"], -1) for m in members]
      routes = dict(prompt_routes=pad_routes([w[None, :len(m["prompt_ids"])] for w, m in zip(whole, members)],
                                             left=True),
                    response_routes=pad_routes([w[None, len(m["prompt_ids"]):] for w, m in zip(whole, members)],
                                               left=False, width=self.max_new))
    return Groups(prompts=prompts, size=len(members) // len(indices), response=response, lengths=lengths,
                  scores=scores, behaviour=behaviour, teacher_logp=teacher, **routes)


def minibatches(key: jax.Array, rows: int, n: int, group_size: int = 0) -> list[np.ndarray]:
  """Row indices of `n` shuffled mini-batches. `group_size` > 0: rows come in groups of that many (one prompt's
  samples) and each mini-batch takes whole groups, in order. One mini-batch is the rollout as it is."""
  if n == 1:
    return [np.arange(rows)]
  if not group_size:
    return np.split(np.asarray(jax.random.permutation(key, rows)), n)
  groups = np.asarray(jax.random.permutation(key, rows // group_size))
  return np.split((groups[:, None] * group_size + np.arange(group_size)).reshape(-1), n)
