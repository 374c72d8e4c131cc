"""Config sections: frozen dataclasses, each declared beside the code that reads it, built from an
`ml_collections.ConfigDict` at the boundary (`to_dataclass`) and turned back into one with every key and default
(`defaults`).

Every key is checked: an unknown key, a wrong type, a value outside its accepted set or outside the bounds declared
on its field (`bounded`) is a `ConfigError` naming the dotted key (`config.train.batch_size`) and what is accepted.
Checks that involve several keys sit beside their section (its `check` method) or their task.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Literal

import ml_collections

from jalign.core.errors import ConfigError


def bounded(default, *, gt=None, ge=None, lt=None, le=None, finite: bool = True):
  """A field with declared bounds (None: no bound on that side), checked whenever the section is built from a
  config; numbers must be finite unless `finite=False`."""
  return dataclasses.field(default=default, metadata={"bounds": (gt, ge, lt, le, finite)})


def _check_bounds(value, bounds, key: str) -> None:
  if value is None:
    return
  gt, ge, lt, le, finite = bounds
  if finite and isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"{key}={value}: must be a {'positive' if gt == 0 else 'finite'} number")
  if gt == 0 and lt is None and le is None and not value > 0:
    raise ConfigError(f"{key}={value}: must be positive")
  low = "" if gt is None and ge is None else (f"({gt}" if gt is not None else f"[{ge}")
  high = "" if lt is None and le is None else (f"{lt})" if lt is not None else f"{le}]")
  ok = ((gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
        and (le is None or value <= le))
  if not ok:
    if not high:
      raise ConfigError(f"{key}={value}: must be {'>' if gt is not None else '>='} {gt if gt is not None else ge}")
    if not low:
      raise ConfigError(f"{key}={value}: must be {'<' if lt is not None else '<='} {lt if lt is not None else le}")
    raise ConfigError(f"{key}={value}: must be in {low}, {high}")


def _describe(tp) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  if origin is tuple:
    return "a tuple"
  if dataclasses.is_dataclass(tp):
    return f"a section ({tp.__name__})"
  return getattr(tp, "__name__", str(tp))


def _convert(value, tp, key: str):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own error is the helpful one
      return _convert(value, options[0], key)
    for a in options:
      try:
        return _convert(value, a, key)
      except ConfigError:
        pass
    raise ConfigError(f"{key}: {value!r:.60} is not {_describe(tp)}")
  if origin is Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{key}: {value!r} is not accepted; accepted: "
                        + ", ".join(repr(a) for a in typing.get_args(tp)))
    return value
  if dataclasses.is_dataclass(tp):
    return to_dataclass(tp, value, key)
  if origin is tuple:
    if not isinstance(value, (tuple, list)):
      raise ConfigError(f"{key}: expected a tuple, found {type(value).__name__} {value!r:.60}")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if args and len(args) != len(value):
      raise ConfigError(f"{key}: expected {len(args)} entries, found {len(value)}")
    if args:
      return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}: expected True or False, found {type(value).__name__} {value!r:.60}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}: expected an integer, found {type(value).__name__} {value!r:.60}")
    return value
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}: expected a number, found {type(value).__name__} {value!r:.60}")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}: expected a string, found {type(value).__name__} {value!r:.60}")
    return value
  return value


def defaults(section) -> ml_collections.ConfigDict:
  """Every key of a section instance with its default, as a ConfigDict (sub-sections nested): configs start from it
  and state only what they change, and any key can be set on the command line. An unset optional number is a typed
  placeholder (`--config.policy_loss.clip_c=3` works); an unset optional section (`model.arch`) is None until a config gives
  it."""
  hints = typing.get_type_hints(type(section))
  out = {}
  for f in dataclasses.fields(section):
    if not f.init:
      continue
    value = getattr(section, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = defaults(value)
    elif value is None:
      scalar = [a for a in typing.get_args(hints[f.name]) if a in (int, float, str, bool)]
      out[f.name] = ml_collections.config_dict.placeholder(scalar[0]) if scalar else None
    else:
      out[f.name] = value
  return ml_collections.ConfigDict(out)


def to_dataclass(cls, values, key: str = "config"):
  """Builds dataclass `cls` from a mapping (ConfigDict or dict), checking every key and type."""
  if dataclasses.is_dataclass(values) and isinstance(values, cls):
    return values
  if hasattr(values, "to_dict"):
    values = values.to_dict()
  if not isinstance(values, dict):
    raise ConfigError(f"{key}: expected a section of keys ({cls.__name__}), found {type(values).__name__}")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"{key}.{unknown[0]}: unknown key; accepted keys of {key}: {', '.join(sorted(fields))}")
  kwargs = {name: _convert(v, hints[name], f"{key}.{name}") for name, v in values.items()}
  for f in dataclasses.fields(cls):
    if f.name in kwargs and "bounds" in f.metadata:
      _check_bounds(kwargs[f.name], f.metadata["bounds"], f"{key}.{f.name}")
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{key}: {e}") from None


def bounds_text(bounds) -> str:
  """A field's declared bounds as a reader writes them: '> 0', '>= 1', 'in [0, 1)'."""
  gt, ge, lt, le, _ = bounds
  low = "" if gt is None and ge is None else (f"({gt}" if gt is not None else f"[{ge}")
  high = "" if lt is None and le is None else (f"{lt})" if lt is not None else f"{le}]")
  if low and high:
    return f"in {low}, {high}"
  if low:
    return f"> {gt}" if gt is not None else f">= {ge}"
  if high:
    return f"< {lt}" if lt is not None else f"<= {le}"
  return ""


def listing(cls, values, key: str = "config") -> list[str]:
  """One line per key of section `cls`, with its value in `values` (a mapping), its type and its bounds:
  `config.train.steps = 1500  (int, > 0)`; sub-sections nested."""
  if hasattr(values, "to_dict"):
    values = values.to_dict()
  hints = typing.get_type_hints(cls)
  lines = []
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    value, tp = (values or {}).get(f.name), hints[f.name]
    options = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
    if dataclasses.is_dataclass(options[0]) and isinstance(value, dict):
      lines += listing(options[0], value, f"{key}.{f.name}")
      continue
    about = _describe(tp).replace("NoneType", "None") + (f", {bounds_text(f.metadata['bounds'])}" if "bounds" in f.metadata and
                             bounds_text(f.metadata["bounds"]) else "")
    lines.append(f"{key}.{f.name} = {value!r}  ({about})")
  return lines


def field_docs(cls) -> dict[str, str]:
  """Each field's comment in the source of section `cls`: the comment on its line, the comment lines indented under
  it that continue it, and a comment block right above it at its own indentation."""
  import ast
  import inspect
  import io
  import textwrap
  import tokenize
  source = textwrap.dedent(inspect.getsource(cls))
  comments = {tok.start[0]: (tok.start[1], tok.string.lstrip("#").strip())
              for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
  lines = source.splitlines()
  only_comment = lambda n: 0 < n <= len(lines) and lines[n - 1].lstrip().startswith("#")  # noqa: E731
  out = {}
  for node in ast.parse(source).body[0].body:
    if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
      continue
    column, above, n = node.col_offset, [], node.lineno - 1
    while only_comment(n) and comments[n][0] == column:
      above.insert(0, comments[n][1])
      n -= 1
    own = [comments[i][1] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
    n = node.end_lineno + 1
    while own and only_comment(n) and comments[n][0] > column:
      own.append(comments[n][1])
      n += 1
    out[node.target.id] = " ".join(above + own)
  return out


def reference(cls, key: str = "config") -> list[str]:
  """Markdown tables of every key of section `cls` (and its sub-sections): type, default, bounds and the comment
  its declaration carries."""
  hints, docs = typing.get_type_hints(cls), field_docs(cls)
  rows, nested = [], []
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    tp = hints[f.name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(tp):
      nested += ["", f"### `{key}.{f.name}`" + (f": {docs[f.name]}" if docs.get(f.name) else ""), ""]
      nested += reference(tp, f"{key}.{f.name}")
      continue
    bounds = bounds_text(f.metadata["bounds"]) if "bounds" in f.metadata else ""
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    rows.append(f"| `{f.name}` | {cell(_describe(tp).replace('NoneType', 'None'))} | `{cell(repr(default))}` | "
                f"{cell(bounds)} | {cell(docs.get(f.name, ''))} |")
  table = ["| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"] + rows if rows else []
  return table + nested
