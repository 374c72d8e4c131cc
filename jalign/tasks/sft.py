"""The SFT task: next-token NLL on completion tokens, held-out teacher-forced exact match."""
from __future__ import annotations

from jalign.config import RunConfig
from jalign.data import sft as sft_data
from jalign.data.sources import DataError, open_source
from jalign.objectives import sft
from jalign.train import loop
from jalign.train.task import Task


class SftTask(Task):
  def make_loss_fn(self, graphdef):
    return sft.make_loss_fn(graphdef, logprobs=self.cfg.logprobs, router_loss=self.router_loss())

  def encode(self, record, *, tok, max_length, truncation):
    return sft_data.encode(record, tok, max_length=max_length, truncation=truncation)

  def evaluate(self, setup, params) -> dict:
    examples = self.eval_examples()
    return {"eval/exact_match": sft.exact_match(setup.graphdef, params, examples)} if examples else {}

  def eval_examples(self) -> list[dict]:
    """The held-out examples of the exact-match check (train.eval_examples of data.eval, encoded once)."""
    cfg = self.cfg
    if not cfg.data.eval or not cfg.train.eval_examples:
      return []
    if getattr(self, "_eval_examples", None) is None:
      source = open_source(cfg.data.eval, cfg.data.fields())
      self._eval_examples = []
      for i in range(min(len(source), cfg.train.eval_examples)):
        try:
          self._eval_examples.append(sft_data.encode(source[i], self.tok, max_length=cfg.data.max_length,
                                                     truncation=cfg.data.truncation))
        except DataError:
          continue
    return self._eval_examples


def task(cfg: RunConfig) -> SftTask:
  return SftTask(cfg)


def run(cfg: RunConfig) -> dict:
  return loop.run(cfg, task(cfg))
