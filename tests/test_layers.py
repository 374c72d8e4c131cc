"""jalign's modules import one way: each layer only from the layers below it, and no module (through any chain of
imports, function-local ones included) from itself."""
import ast
import os

import jalign

PACKAGE = os.path.dirname(jalign.__file__)
# Lowest first, each with what it holds: README.md's layout is this table (test_readme_layout_is_this_table). A module
# may import modules of its own layer's package and of lower layers.
LAYERS = [
    (("core",), "user-facing errors; atomic file writes; config sections (dataclasses built from ConfigDicts, every "
                "key, type and bound checked); the GGUF file reader"),
    (("kernels", "tokenizers"), "attention, decode attention, log-probs / entropy / KL / JSD (xla, chunked, "
                                "Pallas); tokenizer.json and chat templates (sandboxed jinja2), SentencePiece and GGUF "
                                "vocabularies"),
    (("models",), "the NNX decoder, reward models, HF and GGUF in/out, sharding rules, LoRA"),
    (("parallel",), "meshes, batch and optimizer shardings, multi-process start-up, TPU compile targets"),
    (("sampling",), "generate and the continuous-batching engine"),
    (("losses",), "advantages, policy-gradient losses and aggregation (verl), the DPO family, distillation "
                  "divergences"),
    (("objectives",), "loss functions per objective (sft, reward, dpo, grpo, ppo's critic, distill)"),
    (("data",), "sources, published layouts, SFT / preference / prompt encoding, Grain pipelines, the demo task"),
    (("rewards",), "verifiable rewards, rewards from reward models, reward-model ensembles on disk"),
    (("rl",), "the learner's experience (rollout stage, log-prob plan, groups, replay buffer, monitors); agentic/: "
              "multi-turn episodes (environments, agent, tools, sandbox, traces)"),
    (("eval",), "held-out evaluation of a checkpoint, rank correlations, report.md"),
    (("config",), "RunConfig and the checks across sections"),
    (("train",), "the engine: the Task hooks, the loop, step, optimizer, checkpoints, metrics, preemption, locks"),
    (("tasks",), "one module per task (sft, rm, dpo/kto, grpo/ppo, distill, rollout, eval) and the chain; one "
                 "registry"),
    (("run", "fit"), "the command line; the ahead-of-time fit check"),
]
RANK = {name: i for i, (layer, _) in enumerate(LAYERS) for name in layer}


def _paths() -> dict[str, str]:
  """jalign module -> its file."""
  names = {}
  for root, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
        names[rel.removesuffix(".__init__")] = os.path.join(root, f)
  return names


def _modules() -> dict[str, set[str]]:
  """jalign module -> the jalign modules it imports."""
  names = _paths()
  graph = {}
  for module, path in names.items():
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      if isinstance(node, ast.Import):
        targets |= {a.name for a in node.names if a.name.startswith("jalign.")}
      elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jalign":
        for a in node.names:  # `from jalign.x import y`: y is a module when there is one, else a name in x
          full = f"{node.module}.{a.name}"
          targets.add(full if full in names else node.module)
    graph[module] = {t for t in targets if t != "jalign" and t != module}
  return graph


def _unit(module: str) -> str:
  return module.split(".")[1]


def test_every_unit_has_a_layer():
  assert {_unit(m) for m in _modules() if m != "jalign"} <= set(RANK)


def test_layers_import_downwards():
  wrong = sorted(f"{a} -> {b}" for a, targets in _modules().items() if a != "jalign" for b in targets
                 if _unit(a) != _unit(b) and RANK[_unit(b)] >= RANK[_unit(a)])
  assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycles():
  graph = _modules()
  state, cycles = {}, []

  def visit(m, stack):
    state[m] = "open"
    for t in sorted(graph.get(m, ())):
      if state.get(t) == "open":
        cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
      elif t not in state:
        visit(t, stack + [t])
    state[m] = "done"
  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def layout_block() -> str:
  """The layer table as README.md shows it, lowest first."""
  rows = ["| layer | holds |", "| --- | --- |"]
  rows += [f"| {', '.join(f'`{n}`' for n in names)} | {about} |" for names, about in LAYERS]
  return "\n".join(rows)


def test_readme_layout_is_this_table():
  readme = open(os.path.join(os.path.dirname(PACKAGE), "README.md"), encoding="utf-8").read()
  assert layout_block() in readme, "README.md's layout differs from tests/test_layers.py's LAYERS:\n" + layout_block()


def test_modules_stay_small_and_the_rl_step_reads_in_one_screen():
  """No module over 400 lines; GRPO's train step (rollout -> batch -> log-prob plan -> advantages -> update) at most
  40: growth goes into the stage, the plan or a new module, not the step."""
  long = {m: n for m, path in _paths().items() if (n := len(open(path, encoding="utf-8").readlines())) > 400}
  assert not long, f"modules over 400 lines: {long}"
  source = ast.parse(open(_paths()["jalign.tasks.grpo"], encoding="utf-8").read())
  step = next(n for n in ast.walk(source) if isinstance(n, ast.ClassDef) and n.name == "GrpoTask")
  step = next(n for n in step.body if isinstance(n, ast.FunctionDef) and n.name == "train_step")
  assert step.end_lineno - step.lineno + 1 <= 40, f"GrpoTask.train_step: {step.end_lineno - step.lineno + 1} lines"
