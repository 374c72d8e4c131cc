"""Environments for multi-turn RL: an episode starts from a prompt record (`reset` -> the first messages) and goes on
turn by turn (`step(action_text)` -> observation messages, the turn's reward, done), with a turn limit and per-episode
state. Registered by name, as rewards are.

`ToolEnv` is the tool-calling environment: a turn whose text calls tools (in the chat template's format) gets the
tools' outputs back as `tool` messages; a turn without a call is the final answer, scored by a verifiable reward of
`jalign.rewards.verifiable`; a malformed call, an unknown tool or a tool that fails gets an error message and the episode goes
on. An episode that reaches `max_turns` without answering ends truncated, with reward 0.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Literal

import numpy as np

from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.data.prompts import ground_truth_of
from jalign.rewards.verifiable import NEEDS_GROUND_TRUTH, Batch
from jalign.rewards.verifiable import REGISTRY as REWARDS
from jalign.rl.agentic import tools as tools_lib


@dataclasses.dataclass
class Step:
  # Before the model's next turn ([] when done): messages, which the chat template renders with the next generation
  # prompt, or token ids, appended as they are (an environment that formats its own turns)
  observation: list[dict] | list[int]
  reward: float                # this turn's reward (the final answer's score; per-turn shaping otherwise)
  done: bool
  info: dict = dataclasses.field(default_factory=dict)
  # How the model's turn is written into the conversation when not as its text: Mistral's template renders tool
  # calls from a message's `tool_calls` (with their ids), not from its content.
  action_message: dict | None = None


class Env:
  """One episode at a time."""
  max_turns: int = 1

  def reset(self, record: dict) -> list[dict]:
    """The episode's first messages (the prompt)."""
    raise NotImplementedError

  def step(self, action_text: str, action_ids: list[int] | None = None) -> Step:
    """The model's turn, as text (its stop token left out) and as the sampled ids."""
    raise NotImplementedError

  def info(self, **extra) -> dict:
    """The running episode's counters (a Step's `info` reports them too), with `extra`."""
    return dict(extra)


def prompt_messages(record: dict) -> list[dict]:
  """A prompt record's `prompt`: a string (one user turn) or a message list (verl's layout)."""
  prompt = record.get("prompt") if isinstance(record, dict) else None
  if isinstance(prompt, str) and prompt.strip():
    return [{"role": "user", "content": prompt}]
  if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
    return [dict(m) for m in prompt]
  raise ConfigError(f"environment: a record needs a 'prompt' string or message list, got {str(prompt)[:60]!r}")


class ToolEnv(Env):
  def __init__(self, tools: dict[str, tools_lib.Tool], *, reward: str = "gsm8k", fmt: str = "hermes",
               max_turns: int = 4, max_chars: int = 2000, error_reward: float = 0.0):
    if reward not in NEEDS_GROUND_TRUTH:
      raise ConfigError(f"environment reward {reward!r}; accepted verifiable rewards: "
                        f"{', '.join(sorted(NEEDS_GROUND_TRUTH))}")
    if fmt not in tools_lib.FORMATS:
      raise ConfigError(f"tool call format {fmt!r}; accepted: {', '.join(tools_lib.FORMATS)}")
    if max_turns < 1:
      raise ConfigError(f"environment max_turns={max_turns}: must be >= 1")
    if fmt == "compact" and tools:
      tools_lib.only_argument(tools)
    self.tools, self.reward_name, self.fmt = tools, reward, fmt
    self.max_turns, self.max_chars = max_turns, max_chars
    self.error_reward = error_reward  # a turn's reward per failed call (malformed, unknown tool, error): shaping

  def schemas(self) -> list[dict]:
    """The `tools=` argument of the chat template."""
    return [t.schema() for t in self.tools.values()]

  def reset(self, record: dict) -> list[dict]:
    self.truth = ground_truth_of(record)
    self.turn = self.calls = self.errors = 0
    return prompt_messages(record)

  def info(self, **extra) -> dict:
    return {"turns": self.turn, "tool_calls": self.calls, "tool_errors": self.errors, **extra}

  def step(self, action_text: str, action_ids: list[int] | None = None) -> Step:
    self.turn += 1
    try:  # without tools every turn is the answer (a call written anyway is scored as one)
      calls = tools_lib.parse_calls(action_text, self.fmt, self.tools) if self.tools else []
    except tools_lib.ToolError as e:
      self.errors += 1
      failed = 1
      observation, action = [{"role": "tool", "content": f"error: {e}", "tool_call_id": "error0000"}], None
    else:
      if not calls:  # the final answer
        score = REWARDS[self.reward_name](Batch([action_text], [self.truth], np.asarray([len(action_text)])))
        return Step([], float(score[0]), True, self.info(truncated=False))
      observation, structured, failed = [], [], 0
      for call in calls:
        out, ok = tools_lib.run(call, self.tools, max_chars=self.max_chars)
        self.calls += 1
        self.errors += not ok
        failed += not ok
        # Templates that pair results with calls (Mistral's: 9 letters or digits) read tool_call_id; others ignore it.
        call_id = call.id or f"call{self.calls:05d}"
        observation.append({"role": "tool", "name": call.name, "content": out, "tool_call_id": call_id})
        structured.append({"id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
      action = {"role": "assistant", "content": "", "tool_calls": structured} if self.fmt == "mistral" else None
    reward = self.error_reward * failed
    if self.turn >= self.max_turns:
      return Step([], reward, True, self.info(truncated=True))
    return Step(observation, reward, False, self.info(truncated=False), action)


def tool_instructions(schemas: list[dict], fmt: str) -> str:
  """A system message that shows tools to a model whose chat template has no tool section (Llama 3.0's, ...). The
  compact format's is one short line (`calculator: <<expression>>`): it is meant for models trained on its calls."""
  if fmt == "compact":
    (schema,) = schemas
    (arg,) = schema["function"]["parameters"]["required"]
    return f"{schema['function']['name']}: <<{arg}>>"
  example = {"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}
  call = {"hermes": f"<tool_call>\n{json.dumps(example)}\n</tool_call>",
          "mistral": f"[TOOL_CALLS] [{json.dumps(example)}]",
          "llama3": json.dumps({"name": "NAME", "parameters": {"ARGUMENT": "VALUE"}})}[fmt]
  listed = "\n".join(json.dumps(s["function"]) for s in schemas)
  return (f"You can call these tools, described as JSON schemas:\n{listed}\nTo call one, reply with exactly:\n{call}\n"
          "and nothing after it; the result comes back in the next message. Answer without a call when you are "
          "done.")


def has_tools(env: Env) -> bool:
  return isinstance(env, ToolEnv) and bool(env.tools)


def with_tools(tok, messages: list[dict], env: Env) -> tuple[list[dict], dict]:
  """(messages, render_chat keyword arguments) that show `env`'s tools to the model (none for an environment without
  tools): through the chat template's own tool section where it has one, else as a system message (merged into the
  first one if there is one)."""
  if not has_tools(env):
    return messages, {}
  schemas = env.schemas()
  if tok.render_chat(messages, add_generation_prompt=True, tools=schemas) != \
      tok.render_chat(messages, add_generation_prompt=True):
    return messages, {"tools": schemas}
  text = tool_instructions(schemas, env.fmt)
  if messages and messages[0]["role"] == "system":
    return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], {}
  return [{"role": "system", "content": text}, *messages], {}


REGISTRY: dict[str, Callable[..., Env]] = {}


@dataclasses.dataclass(frozen=True)
class EnvSection:
  """Multi-turn RL (the run config's `env` section, read by GRPO and PPO): each sample is an episode of environment
  `name`, turn by turn (sampling.max_new_tokens per turn), its final answer scored by the first verifiable reward of
  reward.weights; name "" = one turn, scored by the whole reward section."""
  name: str = ""                          # a registered environment: calculator, python, answer
  max_turns: int = bounded(4, gt=0)       # turns per episode before it is cut
  # How the model writes tool calls: hermes (Qwen), llama3 (JSON), mistral ([TOOL_CALLS]), compact (<<argument>>,
  # one tool with one argument: for small models and short contexts)
  tool_format: Literal["hermes", "llama3", "mistral", "compact"] = "hermes"
  max_tokens: int = bounded(0, ge=0)      # an episode's token budget, prompt included; 0 = the model's context
  # A turn's reward per failed tool call (malformed, unknown tool, bad arguments, an error): shaping on that turn's
  # last token, added to the episode's return; 0 = the final answer's score alone
  error_reward: float = bounded(0.0, ge=-1, le=0)

  def check(self) -> None:
    if not self.name:
      changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
      if changed:
        raise ConfigError(f"config.env.{changed[0]}={getattr(self, changed[0])!r}: no environment is set "
                          f"(env.name); set env.name ({', '.join(sorted(REGISTRY))}) or leave env.{changed[0]} at "
                          "its default")
    elif self.name not in REGISTRY:
      raise ConfigError(f"config.env.name={self.name!r}: unknown environment; registered: "
                        f"{', '.join(sorted(REGISTRY))}")


def register(name: str, factory: Callable[..., Env]) -> None:
  REGISTRY[name] = factory


def make(name: str, **kwargs) -> Env:
  if name not in REGISTRY:
    raise ConfigError(f"unknown environment {name!r}; registered: {', '.join(sorted(REGISTRY))}")
  return REGISTRY[name](**kwargs)


register("calculator", lambda **kw: ToolEnv(tools_lib.get(["calculator"]), **kw))
register("python", lambda **kw: ToolEnv(tools_lib.get(["python"]), **kw))  # a sandboxed interpreter
register("answer", lambda **kw: ToolEnv({}, **kw))  # no tools: one answer per episode (the one-turn task as an env)
