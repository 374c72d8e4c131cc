"""optax optimizer from config: AdamW (no decay on norm scales and biases), warmup + decay schedule, clipping."""
from __future__ import annotations

import jax
import optax

from jalign.config import OptimSection


def schedule(o: OptimSection, steps: int) -> optax.Schedule:
  """Warmup (at most `steps`: a run cut short warms up over all of it) then decay to lr x min_lr_ratio at `steps`."""
  end = o.lr * o.min_lr_ratio
  warmup_steps = min(o.warmup_steps, steps)
  decay_steps = max(steps - warmup_steps, 1)
  if o.schedule == "cosine":
    decay = optax.cosine_decay_schedule(o.lr, decay_steps, alpha=o.min_lr_ratio)
  elif o.schedule == "linear":
    decay = optax.linear_schedule(o.lr, end, decay_steps)
  else:
    decay = optax.constant_schedule(o.lr)
  if not warmup_steps:
    return decay
  warmup = optax.linear_schedule(0.0, o.lr, warmup_steps)
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params) -> dict:
  """True where weight decay applies: every parameter except norm scales and biases (HF Trainer's rule)."""
  def keep(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    return not ("norm" in name or "bias" in name or name.startswith("b_"))
  return jax.tree_util.tree_map_with_path(keep, params)


def make(o: OptimSection, steps: int, updates_per_step: int = 1) -> tuple[optax.GradientTransformation,
                                                                         optax.Schedule]:
  """`updates_per_step` > 1 (RL mini-batches x epochs): warmup and decay count training steps, and a step's updates
  share one learning rate, as verl steps its scheduler once per policy update round."""
  per_step = schedule(o, steps)
  lr = per_step if updates_per_step == 1 else lambda count: per_step(count // updates_per_step)
  parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  parts.append(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
  return optax.chain(*parts), lr
