"""Tools a policy may call during multi-turn RL: a registry of tools with JSON-schema arguments (the form chat
templates render in their tool section), parsing of tool calls out of sampled text in the formats the real templates
ask for, and running a call so that nothing it does (bad arguments, an exception, too much output) ends the episode
or the run: every failure comes back as an error observation the model can read.

Built in: `calculator`, exact arithmetic on integers and decimals (parsed with `ast`, never evaluated as Python), and
`python`, code run in a sandboxed interpreter (`jalign.rl.agentic.sandbox`: its own process, no network, no writes outside
its temporary directory, time and memory limits).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
import threading
from fractions import Fraction
from typing import Any, Callable

from jalign.core.errors import ConfigError


class ToolError(Exception):
  """A tool call that cannot run: its message goes back to the model as the observation."""


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str
  description: str
  parameters: dict                       # JSON schema of the arguments: {"type": "object", "properties", "required"}
  fn: Callable[..., str]
  # Seconds a call may take. An in-process tool that runs past it is abandoned (its observation says so; Python
  # cannot stop a thread): a tool that may hang runs out of process and kills itself at its own limit, as `python`.
  timeout_s: float = 10.0

  def schema(self) -> dict:
    """The OpenAI / HF `tools=` entry chat templates render."""
    return {"type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


REGISTRY: dict[str, Tool] = {}


def register(tool: Tool) -> Tool:
  REGISTRY[tool.name] = tool
  return tool


def get(names) -> dict[str, Tool]:
  """The registered tools called `names`, by name."""
  unknown = [n for n in names if n not in REGISTRY]
  if unknown:
    raise ConfigError(f"unknown tool(s) {unknown}; registered: {', '.join(sorted(REGISTRY))}")
  return {n: REGISTRY[n] for n in names}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict
  id: str = ""      # the call id the model wrote (Mistral's 9-character ids), if any


# --- parsing ------------------------------------------------------------------------------------------------------

# Qwen 2.5 / Qwen3 / Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call.
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
# Mistral v3+: [TOOL_CALLS] followed by a JSON list of {"name", "arguments"}.
_MISTRAL = re.compile(r"\[TOOL_CALLS\]\s*(\[.*\])", re.S)
# Compact, for small models and short contexts: <<ARGUMENT>> calls the only tool with its only argument (GSM8K's
# calculator annotations are written so: Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems").
_COMPACT = re.compile(r"<<(.*?)>>", re.S)
FORMATS = ("hermes", "llama3", "mistral", "compact")


def _call(obj: Any, where: str) -> ToolCall:
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    raise ToolError(f"{where}: a tool call is a JSON object with a string \"name\" and an \"arguments\" object")
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str):  # some models emit the arguments as a JSON string
    try:
      args = json.loads(args)
    except json.JSONDecodeError as e:
      raise ToolError(f"{where}: the arguments of {obj['name']!r} are not valid JSON ({e.msg})") from None
  if not isinstance(args, dict):
    raise ToolError(f"{where}: the arguments of {obj['name']!r} must be a JSON object")
  return ToolCall(obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else "")


def _json(text: str, where: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ToolError(f"{where}: not valid JSON ({e.msg} at character {e.pos})") from None


def only_argument(tools: dict[str, Tool]) -> tuple[str, str]:
  """(tool name, argument name) of the one tool with one argument the compact format can call."""
  params = [(n, t.parameters.get("required", [])) for n, t in tools.items()]
  if len(params) != 1 or len(params[0][1]) != 1:
    raise ConfigError(f"tool call format 'compact' calls one tool with one required argument; the tools are "
                      f"{', '.join(f'{n}({a})' for n, a in params) or 'none'}")
  return params[0][0], params[0][1][0]


def parse_calls(text: str, fmt: str = "hermes", tools: dict[str, Tool] | None = None) -> list[ToolCall]:
  """The tool calls in a completion (none: an answer, not a call). A call that is there but malformed raises
  ToolError, whose message is the observation to send back. The compact format needs `tools` (its one tool)."""
  if fmt == "compact":
    name, arg = only_argument(tools or {})
    if "<<" in text and not _COMPACT.search(text):
      raise ToolError("tool call: << is not closed by >>")
    return [ToolCall(name, {arg: body.strip()}) for body in _COMPACT.findall(text)]
  if fmt == "hermes":
    blocks = _HERMES.findall(text)
    if not blocks and "<tool_call>" in text:
      raise ToolError("tool call: <tool_call> is not closed by </tool_call>")
    return [_call(_json(b.strip(), "tool call"), "tool call") for b in blocks]
  if fmt == "mistral":
    m = _MISTRAL.search(text)
    if m is None:
      if "[TOOL_CALLS]" in text:
        raise ToolError("tool call: [TOOL_CALLS] must be followed by a JSON list of calls")
      return []
    calls = _json(m.group(1), "tool call")
    if not isinstance(calls, list):
      raise ToolError("tool call: [TOOL_CALLS] must be followed by a JSON list of calls")
    return [_call(c, "tool call") for c in calls]
  if fmt == "llama3":  # Llama 3.1-3.3 JSON tool calling: the whole message is {"name": ..., "parameters": {...}}
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
      return []
    return [_call(_json(body, "tool call"), "tool call")]
  raise ConfigError(f"tool call format {fmt!r}; accepted: {', '.join(FORMATS)}")


def format_call(call: ToolCall, fmt: str) -> str:
  """The text a model writes for `call` in format `fmt` (parse_calls reads it back)."""
  if fmt == "hermes":
    return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"
  if fmt == "mistral":
    return f"[TOOL_CALLS] {json.dumps([{'name': call.name, 'arguments': call.arguments}])}"
  if fmt == "llama3":
    return json.dumps({"name": call.name, "parameters": call.arguments})
  if fmt == "compact":
    (value,) = call.arguments.values()
    return f"<<{value}>>"
  raise ConfigError(f"tool call format {fmt!r}; accepted: {', '.join(FORMATS)}")


# --- running ------------------------------------------------------------------------------------------------------

_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def check_arguments(tool: Tool, args: dict) -> None:
  props = tool.parameters.get("properties", {})
  missing = [k for k in tool.parameters.get("required", []) if k not in args]
  if missing:
    raise ToolError(f"{tool.name}: missing argument(s) {missing}; it takes {sorted(props)}")
  unknown = sorted(set(args) - set(props))
  if unknown:
    raise ToolError(f"{tool.name}: unknown argument(s) {unknown}; it takes {sorted(props)}")
  for key, value in args.items():
    want = _TYPES.get(props[key].get("type", ""), object)
    if isinstance(value, bool) and want in (int, (int, float)) or not isinstance(value, want):
      raise ToolError(f"{tool.name}: argument {key!r} must be of type {props[key].get('type')}, got "
                      f"{type(value).__name__}")


def _call_with_timeout(tool: Tool, args: dict) -> str:
  result: list = []

  def target():
    try:
      result.append(("ok", str(tool.fn(**args))))
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      result.append(("raised", e))

  worker = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
  worker.start()
  worker.join(tool.timeout_s)
  if worker.is_alive():
    raise ToolError(f"{tool.name}: no result after {tool.timeout_s:g} s (timed out)")
  kind, value = result[0]
  if kind == "raised":
    raise value
  return value


def run(call: ToolCall, tools: dict[str, Tool], *, max_chars: int = 2000) -> tuple[str, bool]:
  """(observation text, ok). Unknown tools, bad arguments and exceptions become error observations; output past
  `max_chars` is cut, saying so."""
  tool = tools.get(call.name)
  try:
    if tool is None:
      raise ToolError(f"unknown tool {call.name!r}; available: {', '.join(sorted(tools))}")
    check_arguments(tool, call.arguments)
    out, ok = _call_with_timeout(tool, call.arguments), True
  except ToolError as e:
    out, ok = f"error: {e}", False
  except Exception as e:  # noqa: BLE001 - a tool's own failure is the model's observation, never the run's crash
    out, ok = f"error: {call.name} raised {type(e).__name__}: {e}", False
  if len(out) > max_chars:
    out = out[:max_chars] + f" ... [cut: {len(out) - max_chars} more characters]"
  return out, ok


# --- the calculator -------------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_DIGITS = 1000   # operands and results beyond this many digits are refused (a power tower could fill memory)


def _number(node: ast.AST) -> Fraction:
  if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
    if isinstance(node.value, float) and not math.isfinite(node.value):
      raise ToolError("calculator: the number is too large")
    return Fraction(str(node.value))  # via str: 0.1 is one tenth, not the nearest double
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = _number(node.operand)
    return -value if isinstance(node.op, ast.USub) else value
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    a, b = _number(node.left), _number(node.right)
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
      raise ToolError("calculator: division by zero")
    if isinstance(node.op, ast.Pow):
      if a == 0 and b < 0:
        raise ToolError("calculator: division by zero")
      if b.denominator != 1 or abs(b) > 4 * MAX_DIGITS:
        raise ToolError("calculator: exponents must be integers of at most 4000")
      if a != 0 and abs(b) * max(len(str(abs(a.numerator))), len(str(a.denominator))) > 4 * MAX_DIGITS:
        raise ToolError(f"calculator: the result would exceed {MAX_DIGITS} digits")
    out = _BINARY[type(node.op)](a, b)
    out = Fraction(out)
    if len(str(out.numerator)) > MAX_DIGITS or len(str(out.denominator)) > MAX_DIGITS:
      raise ToolError(f"calculator: the result exceeds {MAX_DIGITS} digits")
    return out
  raise ToolError(f"calculator: unsupported expression {ast.dump(node)[:60]!r}; use numbers, + - * / // % ** and "
                  "parentheses")


def format_number(value: Fraction) -> str:
  """An integer as is; otherwise a finite decimal when there is one (up to 30 places), else a fraction a/b."""
  if value.denominator == 1:
    return str(value.numerator)
  d, twos, fives = value.denominator, 0, 0
  while d % 2 == 0:
    d, twos = d // 2, twos + 1
  while d % 5 == 0:
    d, fives = d // 5, fives + 1
  places = max(twos, fives)
  if d == 1 and places <= 30:
    scaled = abs(value.numerator) * 10 ** places // value.denominator
    sign = "-" if value < 0 else ""
    digits = str(scaled).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0")
  return f"{value.numerator}/{value.denominator}"


def calculate(expression: str) -> str:
  """Exact value of an arithmetic expression: integers and decimals, + - * / // % ** and parentheses."""
  if len(expression) > 500:
    raise ToolError("calculator: the expression is longer than 500 characters")
  try:
    tree = ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval")
  except SyntaxError as e:
    raise ToolError(f"calculator: cannot parse {expression!r} ({e.msg})") from None
  return format_number(_number(tree.body))


register(Tool("calculator", "Evaluate an arithmetic expression exactly (integers and decimals; + - * / // % ** and "
              "parentheses).",
              {"type": "object", "properties": {"expression": {"type": "string", "description":
                                                               "for example (1234 * 5678) + 9"}},
               "required": ["expression"]},
              calculate))


def python(code: str) -> str:
  """Runs `code` in the sandbox; its printed output (and the traceback's last frames if it raised) is the result."""
  from jalign.rl.agentic import sandbox
  try:
    text, status = sandbox.run_python(code, timeout_s=PYTHON_TIMEOUT_S)
  except sandbox.SandboxTimeout as e:
    raise ToolError(f"python: {e} (the limit is {PYTHON_TIMEOUT_S:g} s)") from None
  if status != 0:
    return f"{text}\n[exit status {status}]" if text else f"[exit status {status}]"
  return text or "[no output: print the result]"


PYTHON_TIMEOUT_S = 5.0
register(Tool("python", "Run Python 3 code in a sandbox (no network, no files outside its working directory, "
              f"{PYTHON_TIMEOUT_S:g} s); returns what it prints.",
              {"type": "object", "properties": {"code": {"type": "string", "description": "the program; print the "
                                                         "result"}},
               "required": ["code"]},
              python, timeout_s=PYTHON_TIMEOUT_S + 5))
