"""SentencePiece `tokenizer.model` files (Llama 2, Mistral v1-v7, Gemma 1, T5) as a `tokenizers.Tokenizer`.

The file is a serialised `ModelProto` (sentencepiece's `sentencepiece_model.proto`), read here with a minimal
protobuf wire-format reader, so neither sentencepiece nor generated protobuf classes are needed. The pipeline
reproduces SentencePiece's encoding:
- normalisation: the precompiled character map (e.g. nmt_nfkc) when the model has one; extra spaces removed when
  `remove_extra_whitespaces`; every space escaped as U+2581 "▁"; one "▁" prepended when `add_dummy_prefix`;
- BPE models: a merge for every piece split into two pieces, ranked by the merged piece's score (SentencePiece merges
  the highest-scoring adjacent pair first), unknown bytes as <0xNN> pieces when `byte_fallback`;
  Unigram models: the pieces and their log-probabilities;
- control and user-defined pieces (<s>, [INST], ...) as added tokens matched in text, as transformers converts them;
  the dummy prefix then applies to each stretch of text between them.
Nothing is added around an encoding (sentencepiece's and transformers' default for a bare model file); chat templates
write their bos token themselves.
"""
from __future__ import annotations

import dataclasses
import struct

from tokenizers import (
  AddedToken,
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
)

from jalign.core.errors import UserError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
SPACE = "\u2581"


class SpmError(UserError):
  pass


@dataclasses.dataclass
class SpmModel:
  pieces: list[tuple[str, float, int]]   # (piece, score, type), in id order
  model_type: int = UNIGRAM
  byte_fallback: bool = False
  split_digits: bool = False
  treat_whitespace_as_suffix: bool = False
  ids: dict = dataclasses.field(default_factory=lambda: {"unk": 0, "bos": 1, "eos": 2, "pad": -1})
  charsmap: bytes = b""
  add_dummy_prefix: bool = True
  remove_extra_whitespaces: bool = True
  escape_whitespaces: bool = True


# Protobuf wire format ----------------------------------------------------------------------------------------------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = value = 0
  while True:
    b = buf[i]
    i += 1
    value |= (b & 0x7F) << shift
    if b < 0x80:
      return value, i
    shift += 7


def _fields(buf: bytes):
  """(field number, wire type, value) of a message; value: int (varint), bytes (length-delimited), raw 4/8 bytes."""
  i = 0
  while i < len(buf):
    key, i = _varint(buf, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(buf, i)
    elif wire == 2:
      n, i = _varint(buf, i)
      value, i = buf[i:i + n], i + n
    elif wire == 5:
      value, i = buf[i:i + 4], i + 4
    elif wire == 1:
      value, i = buf[i:i + 8], i + 8
    else:
      raise SpmError(f"protobuf wire type {wire} at byte {i}")
    if i > len(buf):
      raise SpmError("truncated")
    yield number, wire, value


def _int32(v: int) -> int:
  return v - (1 << 64) if v >= 1 << 63 else v


def parse(data: bytes) -> SpmModel:
  m = SpmModel(pieces=[])
  for number, wire, value in _fields(data):
    if number == 1 and wire == 2:  # ModelProto.pieces
      piece, score, kind = "", 0.0, NORMAL
      for n, w, v in _fields(value):
        if n == 1 and w == 2:
          piece = v.decode("utf-8")
        elif n == 2 and w == 5:
          score = struct.unpack("<f", v)[0]
        elif n == 3 and w == 0:
          kind = v
      m.pieces.append((piece, score, kind))
    elif number == 2 and wire == 2:  # TrainerSpec
      for n, w, v in _fields(value):
        if w != 0:
          continue
        if n == 3:
          m.model_type = v
        elif n == 35:
          m.byte_fallback = bool(v)
        elif n == 25:
          m.split_digits = bool(v)
        elif n == 24:
          m.treat_whitespace_as_suffix = bool(v)
        elif n in (40, 41, 42, 43):
          m.ids[("unk", "bos", "eos", "pad")[n - 40]] = _int32(v)
    elif number == 3 and wire == 2:  # NormalizerSpec
      for n, w, v in _fields(value):
        if n == 2 and w == 2:
          m.charsmap = bytes(v)
        elif n == 3 and w == 0:
          m.add_dummy_prefix = bool(v)
        elif n == 4 and w == 0:
          m.remove_extra_whitespaces = bool(v)
        elif n == 5 and w == 0:
          m.escape_whitespaces = bool(v)
  if not m.pieces:
    raise SpmError("no pieces: not a SentencePiece model")
  return m


# The tokenizers pipeline -------------------------------------------------------------------------------------------

def _merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
  ranked = []
  for piece, score in scores.items():
    splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
    splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    ranked.extend((score, left, right) for left, right in splits)
  ranked.sort(key=lambda t: -t[0])  # stable: equal scores keep piece order, then the split order above
  return [(left, right) for _, left, right in ranked]


def to_tokenizer(m: SpmModel, where: str) -> tuple[Tokenizer, dict]:
  """The tokenizer and a tokenizer_config-style dict of its special tokens."""
  if m.treat_whitespace_as_suffix or not m.escape_whitespaces:
    raise SpmError(f"{where}: treat_whitespace_as_suffix / escape_whitespaces=false are not supported")
  vocab = {piece: i for i, (piece, _, _) in enumerate(m.pieces)}
  unk = m.ids["unk"]
  unk_piece = m.pieces[unk][0] if 0 <= unk < len(m.pieces) else None
  if m.model_type == BPE:
    scores = {p: s for p, s, kind in m.pieces if kind in (NORMAL, USER_DEFINED)}
    model = models.BPE(vocab, _merges(vocab, scores), unk_token=unk_piece, fuse_unk=True,
                       byte_fallback=m.byte_fallback)
  elif m.model_type == UNIGRAM:
    model = models.Unigram([(p, s) for p, s, _ in m.pieces], unk_id=unk if unk_piece else None,
                           byte_fallback=m.byte_fallback)
  else:
    raise SpmError(f"{where}: model type {m.model_type} (WORD / CHAR) is not supported; accepted: BPE, Unigram")
  tk = Tokenizer(model)
  steps = [normalizers.Precompiled(m.charsmap)] if m.charsmap else []
  if m.remove_extra_whitespaces:
    steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
  steps.append(normalizers.Replace(" ", SPACE))
  if m.add_dummy_prefix:
    steps.append(normalizers.Prepend(SPACE))
  tk.normalizer = normalizers.Sequence(steps)
  if m.split_digits:
    tk.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
  steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  if m.add_dummy_prefix:
    steps.append(decoders.Strip(" ", 1, 0))
  tk.decoder = decoders.Sequence(steps)
  tk.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, _, kind in m.pieces
                         if kind in (CONTROL, UNKNOWN)])
  tk.add_tokens([AddedToken(p, special=False, normalized=False) for p, _, kind in m.pieces if kind == USER_DEFINED])
  config = {f"{name}_token": m.pieces[i][0] for name, i in m.ids.items() if 0 <= i < len(m.pieces)}
  return tk, config


def load(path: str) -> tuple[Tokenizer, dict]:
  with open(path, "rb") as f:
    data = f.read()
  try:
    return to_tokenizer(parse(data), path)
  except SpmError as e:
    raise SpmError(f"{path}: not a SentencePiece model the tokenizer can read ({e})") from None
  except (IndexError, UnicodeDecodeError, struct.error) as e:
    raise SpmError(f"{path}: not a SentencePiece model (unreadable protobuf: {e})") from None
