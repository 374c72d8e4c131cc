"""Tools and the tool-calling environment: exact arithmetic against Python's Fraction, tool calls parsed in the
formats the real chat templates ask for, every failure an error observation (never a crash), episodes with a turn
limit, and tool schemas rendered by the real Qwen3, Llama 3 and Mistral templates."""
import json
import random
from fractions import Fraction

import pytest

from jalign.core.errors import ConfigError
from jalign.rl.agentic import env as env_lib
from jalign.rl.agentic import tools
from jalign.tokenizers import tokenizer
from tests.realdata import path


def test_calculator_is_exact_against_fractions():
  rng = random.Random(0)
  for _ in range(200):
    a, b, c = (rng.randint(-10 ** 6, 10 ** 6) for _ in range(3))
    b = b or 7
    want = Fraction(a) * Fraction(c) + Fraction(a, b)
    got = tools.calculate(f"{a} * {c} + {a} / {b}")
    assert Fraction(got) == want, (a, b, c, got)
  assert tools.calculate("123456 * 654321") == str(123456 * 654321)
  assert tools.calculate("0.1 + 0.2") == "0.3"            # decimals exact, not binary floats
  assert tools.calculate("2 ^ 10") == "1024" and tools.calculate("1,000 + 1") == "1001"
  assert tools.calculate("10 / 4") == "2.5" and tools.calculate("1 / 3") == "1/3" and tools.calculate("-7 // 2") == "-4"


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"), ("0 ** -1", "division by zero"), ("2 ** 100000", "exponents"),
    ("9 ** 9 ** 9", "exponents"), ("10 ** 3000", "digits"), ("__import__('os').system('true')", "unsupported"),
    ("(1 + ", "cannot parse"), ("x + 1", "unsupported"), ("1" * 600, "longer than 500"), ("1e400", "too large"),
])
def test_calculator_refuses_what_it_cannot_do_exactly_or_safely(expression, message):
  with pytest.raises(tools.ToolError, match=message):
    tools.calculate(expression)


def test_tool_calls_parsed_in_each_templates_format():
  call = {"name": "calculator", "arguments": {"expression": "2 + 2"}}
  block = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
  hermes = f"Let me compute.\n{block}\n{block}"
  assert tools.parse_calls(hermes, "hermes") == [tools.ToolCall("calculator", {"expression": "2 + 2"})] * 2
  assert tools.parse_calls(f"[TOOL_CALLS] [{json.dumps(call)}]", "mistral") == [tools.ToolCall(**call)]
  llama = json.dumps({"name": "calculator", "parameters": {"expression": "2 + 2"}})
  assert tools.parse_calls(llama, "llama3") == [tools.ToolCall(**call)]
  as_string = json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "1"})})
  assert tools.parse_calls(as_string, "llama3")[0].arguments == {"expression": "1"}
  calculator = tools.get(["calculator"])
  assert tools.parse_calls("<<1234*5678>> and <<2 + 2>>", "compact", calculator) == \
      [tools.ToolCall("calculator", {"expression": "1234*5678"}), tools.ToolCall("calculator", {"expression": "2 + 2"})]
  for fmt in tools.FORMATS:
    assert tools.parse_calls("The answer is 4.\n#### 4", fmt, calculator) == []


@pytest.mark.parametrize("fmt", tools.FORMATS)
def test_written_calls_parse_back(fmt):
  calculator = tools.get(["calculator"])
  call = tools.ToolCall("calculator", {"expression": "(12 + 3) * 4"})
  assert tools.parse_calls(tools.format_call(call, fmt), fmt, calculator) == [call]


def test_the_compact_format_needs_one_tool_with_one_argument():
  with pytest.raises(ConfigError, match="one tool with one required argument; the tools are calculator"):
    env_lib.ToolEnv(tools.get(["calculator", "python"]), fmt="compact")
  with pytest.raises(tools.ToolError, match="not closed"):
    tools.parse_calls("<<1 + 2", "compact", tools.get(["calculator"]))
  env = env_lib.make("calculator", fmt="compact")
  env.reset({"prompt": "What is 1234 * 5678?", "answer": "7006652"})
  step = env.step("<<1234*5678>>")
  assert not step.done
  assert step.observation == [{"role": "tool", "name": "calculator", "content": "7006652", "tool_call_id": "call00001"}]
  assert env.step("#### 7006652").reward == 1.0


@pytest.mark.parametrize("text, fmt, message", [
    ("<tool_call>{\"name\": \"calculator\", </tool_call>", "hermes", "not valid JSON"),
    ("<tool_call>{\"name\": \"calculator\"}", "hermes", "not closed"),
    ("<tool_call>[1, 2]</tool_call>", "hermes", "string \"name\""),
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": [1]}</tool_call>", "hermes", "must be a JSON object"),
    ("[TOOL_CALLS] {\"name\": \"x\"}", "mistral", "JSON list"),
    ("{\"name\": \"calculator\", \"parameters\": {", "llama3", "not valid JSON"),
])
def test_malformed_calls_raise_a_readable_tool_error(text, fmt, message):
  with pytest.raises(tools.ToolError, match=message):
    tools.parse_calls(text, fmt)


def test_running_a_call_never_raises():
  def boom(x: int) -> str:
    raise RuntimeError("the tool broke")
  registry = {"calculator": tools.REGISTRY["calculator"],
              "boom": tools.Tool("boom", "fails", {"type": "object", "properties": {"x": {"type": "integer"}},
                                                   "required": ["x"]}, boom),
              "chatty": tools.Tool("chatty", "talks", {"type": "object", "properties": {}}, lambda: "a" * 10_000)}
  cases = [(tools.ToolCall("calculator", {"expression": "6 * 7"}), "42", True),
           (tools.ToolCall("nope", {}), "error: unknown tool 'nope'; available: boom, calculator, chatty", False),
           (tools.ToolCall("calculator", {}), "error: calculator: missing argument(s) ['expression']", False),
           (tools.ToolCall("calculator", {"expression": "1", "x": 2}), "error: calculator: unknown argument(s)", False),
           (tools.ToolCall("boom", {"x": True}), "error: boom: argument 'x' must be of type integer", False),
           (tools.ToolCall("boom", {"x": 1}), "error: boom raised RuntimeError: the tool broke", False),
           (tools.ToolCall("calculator", {"expression": "1/0"}), "error: calculator: division by zero", False)]
  for call, want, ok in cases:
    out, good = tools.run(call, registry)
    assert out.startswith(want) and good == ok, (call, out)
  out, ok = tools.run(tools.ToolCall("chatty", {}), registry, max_chars=100)
  assert ok and out == "a" * 100 + " ... [cut: 9900 more characters]"
  with pytest.raises(ConfigError, match="unknown tool"):
    tools.get(["calculator", "web_search"])


def _call(expression: str) -> str:
  return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


def test_calculator_episode():
  env = env_lib.make("calculator", reward="gsm8k", max_turns=3)
  record = {"prompt": "What is 1234 * 5678?", "answer": "7006652"}
  assert env.reset(record) == [{"role": "user", "content": "What is 1234 * 5678?"}]
  step = env.step("I will use the calculator.\n" + _call("1234 * 5678"))
  assert not step.done and step.reward == 0.0 and step.action_message is None  # hermes calls stay as written
  assert step.observation == [{"role": "tool", "name": "calculator", "content": "7006652", "tool_call_id": "call00001"}]
  step = env.step("<tool_call>{oops</tool_call>")
  assert not step.done and step.observation[0]["content"].startswith("error: tool call: not valid JSON")
  step = env.step("1234 * 5678 = 7006652.\n#### 7006652")
  assert step.done and step.reward == 1.0
  assert step.info == {"turns": 3, "tool_calls": 1, "tool_errors": 1, "truncated": False}
  env.reset(record)  # a new episode starts clean
  assert env.step("#### 12").reward == 0.0


def test_episode_ends_truncated_at_the_turn_limit():
  env = env_lib.make("calculator", max_turns=2)
  env.reset({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"})
  assert not env.step(_call("2+2")).done
  last = env.step(_call("2+2"))
  assert last.done and last.reward == 0.0 and last.info["truncated"] and last.observation == []


def test_bad_environment_settings():
  with pytest.raises(ConfigError, match="unknown environment 'chess'; registered: answer, calculator, python"):
    env_lib.make("chess")
  with pytest.raises(ConfigError, match="accepted verifiable rewards"):
    env_lib.make("calculator", reward="format")
  with pytest.raises(ConfigError, match="tool call format 'xml'"):
    env_lib.make("calculator", fmt="xml")
  with pytest.raises(ConfigError, match="max_turns=0"):
    env_lib.make("calculator", max_turns=0)
  with pytest.raises(ConfigError, match="needs a 'prompt'"):
    env_lib.make("calculator").reset({"question": "2+2?"})


@pytest.mark.parametrize("name, own_section", [("qwen3", True), ("llama3", False)])
def test_real_templates_show_the_tools(name, own_section):
  """Qwen3's template has a tool section and renders the schemas itself; Llama 3.0's has none, so the tools and the
  call format go into a system message."""
  tok = tokenizer.load(path(f"tokenizers/{name}"))
  env = env_lib.make("calculator")
  messages, kwargs = env_lib.with_tools(tok, env.reset({"prompt": "What is 1234 * 5678?", "answer": "7"}), env)
  text = tok.render_chat(messages, add_generation_prompt=True, **kwargs)
  assert ("tools" in kwargs) == own_section and (messages[0]["role"] == "system") != own_section
  assert '"calculator"' in text and '"expression"' in text and "<tool_call>" in text
  assert text.index('"expression"') < text.index("What is 1234 * 5678?")
  with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  merged, _ = env_lib.with_tools(tok, with_system, env)
  assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.") or own_section


@pytest.mark.parametrize("name, end, think", [("qwen3", "<|im_end|>", True), ("llama3", "<|eot_id|>", False)])
def test_episode_tokens_equal_the_templates_rendering_of_the_whole_conversation(name, end, think):
  """Token in, token out: the model's sampled ids are kept as sampled, observations come from the template, and the
  result equals the template's rendering of the finished conversation; the loss mask covers exactly the model's ids
  (Qwen3's turns open with the think block the model writes; its template re-renders the last turn with one)."""
  from jalign.rl.agentic.episode import Episode
  tok = tokenizer.load(path(f"tokenizers/{name}"))
  end_id = tok.tk.token_to_id(end)
  env = env_lib.make("calculator", max_turns=4)
  messages, kwargs = env_lib.with_tools(tok, env.reset({"prompt": "What is 1234 * 5678?", "answer": "7006652"}), env)
  episode = Episode(tok, messages, **kwargs)
  prefix = "<think>\nMultiply with the tool.\n</think>\n\n" if think else ""
  turns = [prefix + "I will use the calculator.\n" + _call("1234 * 5678"),
           prefix + "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": 5}}\n</tool_call>",
           prefix + "1234 * 5678 = 7006652.\n#### 7006652"]
  model_ids = []
  for text in turns:
    ids = tok.encode(text, add_special_tokens=False) + [end_id]  # what a model samples, its stop token included
    model_ids.append(ids)
    episode.add_model_turn(ids, text)
    step = env.step(text)
    if step.done:
      break
    episode.add_observation(step.observation)
  assert step.done and step.reward == 1.0 and step.info["tool_errors"] == 1
  assert '"content": "error: calculator: argument' not in episode.text and "error: calculator: argument" in episode.text
  whole = tok.encode(tok.render_chat(episode.messages, **kwargs), add_special_tokens=False)
  assert episode.ids == whole[:len(episode.ids)]
  assert tok.decode(whole[len(episode.ids):], skip_special_tokens=False).strip() == ""  # a template's final newline
  masked = [i for i, m in zip(episode.ids, episode.loss_mask) if m]
  assert masked == [i for ids in model_ids for i in ids]
  assert episode.response_mask[0] == 1 and len(episode.response_ids) == len(episode.ids) - episode.prompt_length


def test_episode_refuses_a_turn_the_template_would_rewrite():
  """Llama 3's template trims message content: a model turn ending in spaces before its stop token would be
  re-rendered without them, so extending the episode would silently change sampled tokens."""
  from jalign.rl.agentic.episode import Episode, EpisodeError
  tok = tokenizer.load(path("tokenizers/llama3"))
  episode = Episode(tok, [{"role": "user", "content": "2+2?"}])
  text = _call("2+2") + "   "
  episode.add_model_turn(tok.encode(text, add_special_tokens=False) + [tok.tk.token_to_id("<|eot_id|>")], text)
  with pytest.raises(EpisodeError, match="renders the conversation so far differently"):
    episode.add_observation([{"role": "tool", "content": "4"}])


MISTRAL = {"v3": ("tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3",
                  "tokenizers/mistral/chat_template_v3_spm.jinja"),
           "v7": ("tokenizers/mistral/mistral_instruct_tokenizer_241114.model.v7",
                  "tokenizers/mistral/chat_template_v7_spm.jinja")}


@pytest.mark.parametrize("version", sorted(MISTRAL))
def test_mistral_episodes_are_token_exact(version, tmp_path):
  """Mistral's real templates (SentencePiece models v3 and v7): the tools go into [AVAILABLE_TOOLS]; the model's
  [TOOL_CALLS] turn (as the template renders a call, so as a model trained on it samples it) is parsed, kept as
  sampled, and written back as the structured call the template renders (its id paired with the result's); the
  answer's leading space is the template's. The episode's ids equal the rendering of the whole conversation."""
  import shutil

  from jalign.rl.agentic.episode import Episode
  model, template = MISTRAL[version]
  shutil.copyfile(path(model), tmp_path / "tokenizer.model")
  shutil.copyfile(path(template), tmp_path / "chat_template.jinja")
  tok = tokenizer.load(str(tmp_path))
  env = env_lib.make("calculator", fmt="mistral", max_turns=4)
  messages, kwargs = env_lib.with_tools(tok, env.reset({"prompt": "What is 1234 * 5678?", "answer": "7006652"}), env)
  assert "tools" in kwargs and messages[0]["role"] == "user"
  episode = Episode(tok, messages, **kwargs)
  assert "[AVAILABLE_TOOLS]" in episode.text and '"calculator"' in episode.text
  call = {"role": "assistant", "content": "", "tool_calls": [
      {"id": "a1b2c3d4e", "type": "function",
       "function": {"name": "calculator", "arguments": json.dumps({"expression": "1234 * 5678"})}}]}
  model_ids = []
  for turn in [call, {"role": "assistant", "content": "#### 7006652"}]:
    rendered = tok.encode(tok.render_chat(episode.messages + [turn], **kwargs), add_special_tokens=False)
    ids = rendered[len(episode.ids):]
    ids = ids[:ids.index(tok.eos_id) + 1]  # what the model samples: the turn through its </s>
    model_ids.append(ids)
    content = tok.decode(ids[:-1], skip_special_tokens=False)
    episode.add_model_turn(ids, content)
    step = env.step(content)
    if step.done:
      break
    assert step.observation[0]["tool_call_id"] == "a1b2c3d4e" and step.observation[0]["content"] == "7006652"
    episode.set_model_message(step.action_message)
    episode.add_observation(step.observation)
    assert "[TOOL_RESULTS]" in episode.text and "a1b2c3d4e" in episode.text
  assert step.done and step.reward == 1.0 and step.info["tool_calls"] == 1
  whole = tok.encode(tok.render_chat(episode.messages, **kwargs), add_special_tokens=False)
  assert episode.ids == whole
  assert [i for i, m in zip(episode.ids, episode.loss_mask) if m] == [i for ids in model_ids for i in ids]
