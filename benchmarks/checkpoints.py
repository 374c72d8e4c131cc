"""The model a peer benchmark runs on both sides: the tiny random Llama (the default) or a real one (`--model`).

    --model DIR          a Hugging Face directory (config.json, *.safetensors, tokenizer.json)
    --model FILE.gguf    a llama.cpp file, dequantised to fp32 by transformers' own GGUF loader into an HF directory

Both sides read the same directory in fp32. Records are made of whole-word tokens of the model's own vocabulary (for
a real tokenizer: words that encode to exactly one token, so a text of n words is n tokens on both sides): throughput
depends on shapes, not on what the words say.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

TINY = dict(hidden_size=256, num_hidden_layers=4, vocab_size=4096, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=688)
PAD, EOS, BOS = 0, 1, 2


def add_model_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--model", default="", help="an HF directory or a .gguf file (default: the tiny random Llama: "
                      "hidden 256, 4 layers, vocab 4096)")


@dataclasses.dataclass
class Checkpoint:
  path: str                 # an HF directory both sides load
  workdir: str              # where the benchmark writes its records (never the model's own directory)
  description: str
  word_ids: np.ndarray      # token ids that are whole words: id <-> " " + word, one token each
  words: list[str]
  eos_id: int
  pad_id: int
  tiny: bool

  def ids(self, n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).choice(self.word_ids, n).tolist()

  def text(self, n: int, seed: int) -> str:
    """n tokens of text, each word with its leading space: the same ids on both sides."""
    picks = np.random.RandomState(seed).randint(0, len(self.words), n)
    return "".join(" " + self.words[i] for i in picks)


def prepare(model: str, workdir: str) -> Checkpoint:
  """The tiny Llama or a .gguf converted is written to `workdir`/model; an HF directory is read where it is."""
  out = os.path.join(workdir, "model")
  if not model:
    return _tiny(out, workdir)
  name = os.path.basename(os.path.normpath(model))
  if model.endswith(".gguf"):
    _from_gguf(model, out)
    model = out
  elif not os.path.isfile(os.path.join(model, "config.json")):
    raise SystemExit(f"--model {model}: neither a .gguf file nor an HF directory with config.json")
  return _real(model, workdir, name)


def _tiny(path: str, workdir: str) -> Checkpoint:
  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(**TINY, max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=EOS,
                                 pad_token_id=PAD, bos_token_id=BOS)
  transformers.LlamaForCausalLM(cfg).save_pretrained(path)
  words = [f"w{i}" for i in range(3, TINY["vocab_size"])]
  tk = Tokenizer(models.WordLevel({"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, **{w: i + 3 for i, w in enumerate(words)}},
                                  unk_token="w3"))
  tk.pre_tokenizer = pre_tokenizers.Whitespace()
  transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                       bos_token="<bos>").save_pretrained(path)
  return Checkpoint(path, workdir, "tiny random Llama (hidden 256, 4 layers, vocab 4096)",
                    np.arange(3, TINY["vocab_size"]), words, EOS, PAD, tiny=True)


def _from_gguf(gguf: str, out: str) -> None:
  import torch
  import transformers
  directory, name = os.path.split(os.path.abspath(gguf))
  lm = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
  lm.hf_quantizer = None  # dequantised to fp32 now: saved as such
  if hasattr(lm.config, "quantization_config"):
    del lm.config.quantization_config
  lm.save_pretrained(out)
  transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)


def _real(path: str, workdir: str, name: str) -> Checkpoint:
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(path)
  cfg = json.load(open(os.path.join(path, "config.json")))
  words, ids = [], []
  for token, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
    word = tok.convert_tokens_to_string([token])
    if (word.startswith(" ") and word[1:].isalpha() and word[1:].isascii() and len(word) > 3
        and tok.encode(word, add_special_tokens=False) == [i]):
      words.append(word[1:])
      ids.append(i)
  if len(words) < 256:
    raise SystemExit(f"--model {path}: only {len(words)} whole-word tokens in its vocabulary")
  layers, hidden = cfg.get("num_hidden_layers"), cfg.get("hidden_size")
  return Checkpoint(path, workdir, f"{name} ({cfg.get('model_type')}, hidden {hidden}, {layers} layers, vocab "
                    f"{cfg.get('vocab_size')})", np.asarray(ids), words, tok.eos_token_id,
                    tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                    tiny=False)
