"""The tokenizer inside a llama.cpp `.gguf` file, as a `tokenizers.Tokenizer` and a tokenizer_config-style dict.

GGUF keeps the vocabulary under `tokenizer.ggml.*`: the token strings in id order, their types (1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte), and either BPE merges (`model` "gpt2": byte-level BPE, with the
pre-tokenizer named by `tokenizer.ggml.pre`) or SentencePiece scores (`model` "llama": read as jalign.tokenizers.spm reads a
tokenizer.model), plus the special-token ids and `tokenizer.chat_template`. Byte-level pre-tokenizers known here (the
regexes llama.cpp and the models' own tokenizer.json use for each name): gpt-2 (GPT-2's regex), smollm and starcoder
(digits one by one, then GPT-2's regex), llama-bpe (Llama 3), qwen2 (Qwen 2 / 3).
"""
from __future__ import annotations

from tokenizers import (
  AddedToken,
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
)

from jalign.core import gguf_reader
from jalign.core.errors import UserError
from jalign.tokenizers import spm

# tokenizer.ggml.pre -> (split regex before byte-level mapping or None for GPT-2's own, digits one by one, NFC)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE = {"gpt-2": (None, False, False), "smollm": (None, True, False), "starcoder": (None, True, False),
       "llama-bpe": (LLAMA3_SPLIT, False, False), "qwen2": (QWEN2_SPLIT, False, True)}


class GgufTokenizerError(UserError):
  pass


def _byte_level(tokens, types, merges, pre: str, where: str) -> Tokenizer:
  if pre not in PRE:
    raise GgufTokenizerError(f"{where}: tokenizer.ggml.pre {pre!r} is not known; known: {', '.join(sorted(PRE))}")
  split, digits, nfc = PRE[pre]
  vocab = {t: i for i, t in enumerate(tokens)}
  tk = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False))
  if nfc:
    tk.normalizer = normalizers.NFC()
  steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
  if split is None:
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
  else:
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
  tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
  tk.decoder = decoders.ByteLevel()
  tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                         if k in (spm.CONTROL, spm.UNKNOWN)])
  tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                 if k == spm.USER_DEFINED])
  return tk


def load(path: str) -> tuple[Tokenizer, dict]:
  _, meta = gguf_reader.read(path, GgufTokenizerError)
  kind = meta.get("tokenizer.ggml.model")
  tokens = meta.get("tokenizer.ggml.tokens")
  if not tokens:
    raise GgufTokenizerError(f"{path}: no tokenizer.ggml.tokens: the file holds no tokenizer")
  types = meta.get("tokenizer.ggml.token_type") or [spm.NORMAL] * len(tokens)
  if kind == "gpt2":
    tk = _byte_level(tokens, types, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre", "gpt-2"),
                     path)
  elif kind == "llama":
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    model = spm.SpmModel(pieces=list(zip(tokens, scores, types)), model_type=spm.BPE, byte_fallback=True,
                         add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                         remove_extra_whitespaces=False)
    tk, _ = spm.to_tokenizer(model, path)
  else:
    raise GgufTokenizerError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; accepted: gpt2 (byte-level "
                             "BPE), llama (SentencePiece)")
  config = {}
  for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                    ("pad", "padding_token_id")):
    i = meta.get(f"tokenizer.ggml.{key}")
    if i is not None and 0 <= int(i) < len(tokens):
      config[f"{name}_token"] = tokens[int(i)]
  if "tokenizer.chat_template" in meta:
    config["chat_template"] = meta["tokenizer.chat_template"]
  bos, eos = config.get("bos_token"), config.get("eos_token")
  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos
  if add_bos or add_eos:
    template = (f"{bos} " if add_bos else "") + "$A" + (f" {eos}" if add_eos else "")
    specials = [(t, tk.token_to_id(t)) for t in (bos if add_bos else None, eos if add_eos else None) if t]
    tk.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
  return tk, config
