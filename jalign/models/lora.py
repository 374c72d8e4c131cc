"""LoRA: low-rank adapters on the decoder's projections (Hu et al. 2021, arXiv:2106.09685).

A targeted projection computes `x @ W + (alpha / r) * dropout(x) @ A @ B`, with W frozen. A is [L, in..., r] and B
[L, r, out...], stacked over layers like W, so the scanned decoder carries them alongside its weights. As in PEFT,
A starts Kaiming-uniform (bound 1/sqrt(fan_in)) and B at zero, so a fresh adapter leaves the model unchanged;
adapters are kept in float32 whatever the base dtype.

Training sees the parameters as two trees (`partition`): the trainable ones (adapters, and a scalar head when
there is one, PEFT's `modules_to_save`) get gradients and optimizer state; the frozen base is passed to the step
beside them and never copied. "Adapters off" (`disabled`) is the same tree with the adapters zeroed: the reference
model of DPO / PPO / GRPO without a second copy of the base weights. `merge` folds the adapters into W for export.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.core.errors import ConfigError
from jalign.models.sharding import AXES

# jalign projection -> (its Hugging Face module name, number of leading input dims of the weight after `layers`)
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q": ("self_attn.q_proj", 1), "k": ("self_attn.k_proj", 1), "v": ("self_attn.v_proj", 1),
    "o": ("self_attn.o_proj", 2), "gate": ("mlp.gate_proj", 1), "up": ("mlp.up_proj", 1),
    "down": ("mlp.down_proj", 1), "expert_gate": ("mlp.experts.gate_proj", 1),
    "expert_up": ("mlp.experts.up_proj", 1), "expert_down": ("mlp.experts.down_proj", 1),
    # an MoE layer's shared expert (DeepSeek-V3's module: mlp.shared_experts), and MLA's projections
    "shared_gate": ("mlp.shared_expert.gate_proj", 1), "shared_up": ("mlp.shared_expert.up_proj", 1),
    "shared_down": ("mlp.shared_expert.down_proj", 1), "q_a": ("self_attn.q_a_proj", 1),
    "q_b": ("self_attn.q_b_proj", 1), "kv_a": ("self_attn.kv_a_proj_with_mqa", 1), "kv_b": ("self_attn.kv_b_proj", 1)}
# Routed experts' projections: stacked [layers, experts, in, out], so their adapters are one per expert, A [L, E, in,
# r] and B [L, E, r, out] (the layout of PEFT on per-expert modules), applied by the experts' grouped matmuls.
EXPERTS = ("expert_gate", "expert_up", "expert_down")
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def _stacked(name: str) -> int:
  """How many leading dims projection `name`'s weight stacks: layers, and experts for a routed expert's."""
  return 2 if name in EXPERTS else 1


def routed_adapter_size(params: dict) -> int:
  """Parameters of the routed experts' adapters in a (nested, pure) parameter dict."""
  routed = lambda path: str(path[-1]).removesuffix(SUFFIX_A).removesuffix(SUFFIX_B) in EXPERTS  # noqa: E731
  return sum(x.size for x in jax.tree.leaves(_filter(params, routed, True)))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int = 0                                # 0 = no adapters (full fine-tuning)
  alpha: float = 16.0                          # the update is scaled by alpha / rank
  dropout: float = 0.0                         # on the adapter's input, training steps only
  targets: tuple[str, ...] = ("all-linear",)   # PEFT `target_modules`: names or regexes, see `resolve_targets`

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def resolve_targets(patterns: tuple[str, ...]) -> tuple[str, ...]:
  """jalign projection names from PEFT-style patterns: "all-linear", an HF module name ("q_proj",
  "self_attn.q_proj"), a jalign name ("q"), or a regex matched in full against either HF form."""
  chosen = []
  for pattern in patterns:
    if pattern == "all-linear":
      hits = list(PROJECTIONS)
    else:
      hits = [name for name, (hf, _) in PROJECTIONS.items()
              if pattern == name or any(re.fullmatch(pattern, form) for form in (hf, hf.split(".")[-1]))]
    if not hits:
      accepted = ", ".join(hf.split(".")[-1] for hf, _ in PROJECTIONS.values())
      raise ConfigError(f"LoRA target {pattern!r} matches no projection; accepted: 'all-linear', {accepted} (or "
                       f"the jalign names {', '.join(PROJECTIONS)}, or a regex over them)")
    chosen.extend(h for h in hits if h not in chosen)
  return tuple(name for name in PROJECTIONS if name in chosen)


def model_targets(layers, cfg: LoraConfig) -> tuple[str, ...]:
  """The targeted projections this model has: each pattern that names an MLP projection, as "gate_proj", matches
  the dense layers', the shared expert's and the routed experts' (`EXPERTS`) alike, as it does PEFT's modules."""
  names = tuple(n for n in resolve_targets(cfg.targets) if hasattr(layers, n))
  if not names:
    raise ConfigError(f"LoRA targets {list(cfg.targets)} match no projection this model has; it has: "
                      f"{', '.join(n for n in PROJECTIONS if hasattr(layers, n))}")
  return names


def add_adapters(lm, cfg: LoraConfig, *, seed: int = 0):
  """Adds fresh adapters to `lm` (a Decoder) in place and returns it. The layers remember `cfg` (static)."""
  if cfg.rank <= 0 or cfg.alpha <= 0 or not 0 <= cfg.dropout < 1:
    raise ConfigError(f"LoRA rank={cfg.rank}, alpha={cfg.alpha}, dropout={cfg.dropout}: rank and alpha must be "
                     "positive, 0 <= dropout < 1")
  layers = lm.layers
  if getattr(layers, "lora", None) is not None:
    raise ValueError("the model already has LoRA adapters")
  key = jax.random.key(seed)
  for i, name in enumerate(model_targets(layers, cfg)):
    w = getattr(layers, name)
    in_dims = PROJECTIONS[name][1]
    lead = _stacked(name)
    # The base shards heads / MLP over `tensor` only (FSDP takes its `embed` dim); an adapter has no such second
    # dim to give FSDP, so those dims take the "lora" rule (fsdp x tensor). Experts' adapters keep their weights'
    # axes: the experts' shard_map takes them split like the weights.
    axes = tuple("lora" if a in ("heads", "kv_heads", "mlp") else a for a in w.get_metadata().get(AXES))
    shape_in, shape_out = w.shape[lead:lead + in_dims], w.shape[lead + in_dims:]
    bound = 1.0 / math.sqrt(math.prod(shape_in))
    a = jax.random.uniform(jax.random.fold_in(key, i), (*w.shape[:lead], *shape_in, cfg.rank), jnp.float32, -bound,
                           bound)
    setattr(layers, name + SUFFIX_A, nnx.Param(a, **{AXES: (*axes[:lead + in_dims], None)}))
    setattr(layers, name + SUFFIX_B, nnx.Param(jnp.zeros((*w.shape[:lead], cfg.rank, *shape_out), jnp.float32),
                                                **{AXES: (*axes[:lead], None, *axes[lead + in_dims:])}))
  layers.lora = cfg
  return lm


def expert_adapters(lp: dict, cfg: LoraConfig | None) -> tuple | None:
  """The routed experts' adapters (A, B) of gate, up and down, in that order (None for one without), or None when
  none of them has one: what `kernels.moe.experts_mlp` takes."""
  if cfg is None or not any(n + SUFFIX_A in lp for n in EXPERTS):
    return None
  return tuple((lp[n + SUFFIX_A], lp[n + SUFFIX_B]) if n + SUFFIX_A in lp else None for n in EXPERTS)


def project(h, lp: dict, name: str, dense, cfg: LoraConfig | None, dropout_key=None):
  """The adapter's share `scale * dropout(h) @ A @ B` of projection `name`, or None when it has no adapter."""
  if cfg is None or name + SUFFIX_A not in lp:
    return None
  x = h
  if dropout_key is not None and cfg.dropout > 0:
    keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, list(PROJECTIONS).index(name)), 1 - cfg.dropout,
                                h.shape)
    x = jnp.where(keep, h / (1 - cfg.dropout), 0).astype(h.dtype)
  down = dense(x, lp[name + SUFFIX_A].astype(h.dtype), PROJECTIONS[name][1])
  return (cfg.scale * dense(down, lp[name + SUFFIX_B].astype(h.dtype), 1)).astype(h.dtype)


def folded(lp: dict, name: str, cfg: LoraConfig | None) -> jax.Array:
  """Projection `name`'s weight with its adapter folded in, W + scale * A @ B (W itself without one): for a form
  that uses the weight other than as x @ W (MLA's absorbed decoding)."""
  w = lp[name]
  if cfg is None or name + SUFFIX_A not in lp:
    return w
  a, b = lp[name + SUFFIX_A].astype(jnp.float32), lp[name + SUFFIX_B].astype(jnp.float32)
  rank = a.shape[-1]
  delta = a.reshape(-1, rank) @ b.reshape(rank, -1)
  return (w.astype(jnp.float32) + cfg.scale * delta.reshape(w.shape)).astype(w.dtype)


def is_adapter(path: tuple) -> bool:
  return str(path[-1]).endswith((SUFFIX_A, SUFFIX_B))


def _trainable(path: tuple) -> bool:
  return is_adapter(path) or (len(path) > 1 and path[0] == "head")


def has_adapters(params: dict) -> bool:
  return any(is_adapter(p) for p in _paths(params))


def partition(params: dict) -> tuple[dict, dict]:
  """(trainable, frozen) nested dicts from a model's pure parameter dict: the adapters (and a scalar head) vs the
  base weights."""
  return _filter(params, _trainable, True), _filter(params, _trainable, False)


def combine(trainable: dict, frozen: dict | None) -> dict:
  """The full parameter dict again (inverse of `partition`); no array is copied. `frozen` None: nothing is frozen
  (full fine-tuning), `trainable` is the whole dict."""
  if frozen is None:
    return trainable
  out = dict(frozen)
  for k, v in trainable.items():
    out[k] = combine(v, out[k]) if isinstance(v, dict) and k in out else v
  return out


def disabled(params: dict) -> dict:
  """`params` with the adapters switched off (zeroed): the base model. Base arrays are shared, not copied; the
  adapter leaves are new arrays, so donating the trained adapters never touches them."""
  return _map(params, lambda path, x: jnp.zeros_like(x) if is_adapter(path) else x)


def merge(lm):
  """A plain Decoder whose projections hold W + scale * A @ B (for export); `lm` is left as it is."""
  cfg = getattr(lm.layers, "lora", None)
  if cfg is None:
    return lm
  state = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
  layers = {k: v for k, v in state["layers"].items() if not is_adapter((k,))}
  for name in model_targets(lm.layers, cfg):
    a, b, w = state["layers"][name + SUFFIX_A], state["layers"][name + SUFFIX_B], layers[name]
    stacked, rank = math.prod(a.shape[:_stacked(name)]), a.shape[-1]  # per layer (and expert)
    delta = jnp.einsum("lir,lro->lio", a.reshape(stacked, -1, rank).astype(jnp.float32),
                       b.reshape(stacked, rank, -1).astype(jnp.float32))
    layers[name] = (w.astype(jnp.float32) + cfg.scale * delta.reshape(w.shape)).astype(w.dtype)
  abstract = nnx.eval_shape(lambda: type(lm)(lm.cfg, rngs=nnx.Rngs(0)))  # the same Decoder, built without adapters
  graphdef, plain = nnx.split(abstract)
  nnx.replace_by_pure_dict(plain, {**state, "layers": layers})
  return nnx.merge(graphdef, plain)


def _paths(tree: dict, prefix: tuple = ()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _paths(v, prefix + (k,))
    else:
      yield prefix + (k,)


def _filter(tree: dict, keep, want: bool, prefix: tuple = ()) -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      sub = _filter(v, keep, want, prefix + (k,))
      if sub:
        out[k] = sub
    elif keep(prefix + (k,)) == want:
      out[k] = v
  return out


def _map(tree: dict, fn, prefix: tuple = ()) -> Any:
  return {k: _map(v, fn, prefix + (k,)) if isinstance(v, dict) else fn(prefix + (k,), v) for k, v in tree.items()}
