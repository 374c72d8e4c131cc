"""jalign's modules import one way: each layer only from the layers below it, and no module (through any chain of
imports, function-local ones included) from itself."""
import ast
import os

import jalign

PACKAGE = os.path.dirname(jalign.__file__)
# Lowest first. A module may import modules of its own layer's package and of lower layers.
LAYERS = [
    ("errors", "files"),
    ("sections",),
    ("kernels", "spm"),
    ("models", "gguf_tokenizer"),
    ("tokenizer",),
    ("parallel",),
    ("sampling",),
    ("losses",),
    ("objectives",),
    ("data",),
    ("rl",),
    ("eval",),
    ("config",),
    ("train",),
    ("tasks",),
    ("run", "fit"),
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, set[str]]:
  """jalign module -> the jalign modules it imports."""
  names = {}
  for root, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
        names[rel.removesuffix(".__init__")] = os.path.join(root, f)
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
