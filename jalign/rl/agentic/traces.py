"""Tool-use demonstrations for an SFT warm start: a scripted expert plays an environment, so every trace is the
environment's own conversation (its tool prompt, its observations) and is checked to earn the full reward.

The expert calls the environment's one tool with the record's field named as the tool's argument (the `mul` task's
`expression`), then answers `#### <the tool's output>` (the GSM8K convention the verifiable rewards read).

    python -m jalign.rl.agentic.traces --prompts synthetic:mul:train:256 --env calculator --format compact \\
        --direct 256 --out jalign/assets/agent_traces/train.jsonl

`--direct N` adds N records of the same source (the ones after the traced ones) as plain answers, without tools, so
that the warm-started policy also answers when no tool is offered (the no-tool baseline).
"""
from __future__ import annotations

import argparse
import json
import os

from jalign.core import files
from jalign.core.errors import DataError
from jalign.data.sources import open_source
from jalign.rl.agentic import env as env_lib
from jalign.rl.agentic import tools as tools_lib
from jalign.tokenizers import tokenizer as tokenizer_lib


def expert_trace(tok, env: env_lib.ToolEnv, record: dict, where: str = "") -> dict:
  """{"messages", ["tools"]}: one solved episode of `env` on `record`, as an SFT record."""
  name, arg = tools_lib.only_argument(env.tools)
  if arg not in record:
    raise DataError(f"{where or 'record'}: the expert calls {name} with the record's {arg!r} field; it has "
                    f"{sorted(record)}")
  messages, kwargs = env_lib.with_tools(tok, env.reset(record), env)
  call = tools_lib.format_call(tools_lib.ToolCall(name, {arg: str(record[arg])}), env.fmt)
  step = env.step(call)
  if step.done or not step.observation:
    raise DataError(f"{where or 'record'}: the environment ended the episode at the expert's tool call {call!r}")
  answer = f"#### {step.observation[-1]['content']}"
  messages += [{"role": "assistant", "content": call}, *step.observation]
  final = env.step(answer)
  if not final.done or final.reward != 1.0:
    raise DataError(f"{where or 'record'}: the expert's answer {answer!r} scores {final.reward}, not 1: the tool's "
                    "output is not the record's answer")
  return {"messages": messages + [{"role": "assistant", "content": answer}], **kwargs}


def write(out: str, tok, env: env_lib.ToolEnv, prompts: str, direct: int = 0) -> int:
  """Traces of every record of `prompts` but the last `direct`, then those as plain answers; returns the count."""
  source = open_source(prompts)
  traced = len(source) - direct
  if traced < 0:
    raise DataError(f"--direct {direct}: {prompts} has {len(source)} records")
  rows = [expert_trace(tok, env, source[i], source.where(i)) for i in range(traced)]
  rows += [{"messages": source[i]["messages"]} for i in range(traced, len(source))]
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  files.write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
  return len(rows)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prompts", required=True, help="prompt records with ground truth (any prompt source)")
  p.add_argument("--env", default="calculator", help=f"one of {', '.join(sorted(env_lib.REGISTRY))}")
  p.add_argument("--format", default="compact", choices=tools_lib.FORMATS)
  p.add_argument("--reward", default="gsm8k")
  p.add_argument("--tokenizer", default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets",
                                                      "tiny_policy"))
  p.add_argument("--direct", type=int, default=0)
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  env = env_lib.make(a.env, reward=a.reward, fmt=a.format)
  n = write(a.out, tokenizer_lib.load(a.tokenizer), env, a.prompts, a.direct)
  print(f"{n} records -> {a.out}")


if __name__ == "__main__":
  main()
