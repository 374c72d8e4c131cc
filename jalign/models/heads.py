"""Scalar value / reward head on the decoder's hidden states."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.core.errors import ConfigError
from jalign.models.sharding import AXES


class ScalarHead(nnx.Module):
  """hidden [B, T, D] -> score [B, T]. `kind="linear"` (TRL/OpenRLHF value and reward heads) or `"mlp"`
  (D -> hidden -> 1 with a tanh, as some published reward models use)."""

  def __init__(self, hidden_size: int, *, kind: str = "linear", mlp_size: int | None = None, bias: bool = True,
               param_dtype: str = "float32", rngs: nnx.Rngs):
    if kind not in ("linear", "mlp"):
      raise ConfigError(f"head kind {kind!r}; accepted: 'linear', 'mlp'")
    self.kind = kind
    zeros = lambda n: nnx.Param(jnp.zeros((n,), param_dtype), **{AXES: (None,)})
    width = hidden_size
    if kind == "mlp":
      width = mlp_size or hidden_size
      self.w_hidden = nnx.Param((hidden_size ** -0.5 * jax.random.normal(rngs.params(), (hidden_size, width)))
                                .astype(param_dtype), **{AXES: ("embed", "mlp")})
      self.b_hidden = zeros(width)
    # Output std 1/sqrt(width + 1), as lm-human-preferences (Ziegler et al. 2019) initialises its reward head.
    self.w_out = nnx.Param(((width + 1) ** -0.5 * jax.random.normal(rngs.params(), (width, 1)))
                           .astype(param_dtype), **{AXES: ("mlp" if kind == "mlp" else "embed", None)})
    self.b_out = zeros(1) if bias else None

  def __call__(self, hidden_BxTxD: jax.Array) -> jax.Array:
    h = hidden_BxTxD.astype(jnp.float32)
    if self.kind == "mlp":
      h = jnp.tanh(h @ self.w_hidden[...].astype(jnp.float32) + self.b_hidden[...].astype(jnp.float32))
    out = h @ self.w_out[...].astype(jnp.float32)
    if self.b_out is not None:
      out = out + self.b_out[...].astype(jnp.float32)
    return out[..., 0]
