"""Hugging Face checkpoints in and out: `from_pretrained` and `save_pretrained` (causal LMs), and
`load_sequence_classifier` / `save_pretrained(..., score=...)` (`*ForSequenceClassification` with one label: reward
models and critics).

Tensors are renamed and reshaped between HF's per-layer `[out, in]` Linear weights and jalign's stacked
`[layers, in, heads, head_dim]`-style parameters, converted to the requested dtype, and each device's shard is read
straight from the memory-mapped files (`jax.make_array_from_callback`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign.core import files
from jalign.core.errors import CheckpointError, ConfigError
from jalign.models import hf_tensors, lora, mxfp4, sharding
from jalign.models import safetensors_io as st
from jalign.models.config import ModelConfig
from jalign.models.decoder import Decoder
from jalign.models.gguf_io import GgufFile
from jalign.models.hf_config import from_hf_config, load_hf_config, to_hf_config
from jalign.models.sharding import DEFAULT_RULES, state_shardings

INDEX = "model.safetensors.index.json"


# Tensors some checkpoints carry that the model recomputes (old RoPE buffers) or that belong to other towers.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.)")


def _open_checkpoint(path: str) -> dict[str, st.LazyFile]:
  """HF tensor name -> the lazily opened file that holds it (single file or sharded with an index)."""
  index_file = os.path.join(path, INDEX)
  if os.path.exists(index_file):
    try:
      with open(index_file, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index_file}: not a valid safetensors index ({e!r})") from None
    files: dict[str, st.LazyFile] = {}
    for shard in sorted(set(weight_map.values())):
      shard_path = os.path.join(path, shard)
      if not os.path.exists(shard_path):
        raise CheckpointError(f"{index_file} lists shard {shard!r}, which is missing from {path}")
      files[shard] = st.LazyFile(shard_path)
    out = {}
    for name, shard in weight_map.items():
      if name not in files[shard].keys():
        raise CheckpointError(f"{index_file} says {name!r} is in {shard!r}, but that file does not hold it")
      out[name] = files[shard]
    return out
  single = os.path.join(path, "model.safetensors")
  if not os.path.exists(single):
    found = sorted(os.listdir(path)) if os.path.isdir(path) else []
    raise CheckpointError(f"{path}: no model.safetensors or {INDEX} (found: {', '.join(found) or 'nothing'}); "
                          "only safetensors checkpoints are read")
  lazy = st.LazyFile(single)
  return {name: lazy for name in lazy.keys()}


def _hf_prefix(names) -> str:
  """Prefix of the decoder's tensors: 'model.' for causal LMs, 'language_model.model.' (or
  'model.language_model.') inside multimodal Gemma 3 checkpoints."""
  for name in names:
    if name.endswith("embed_tokens.weight"):
      return name[: -len("embed_tokens.weight")]
  raise CheckpointError("no '*embed_tokens.weight' tensor in the checkpoint: not a decoder LM checkpoint")


def from_pretrained(path: str, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None, *,
                    rules=DEFAULT_RULES, compute_dtype: str | None = None, **overrides) -> Decoder:
  """Loads an HF checkpoint directory (or a llama.cpp `.gguf` file, see `gguf_io`) into a `Decoder`, each parameter placed in its sharded layout on `mesh`
  (one device when None). `dtype` is the parameter dtype (default: the checkpoint's); `overrides` set runtime
  fields of `ModelConfig` (scan_layers, remat, ...)."""
  return _load(path, dtype, mesh, rules=rules, compute_dtype=compute_dtype, score=False, **overrides)[0]


def load_sequence_classifier(path: str, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None, *,
                             rules=DEFAULT_RULES, compute_dtype: str | None = None, **overrides
                             ) -> tuple[Decoder, np.ndarray]:
  """An HF `*ForSequenceClassification` checkpoint with one label -> (backbone Decoder, score weight [D] fp32).
  The backbone has no LM head of its own (a classifier checkpoint carries none)."""
  return _load(path, dtype, mesh, rules=rules, compute_dtype=compute_dtype, score=True, **overrides)


def _load(path: str, dtype, mesh, *, rules, compute_dtype, score: bool, **overrides):
  if path.endswith(".gguf"):  # llama.cpp: one file, dequantised to float32 tensor by tensor
    gguf = GgufFile(path)
    cfg, tensors = from_hf_config(gguf.config, where=path), {name: gguf for name in gguf.keys()}
  else:
    cfg, _ = load_hf_config(path)
  dtype = dtype or cfg.param_dtype
  cfg = cfg.replace(param_dtype=dtype, dtype=compute_dtype or dtype, **overrides)
  if not path.endswith(".gguf"):
    _check_tokenizer_vocab(path, cfg)
    tensors = _open_checkpoint(path)
  prefix = _hf_prefix(tensors)
  lm_head_prefix = prefix[: -len("model.")] if prefix.endswith("model.") else ""
  score_weight = None
  if score:
    name = lm_head_prefix + "score.weight"
    if name not in tensors:
      raise CheckpointError(f"{path}: no {name!r} tensor: not a sequence-classification checkpoint")
    score_weight = np.asarray(tensors[name].get(name), np.float32)
    if score_weight.shape != (1, cfg.hidden_size):
      raise CheckpointError(f"{tensors[name].path}: tensor {name!r} has shape {score_weight.shape}, expected "
                            f"(1, {cfg.hidden_size}): only single-label (scalar) classifiers are reward models")
    cfg = cfg.replace(tie_embeddings=True)  # the backbone only embeds; no LM head to read
    tensors = {n: f for n, f in tensors.items() if n != name}

  def hf_name(spec: hf_tensors.Tensor, layer: int | None) -> str:
    if spec.hf == "lm_head.weight":
      return lm_head_prefix + spec.hf
    return prefix + (f"layers.{layer}." if layer is not None else "") + spec.hf

  used: set[str] = set()

  def read(name: str, want: tuple) -> np.ndarray:
    packed = (name + "_blocks", name + "_scales")
    if name not in tensors and all(n in tensors for n in packed):  # gpt-oss's MXFP4 experts
      arr = mxfp4.Packed(*(tensors[n].get(n) for n in packed))
      if arr.shape != want:
        raise CheckpointError(f"{tensors[packed[0]].path}: MXFP4 tensors {packed[0]!r} / {packed[1]!r} hold shape "
                              f"{arr.shape}, expected {want} for this config.json")
      used.update(packed)
      return arr
    if name not in tensors:
      raise CheckpointError(f"{path}: missing weight {name!r}")
    arr = tensors[name].get(name)
    if arr.shape != want:
      raise CheckpointError(f"{tensors[name].path}: tensor {name!r} has shape {tuple(arr.shape)}, "
                            f"expected {want} for this config.json")
    if arr.dtype.name not in ("float64", "float32", "float16", "bfloat16"):  # numpy calls bfloat16 non-floating
      raise CheckpointError(f"{tensors[name].path}: tensor {name!r} has dtype {arr.dtype}; model weights must "
                            "be floating point (F32, BF16, F16 or F64; quantised checkpoints are not supported)")
    used.add(name)
    return arr

  def views(spec: hf_tensors.Tensor, layers) -> list:
    out = []
    for layer in layers:
      if "{e}" not in spec.hf:
        out.append(spec.to_jalign(read(hf_name(spec, layer), tuple(spec.hf_shape(cfg))), cfg))
        continue
      fused = spec.fused and hf_name(dataclasses.replace(spec, hf=spec.fused[0]), layer)
      if fused in tensors:  # transformers 5's fused experts
        out.append(spec.fused[2](read(fused, spec.fused[1](cfg)), cfg))
      else:
        per_expert = (read(hf_name(spec, layer).format(e=e), tuple(spec.hf_shape(cfg))) for e in range(cfg.num_experts))
        out.append(hf_tensors.ExpertStack([spec.to_jalign(a, cfg) for a in per_expert]))
    return out

  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = (nnx.to_pure_dict(state_shardings(abstract, mesh, rules)) if mesh is not None else
               jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                            nnx.to_pure_dict(abstract_state)))
  np_dtype = jnp.dtype(dtype)

  def place(sources: list[np.ndarray], shape, sharding, stacked: bool) -> jax.Array:
    def read(index):
      if stacked:
        return np.stack([np.asarray(sources[i][index[1:]], np_dtype) for i in range(shape[0])[index[0]]])
      return np.asarray(sources[0][index], np_dtype)

    return jax.make_array_from_callback(shape, sharding, read)

  pure = nnx.to_pure_dict(abstract_state)
  for name, spec in hf_tensors.top_tensors(cfg).items():
    pure[name] = place(views(spec, [None]), pure[name].shape, shardings[name], stacked=False)
  moe_block = "block_sparse_moe" if any(".block_sparse_moe." in n for n in tensors) else "mlp"
  for name, spec in hf_tensors.layer_tensors(cfg, moe_block).items():
    pure["layers"][name] = place(views(spec, cfg.stacked_layers(name)), pure["layers"][name].shape,
                                 shardings["layers"][name], stacked=True)

  unused = [n for n in tensors if n not in used]
  mtp = [n for n in unused if _is_mtp(n, prefix, cfg)]
  if mtp:
    warnings.warn(f"{path}: {len(mtp)} tensors of DeepSeek-V3's multi-token-prediction layers (past layer "
                  f"{cfg.num_layers - 1}) are not loaded: the model predicts the next token only, as transformers' "
                  "does")
  unexpected = sorted(n for n in unused if not _IGNORED.search(n) and n not in mtp
                      and not (cfg.tie_embeddings and n == lm_head_prefix + "lm_head.weight"))
  if unexpected:
    more = f" (and {len(unexpected) - 10} more)" if len(unexpected) > 10 else ""
    raise CheckpointError(f"{path}: unexpected weights for model_type {cfg.model_type!r}: "
                          f"{', '.join(unexpected[:10])}{more}")
  nnx.replace_by_pure_dict(abstract_state, pure)
  return nnx.merge(graphdef, abstract_state), (None if score_weight is None else score_weight[0])


def _is_mtp(name: str, prefix: str, cfg: ModelConfig) -> bool:
  """A DeepSeek-V3 hub tensor of a multi-token-prediction module: stored as layers num_hidden_layers and on."""
  m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
  return cfg.model_type == "deepseek_v3" and m is not None and int(m.group(1)) >= cfg.num_layers


def architectures(path: str) -> list[str]:
  """`architectures` of `path`/config.json (OSError / ValueError when it cannot be read)."""
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    return list(json.load(f).get("architectures") or [])


def is_sequence_classifier(path: str) -> bool:
  try:
    return any(a.endswith("ForSequenceClassification") for a in architectures(path))
  except (OSError, ValueError):
    return False


def _check_tokenizer_vocab(path: str, cfg: ModelConfig) -> None:
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return
  from tokenizers import (
    Tokenizer,  # local: only needed when a tokenizer ships with the checkpoint
  )
  n = Tokenizer.from_file(file).get_vocab_size(with_added_tokens=True)
  if n > cfg.vocab_size:
    raise CheckpointError(f"{file}: the tokenizer has {n} tokens but config.json vocab_size is {cfg.vocab_size}; "
                          "token ids past the embedding table would be out of range")


_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "B": 1}


def _parse_size(size: int | str) -> int:
  if isinstance(size, int):
    return size
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", size.upper())
  if not m:
    raise ConfigError(f"max_shard_size {size!r}: expected bytes as an int or a string like '5GB' or '500MiB'")
  return int(float(m.group(1)) * _UNITS[m.group(2)])


def save_pretrained(lm: Decoder, out_dir: str, *, tokenizer=None, dtype: str | None = None,
                    max_shard_size: int | str = "5GB", score=None) -> None:
  """Writes the HF layout (config.json, generation_config.json, safetensors, sharded with an index above
  `max_shard_size`, tokenizer files when given) that transformers loads back. Each file is written to a temporary
  name and renamed, so an interrupted save leaves no partial file under a final name.

  With `score` (a [D] weight), writes a one-label `*ForSequenceClassification` checkpoint (a reward model: the
  backbone plus `score.weight`, no LM head) instead of a causal LM. LoRA adapters are merged into the weights."""
  lm = lora.merge(lm)
  cfg = lm.cfg
  if score is not None:
    score = sharding.to_host(score).astype(np.float32).reshape(-1)
    if score.shape != (cfg.hidden_size,):
      raise CheckpointError(f"score weight has shape {score.shape}, expected ({cfg.hidden_size},)")
    if cfg.pad_token_id is None:
      raise CheckpointError("a sequence-classification checkpoint needs pad_token_id in the model config (transformers "
                       "finds each row's last token by it)")
  dtype = jnp.dtype(dtype or cfg.param_dtype)
  os.makedirs(out_dir, exist_ok=True)
  state = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
  # One tensor on the host at a time: a layer's slice is gathered from the (possibly sharded) stacked parameter
  # only when the writer reaches it.
  # Every process gathers (a collective); only process 0 writes.
  main = jax.process_index() == 0
  to_host = sharding.to_host
  entries = []
  for name, spec in hf_tensors.top_tensors(cfg).items():
    if name == "lm_head" and score is not None:
      continue
    full = "lm_head.weight" if name == "lm_head" else "model." + spec.hf
    entries.append((full, spec.hf_shape(cfg), lambda n=name, s=spec: s.to_hf(to_host(state[n]), cfg)))
  if score is not None:
    entries.append(("score.weight", (1, cfg.hidden_size), lambda: score[None]))
  moe_block = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"  # the hub's names
  layer_on_host = functools.lru_cache(maxsize=1)(lambda n, i: to_host(state["layers"][n][i]))
  for layer in range(cfg.num_layers):
    for name, spec in hf_tensors.layer_tensors(cfg, moe_block).items():
      held = cfg.stacked_layers(name)
      if layer not in held:
        continue
      i = held.index(layer)  # the layer's slice of the parameter's stack
      if spec.joint is not None:  # two parameters in one HF tensor, written with the first
        other, parity = spec.joint
        if parity == 0:
          entries.append((f"model.layers.{layer}.{spec.hf}", spec.hf_shape(cfg),
                          lambda n=name, o=other, i=i: hf_tensors.interleave(to_host(state["layers"][n][i]),
                                                                             to_host(state["layers"][o][i]))))
      elif "{e}" in spec.hf:  # one gather per layer, its experts then written one by one
        entries.extend((f"model.layers.{layer}.{spec.hf.format(e=e)}", spec.hf_shape(cfg),
                        lambda n=name, s=spec, i=i, e=e: s.to_hf(layer_on_host(n, i)[e], cfg))
                       for e in range(cfg.num_experts))
      else:
        entries.append((f"model.layers.{layer}.{spec.hf}", spec.hf_shape(cfg),
                        lambda n=name, s=spec, i=i: s.to_hf(to_host(state["layers"][n][i]), cfg)))

  limit = _parse_size(max_shard_size)
  shards: list[list] = [[]]
  size = 0
  for entry in entries:
    nbytes = int(np.prod(entry[1])) * dtype.itemsize
    if shards[-1] and size + nbytes > limit:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for file, shard in zip(names, shards):
    if main:
      st.write_file(os.path.join(out_dir, file), [(n, s, dtype, p) for n, s, p in shard])
    else:
      for _, _, produce in shard:
        produce()  # take part in the gathers
  if not main:
    return
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(int(np.prod(e[1])) * dtype.itemsize for e in entries)},
             "weight_map": {e[0]: f for f, shard in zip(names, shards) for e in shard}}
    _write_json(os.path.join(out_dir, INDEX), index)
  elif os.path.exists(os.path.join(out_dir, INDEX)):
    os.remove(os.path.join(out_dir, INDEX))
  for stale in os.listdir(out_dir):  # shards of an earlier save into the same directory
    if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", stale) and stale not in names:
      os.remove(os.path.join(out_dir, stale))

  hf_config = {**to_hf_config(cfg), "dtype": dtype.name}
  if score is not None:
    hf_config.update(architectures=[hf_config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                     id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  _write_json(os.path.join(out_dir, "config.json"), hf_config)
  gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("pad_token_id", cfg.pad_token_id),
                           ("eos_token_id", list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                            else cfg.eos_token_id)) if v is not None}
  _write_json(os.path.join(out_dir, "generation_config.json"), gen)
  if tokenizer is not None:
    tokenizer.save(out_dir)


def _write_json(path: str, obj) -> None:
  files.write_json(path, obj, indent=2, sort_keys=True)
