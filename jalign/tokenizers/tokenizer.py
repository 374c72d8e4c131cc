"""Hugging Face tokenizers (`tokenizer.json` + `tokenizer_config.json`, or a SentencePiece `tokenizer.model`), the
tokenizer inside a llama.cpp `.gguf` file, and chat templates.

Templates render in a sandboxed jinja2 environment set up as transformers sets it up (trim_blocks, lstrip_blocks,
loop controls, a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`, the named special tokens as
variables), and the text is encoded without adding special tokens, so ids equal `apply_chat_template`'s.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from jalign.core import files
from jalign.core.errors import UserError
from jalign.tokenizers import gguf_tokenizer, spm

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "chat_template.json")


class TokenizerError(UserError):
  """A tokenizer or chat template that cannot be used; the message names the file (and line)."""


class ChatTemplateError(TokenizerError):
  pass


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # serialised AddedToken
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise TokenizerError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
  except UnicodeDecodeError as e:
    raise TokenizerError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
  if not isinstance(data, dict):
    raise TokenizerError(f"{path}: expected a JSON object, found {type(data).__name__}")
  return data


def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special tokens and chat template(s) of its `tokenizer_config.json`."""

  def __init__(self, tokenizer: _HFTokenizer, config: dict, chat_template: str | dict | None = None,
               source: str = "<memory>", files: dict[str, str] | None = None):
    self.tk = tokenizer
    self.config = config
    self.source = source
    self._files = files or {}
    self.special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS if _token_text(config.get(k))}
    for name, text in self.special.items():
      if self.tk.token_to_id(text) is None:
        raise TokenizerError(f"{source}: {name} {text!r} is not in the vocabulary of tokenizer.json")
    self.chat_templates: dict[str, jinja2.Template] = {}
    templates = {"default": chat_template} if isinstance(chat_template, str) else dict(chat_template or {})
    env = _environment()
    for name, text in templates.items():
      where = self._files.get("chat_template", source)
      try:
        self.chat_templates[name] = env.from_string(text)
      except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: chat template {name!r} line {e.lineno}: {e.message}") from None

  # Vocabulary and special ids ----------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return self.tk.get_vocab_size(with_added_tokens=True)

  def token_id(self, name: str) -> int | None:
    text = self.special.get(name)
    return None if text is None else self.tk.token_to_id(text)

  bos_id = property(lambda self: self.token_id("bos_token"))
  eos_id = property(lambda self: self.token_id("eos_token"))

  @property
  def pad_id(self) -> int:
    """The pad token's id, or the eos id when there is none (TRL's fallback)."""
    pad = self.token_id("pad_token")
    if pad is None:
      pad = self.eos_id
    if pad is None:
      raise TokenizerError(f"{self.source}: neither pad_token nor eos_token is set in tokenizer_config.json")
    return pad

  # Text <-> ids ------------------------------------------------------------------------------------------------
  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
    return [self.decode(r, skip_special_tokens) for r in rows]

  # Chat templates ----------------------------------------------------------------------------------------------
  def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
                  template: str | None = None, **kwargs) -> str:
    if not self.chat_templates:
      raise ChatTemplateError(f"{self.source}: no chat template (tokenizer_config.json 'chat_template' or "
                              "chat_template.jinja)")
    name = template or ("default" if "default" in self.chat_templates else None)
    if name not in self.chat_templates:
      raise ChatTemplateError(f"{self.source}: chat template {template!r} not found; available: "
                              f"{', '.join(sorted(self.chat_templates))}")
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or "role" not in m:
        raise ChatTemplateError(f"message {i}: expected a dict with 'role' and 'content', got {m!r:.80}")
    try:
      return self.chat_templates[name].render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
                                              **{**self.special, **kwargs})
    except jinja2.exceptions.SecurityError as e:
      raise ChatTemplateError(f"{self.source}: chat template refused an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{self.source}: chat template failed: {e}") from None

  def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
                          tokenize: bool = True, **kwargs) -> list[int] | str:
    text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  # Files -------------------------------------------------------------------------------------------------------
  def save(self, out_dir: str) -> None:
    """Copies the files this tokenizer was loaded from (byte for byte) into `out_dir`; one read from a .gguf is
    written as tokenizer.json + tokenizer_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    if os.path.isfile(self.source):
      config = dict(self.config)
      files.write_text(os.path.join(out_dir, "tokenizer.json"), self.tk.to_str())
      files.write_json(os.path.join(out_dir, "tokenizer_config.json"), config, indent=2, ensure_ascii=False)
      return
    for name in FILES:
      src = os.path.join(self.source, name)
      if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
        with files.atomic_path(os.path.join(out_dir, name)) as tmp:
          shutil.copyfile(src, tmp)


def load(path: str) -> Tokenizer:
  """Loads a tokenizer directory as transformers writes it: `tokenizer.json`, else a SentencePiece `tokenizer.model`
  (its special tokens from the model file unless tokenizer_config.json names them); a chat template from
  tokenizer_config.json, chat_template.jinja or chat_template.json. A `.gguf` file: the tokenizer it holds."""
  if path.endswith(".gguf") and os.path.isfile(path):
    try:
      tk, config = gguf_tokenizer.load(path)
    except (gguf_tokenizer.GgufTokenizerError, spm.SpmError) as e:
      raise TokenizerError(str(e)) from None
    return Tokenizer(tk, config, config.get("chat_template"), source=path, files={"chat_template": path})
  if not os.path.exists(path):
    raise TokenizerError(f"{path}: not found (no such file or directory)")
  tok_file = os.path.join(path, "tokenizer.json")
  spm_file = os.path.join(path, "tokenizer.model")
  config = {}
  if os.path.isfile(tok_file):
    try:
      tk = _HFTokenizer.from_file(tok_file)
    except Exception as e:  # the Rust library raises a plain Exception with its parse error
      raise TokenizerError(f"{tok_file}: cannot be read by the tokenizers library: {e}") from None
  elif os.path.isfile(spm_file):
    try:
      tk, config = spm.load(spm_file)
    except spm.SpmError as e:
      raise TokenizerError(str(e)) from None
  else:
    raise TokenizerError(f"{path}: neither tokenizer.json (a fast tokenizer in the `tokenizers` format) nor "
                         "tokenizer.model (SentencePiece)")
  cfg_file = os.path.join(path, "tokenizer_config.json")
  if os.path.isfile(cfg_file):
    config = {**config, **_read_json(cfg_file)}
  stm = os.path.join(path, "special_tokens_map.json")
  if os.path.isfile(stm):
    config = {**_read_json(stm), **config}
  files = {}
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
    try:
      template = {t["name"]: t["template"] for t in template}
    except (KeyError, TypeError):
      raise ChatTemplateError(f"{cfg_file}: chat_template list entries need 'name' and 'template'") from None
  elif template is not None and not isinstance(template, str):
    raise ChatTemplateError(f"{cfg_file}: chat_template must be a string or a list of named templates, "
                            f"found {type(template).__name__}")
  else:
    files["chat_template"] = cfg_file
  jinja_file = os.path.join(path, "chat_template.jinja")
  json_file = os.path.join(path, "chat_template.json")
  if os.path.isfile(jinja_file):  # newer transformers save the template beside the config
    with open(jinja_file, encoding="utf-8") as f:
      template = f.read()
    files["chat_template"] = jinja_file
  elif template is None and os.path.isfile(json_file):
    template = _read_json(json_file).get("chat_template")
    files["chat_template"] = json_file
  return Tokenizer(tk, config, template, source=path, files=files)


def shared_vocabulary(student: Tokenizer, teacher: Tokenizer, *, student_rows: int, teacher_rows: int) -> int:
  """The number of token ids a student and a teacher share, to slice both models' logits to before comparing their
  distributions token by token (distillation): the tokenizers' common vocabulary, when every id means the same token
  in both; the models' embedding rows past it are padding (Qwen pads 151,669 tokens to 151,936 or 152,064 rows) and
  are left out. Anything else is a `TokenizerError` naming both tokenizers and the first id that differs."""
  s_vocab, t_vocab = student.tk.get_vocab(with_added_tokens=True), teacher.tk.get_vocab(with_added_tokens=True)
  s_ids, t_ids = {i: t for t, i in s_vocab.items()}, {i: t for t, i in t_vocab.items()}
  names = f"the student's tokenizer {student.source} and the teacher's {teacher.source}"
  for i in range(max(max(s_ids), max(t_ids)) + 1):
    if s_ids.get(i) != t_ids.get(i):
      said = lambda t: "no token" if t is None else repr(t)  # noqa: E731
      raise TokenizerError(f"{names} differ at id {i}: {said(s_ids.get(i))} in the student's, "
                           f"{said(t_ids.get(i))} in the teacher's; distillation compares the two distributions "
                           "token by token, so the models must share a tokenizer")
  shared = max(s_ids) + 1
  for who, rows in (("student", student_rows), ("teacher", teacher_rows)):
    if rows < shared:
      raise TokenizerError(f"{names} have {shared} tokens, more than the {who} model's {rows} embedding rows: the "
                           "tokenizer does not belong to that model")
  return shared
