"""One config-driven decoder (Flax NNX) for the Llama, Mistral, Qwen2/3 and Gemma 2/3 families, and the
Mixture-of-Experts Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3 (`kernels.moe` for the experts; DeepSeek's
multi-head latent attention in `models.mla`).

Per-layer weights are stacked on a leading `layers` axis, so the same parameters run under `lax.scan` (compile time
flat in depth) or an unrolled Python loop. Sliding/global layers differ only in their window and RoPE frequencies,
which are scanned alongside the weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import kernels
from jalign.kernels.attn import AUTO_CHUNKED_FROM, gqa_attention
from jalign.kernels.attn import attention_mask as _attention_mask
from jalign.kernels.context import shard_tokens
from jalign.kernels.target import sequence_shards
from jalign.kernels.zigzag import balanced_order, from_zigzag, to_zigzag
from jalign.models import lora as lora_lib
from jalign.models import mla
from jalign.models import moe as moe_block
from jalign.models.attention import apply_rope, positions_from_mask
from jalign.models.config import ModelConfig
from jalign.models.kv_cache import KVCache
from jalign.models.layers import Layers, param
from jalign.models.sharding import DEFAULT_RULES, state_shardings


def rms_norm(x, w, cfg: ModelConfig):
  """RMSNorm in fp32. Llama casts back before scaling by w; Gemma scales by (1 + w) in fp32, then casts."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
  if cfg.norm_offset:
    return (y * (cfg.norm_offset + w.astype(jnp.float32))).astype(x.dtype)
  return (w.astype(x.dtype) * y.astype(x.dtype)).astype(x.dtype)


def _activation(name: str):
  return {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
          "gelu": lambda x: jax.nn.gelu(x, approximate=False)}[name]


def _dense(x, w, in_dims: int = 1):
  """x[..., in] @ w[in..., out...] as one 2-D matmul: XLA's CPU backend runs the backward of batched 3-D
  dot_generals about 2x slower (layout transposes); a flat [tokens, in] @ [in, out] avoids them."""
  in_size = int(np.prod(w.shape[:in_dims]))
  lead = x.shape[:x.ndim - in_dims]
  y = x.reshape(-1, in_size) @ w.reshape(in_size, -1)
  return y.reshape(*lead, *w.shape[in_dims:])


def _write(buffer, update, index, axis: int):
  """`update` written into `buffer` from slot `index` along `axis` (an axis after the batch's): one shared index, or
  one per row [B]."""
  if index.ndim == 0:
    return jax.lax.dynamic_update_slice_in_dim(buffer, update, index, axis=axis)
  return jax.vmap(lambda b, u, i: jax.lax.dynamic_update_slice_in_dim(b, u, i, axis=axis - 1))(buffer, update, index)


def decoder_layer(cfg: ModelConfig, x_BxTxD, lp: dict[str, jax.Array], window, inv_freq_H2, positions_BxT,
                  q_segment_BxT, q_index, kv: tuple | None, cache_index, dropout_key=None, route_ids_BxTxK=None, *,
                  lora: lora_lib.LoraConfig | None = None, replay: bool = True, zigzag: bool = False):
  """One pre-norm block. `kv` = this layer's (k_BxSxKxH, v_BxSxKxH, segment_BxS) cache, or None: without one
  the layer runs `kernels.attention` (`cfg.attention`), with one the dense form over the cache's slots (`chunked` for
  a prefill into a cache of `AUTO_CHUNKED_FROM` slots or more, unless `cfg.attention` is `xla`; one query over a
  per-row cache: `kernels.decode_attention`, by length, the Pallas kernel on TPU / GPU). Masks use
  slot indices (`q_index`: [T], or [B, T] with a per-row cache index) for causality and windows, as transformers
  does. `lora`: the adapters' settings when `lp` holds adapters; `dropout_key` turns on their dropout (training
  only). MoE: `route_ids_BxTxK` (-1 = none) are choices recorded elsewhere, compared with the router's own and,
  with `replay`, used instead of them (`models.moe.experts`). `zigzag`: the tokens lie in zig-zag order over the
  mesh's sequence shards (`kernels.attention`). Returns the new x, the
  layer's updated (keys, values) or None, and its `Routing` (None for a dense model)."""
  dt = x_BxTxD.dtype
  w = lambda name: lp[name].astype(dt)

  def proj(x, name, in_dims=1):
    y = _dense(x, w(name), in_dims)
    extra = lora_lib.project(x, lp, name, _dense, lora, dropout_key)
    return y if extra is None else y + extra

  h = rms_norm(x_BxTxD, lp["attn_norm"], cfg)
  heads_out = lambda a: a  # noqa: E731  attention's output per head -> o's input
  if cfg.kv_lora_rank:
    q, k, v, heads_out = mla.qkv(cfg, h, lp, proj, functools.partial(rms_norm, cfg=cfg), positions_BxT, inv_freq_H2,
                                 absorbed=kv is not None, lora=lora)
  else:
    q, k, v = proj(h, "q"), proj(h, "k"), proj(h, "v")
    if cfg.qkv_bias:
      q, k, v = q + w("q_bias"), k + w("k_bias"), v + w("v_bias")
    if cfg.qk_norm:
      q, k = rms_norm(q, lp["q_norm"], cfg), rms_norm(k, lp["k_norm"], cfg)
    q = apply_rope(q, positions_BxT, inv_freq_H2, cfg.rope.scale)
    k = apply_rope(k, positions_BxT, inv_freq_H2, cfg.rope.scale)
  sinks = lp.get("sinks")  # gpt-oss
  slots = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (x_BxTxD.shape[0], n))  # noqa: E731
  q_slot_BxT = jnp.broadcast_to(q_index, q_segment_BxT.shape)
  if kv is None:
    new_kv = None
    attn = kernels.attention(q, k, v, q_segment_ids=q_segment_BxT, kv_segment_ids=q_segment_BxT,
                             q_positions=q_slot_BxT, kv_positions=q_slot_BxT, sliding_window=window,
                             softcap=cfg.attn_softcap, scale=cfg.scale, impl=cfg.attention, sinks=sinks,
                             zigzag=zigzag)
  else:
    cache_k, cache_v, k_segment = kv  # [B, K, S, H]
    heads_first = lambda a, c: jnp.swapaxes(a, 1, 2).astype(c.dtype)  # noqa: E731  [B, T, K, H] -> [B, K, T, H]
    keys = _write(cache_k, heads_first(k, cache_k), cache_index, axis=2)
    values = _write(cache_v, heads_first(v, cache_v), cache_index, axis=2)
    new_kv = (keys, values)
    S = k_segment.shape[1]
    if q.shape[1] > 1 and S >= AUTO_CHUNKED_FROM and cfg.attention != "xla":
      # A long prefill: flash attention over the cache's slots (a [T, S] mask would be quadratic in the prompt).
      tokens_first = lambda a: jnp.swapaxes(a, 1, 2).astype(dt)  # noqa: E731
      attn = kernels.attention(q, tokens_first(keys), tokens_first(values), q_segment_ids=q_segment_BxT,
                               kv_segment_ids=k_segment, q_positions=q_slot_BxT, kv_positions=slots(S),
                               sliding_window=window, softcap=cfg.attn_softcap, scale=cfg.scale, impl="chunked",
                               sinks=sinks)
    elif cache_index.ndim == 1 and q.shape[1] == 1:  # a packed per-row cache: each row read up to its length
      attn = kernels.decode_attention(q[:, 0], keys, values, cache_index + 1, scale=cfg.scale, softcap=cfg.attn_softcap,
                                      window=window, impl=cfg.decode_attention, sinks=sinks)[:, None]
    else:  # decoding (one query) and short prefills read the cache in place
      mask = _attention_mask(q_segment_BxT, k_segment, q_slot_BxT, slots(S), sliding_window=window)
      attn = gqa_attention(q, keys.astype(dt), values.astype(dt), mask, scale=cfg.scale, softcap=cfg.attn_softcap,
                           kv_heads_first=True, sinks=sinks)
  out = proj(heads_out(attn), "o", in_dims=2)
  if cfg.out_bias:
    out = out + w("o_bias")
  if cfg.post_norms:
    out = rms_norm(out, lp["post_attn_norm"], cfg)
  x = x_BxTxD + out

  h = rms_norm(x, lp["ffw_norm"], cfg)

  def mlp(prefix: str):
    gate, up = proj(h, prefix + "gate"), proj(h, prefix + "up")
    if cfg.mlp_bias and not prefix:
      gate, up = gate + w("gate_bias"), up + w("up_bias")
    y = proj(_activation(cfg.activation)(gate) * up, prefix + "down")
    return y + w("down_bias") if cfg.mlp_bias and not prefix else y

  out = mlp("") if "gate" in lp else None  # a dense layer's MLP
  if "shared_gate" in lp:  # an MoE layer's shared expert
    out = mlp("shared_")
    if cfg.shared_expert_gate:  # Qwen2-MoE: gated per token
      out = out * jax.nn.sigmoid(_dense(h, w("shared_expert_gate")[:, None]))
  routing = None
  if "router" in lp:  # an MoE layer
    routed, routing = moe_block.experts(cfg, h, lp, q_segment_BxT != 0, route_ids_BxTxK,
                                        _activation(cfg.activation), replay=replay,
                                        adapters=lora_lib.expert_adapters(lp, lora),
                                        adapter_scale=lora.scale if lora is not None else 1.0,
                                        adapter_dropout=None if dropout_key is None or lora is None else (
                                            lora.dropout, jax.random.fold_in(dropout_key, len(lora_lib.PROJECTIONS))))
    out = routed if out is None else out + routed
  if cfg.post_norms:
    out = rms_norm(out, lp["post_ffw_norm"], cfg)
  return x + out, new_kv, routing


def _remat(fn, mode: str, static_argnums=(0,)):
  if mode == "full":
    return jax.checkpoint(fn, static_argnums=static_argnums)
  if mode == "dots":
    return jax.checkpoint(fn, static_argnums=static_argnums,
                          policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
  return fn


class Decoder(nnx.Module):
  """Decoder-only LM. `forward` returns hidden states (the LM head is applied by the log-prob kernels in
  training); `__call__`/`logits` apply the head for inference and tests."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
    self.layers = Layers(cfg, rngs)
    self.final_norm = param(rngs, (cfg.hidden_size,), ("norm",), cfg.param_dtype,
                             "zeros" if cfg.norm_offset else "ones")
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

  def unembed(self) -> jax.Array:
    """The output projection as [D, V]."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def layer_list(self) -> list[dict[str, jax.Array]]:
    """Per-layer weights sliced out of the stacked parameters (a decode loop slices them once, outside the loop):
    layer i's dict holds the parameters whose stacks cover it (`ModelConfig.stacked_layers`)."""
    out = [{} for _ in range(self.cfg.num_layers)]
    for name, a in self.layers.arrays().items():
      for j, i in enumerate(self.cfg.stacked_layers(name)):
        out[i][name] = a[j]
    return out

  def layer_runs(self) -> list[tuple[int, int, dict[str, jax.Array]]]:
    """(start, end, the stacked weights of layers start..end-1) for each run of layers with the same parameters
    (`ModelConfig.layer_runs`: one run unless dense and MoE layers mix)."""
    arrays, cfg = self.layers.arrays(), self.cfg
    runs = []
    for start, end in cfg.layer_runs():
      run = {}
      for name, a in arrays.items():
        held = cfg.stacked_layers(name)
        if start in held:
          first = held.index(start)
          run[name] = a[first:first + end - start]
      runs.append((start, end, run))
    return runs

  def forward(self, input_ids_BxT, attention_mask=None, **kw) -> tuple[jax.Array, KVCache | None]:
    """Hidden states after the final norm, [B, T, D], and the updated cache (`forward_routed` without the routing)."""
    hidden, cache, _ = self.forward_routed(input_ids_BxT, attention_mask, **kw)
    return hidden, cache

  def forward_routed(self, input_ids_BxT, attention_mask=None, *, positions=None, segment_ids=None,
                     cache: KVCache | None = None, layers: list[dict] | None = None,
                     dropout_rng: jax.Array | None = None, route_ids: jax.Array | None = None,
                     replay: bool = True) -> tuple[jax.Array, KVCache | None, moe_block.Routing | None]:
    """Hidden states after the final norm, [B, T, D], the updated cache, and an MoE model's `Routing` stacked over
    layers (None for a dense model).

    Padding: `attention_mask` [B, T] (1 = token; left padding fine) gives positions like transformers' `generate`.
    Packing: `segment_ids` [B, T] (1, 2, ... per packed sequence, 0 = padding) with `positions` [B, T] restarting
    at 0 for each sequence.
    Decoding: pass a `KVCache`; the new tokens are written at `cache.index` (shared, or per row). Layers then run
    unrolled, each on its own cache buffer; `layers` (from `layer_list()`) saves re-slicing the stacked weights per
    call.
    Training: `dropout_rng` turns on LoRA dropout (when the model has adapters with dropout > 0).
    Routing replay (MoE): `route_ids` [L, B, T, k] makes layer l send token (b, t) to experts route_ids[l, b, t]
    (-1 = the router's own choice); `replay=False` only compares them with the router's own (`Routing`).
    """
    cfg = self.cfg
    lora = getattr(self.layers, "lora", None)
    dt = jnp.dtype(cfg.dtype)
    B, T = input_ids_BxT.shape
    segment_ids_BxT, positions_BxT = segment_ids, positions
    if segment_ids_BxT is None:
      segment_ids_BxT = (jnp.ones((B, T), jnp.int32) if attention_mask is None
                         else attention_mask.astype(jnp.int32))
    if positions_BxT is None:
      if cache is not None and attention_mask is None:
        raise ValueError("decoding with a cache needs `positions` (or an attention mask for the prefill)")
      positions_BxT = positions_from_mask(segment_ids_BxT != 0)
    cache_index = jnp.zeros((), jnp.int32) if cache is None else cache.index
    q_index = cache_index + jnp.arange(T) if cache_index.ndim == 0 else cache_index[:, None] + jnp.arange(T)
    zigzag = cache is None and layers is None and cfg.attention != "xla" and balanced_order(T)
    shards = sequence_shards()
    if zigzag:  # every token carries its slot, position and segment along: attention reads them, not the order
      input_ids_BxT, positions_BxT, segment_ids_BxT, q_index = (
          to_zigzag(a, shards) for a in (input_ids_BxT, positions_BxT, segment_ids_BxT,
                                         jnp.broadcast_to(q_index, (B, T))))
      route_ids = None if route_ids is None else to_zigzag(route_ids, shards, axis=2)

    x = jnp.take(self.embed[...], input_ids_BxT, axis=0).astype(dt)
    if cfg.embed_scale:
      x = x * jnp.asarray(math.sqrt(cfg.hidden_size), dt)
    windows_L, inv_freq_LxH2 = cfg.layer_windows(), cfg.layer_inv_freq()
    if cache is not None or layers is not None:
      per_layer = layers if layers is not None else self.layer_list()
      k_segment = None
      if cache is not None:
        k_segment = _write(cache.segment_BxS, segment_ids_BxT.astype(jnp.int32), cache_index, axis=1)
      new_k, new_v, routings = [], [], []
      moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
      for i in range(cfg.num_layers):
        kv = None if cache is None else (cache.k[i], cache.v[i], k_segment)
        recorded = None if route_ids is None or i not in moe_index else route_ids[moe_index[i]]
        x, kv, routing = decoder_layer(cfg, x, per_layer[i], int(windows_L[i]), jnp.asarray(inv_freq_LxH2[i]),
                                       positions_BxT, segment_ids_BxT, q_index, kv, cache_index,
                                       route_ids_BxTxK=recorded, lora=lora, replay=replay)
        if routing is not None:
          routings.append(routing)
        if kv is not None:
          new_k.append(kv[0])
          new_v.append(kv[1])
      if cache is not None:
        cache = KVCache(tuple(new_k), tuple(new_v), k_segment, cache_index + T)
      return rms_norm(x, self.final_norm[...], cfg), cache, moe_block.stack(routings)

    x = shard_tokens(x)  # context parallelism: the layers' activations and checkpoints split over `sequence`
    keys_L = None
    if dropout_rng is not None and lora is not None and lora.dropout > 0:
      keys_L = jax.random.split(dropout_rng, cfg.num_layers)
    # One window for every layer (all but Gemma 2/3) stays a Python int: kernels may build their masks from it.
    static_window = int(windows_L[0]) if len(set(windows_L.tolist())) == 1 else None
    layer = _remat(functools.partial(decoder_layer, lora=lora, replay=replay, zigzag=zigzag), cfg.remat,
                   (0,) if static_window is None else (0, 3))

    def body(x, xs):
      lp, window, inv_freq, key, recorded = xs
      window = window if static_window is None else static_window
      x, _, routing = layer(cfg, x, lp, window, inv_freq, positions_BxT, segment_ids_BxT, q_index, None,
                            cache_index, key, recorded)
      return shard_tokens(x), routing

    routings, moe_done = [], 0
    for start, end, lp in self.layer_runs():  # one scan per run of alike layers
      n_moe = sum(start <= i < end for i in cfg.moe_layers)
      xs = (lp, jnp.asarray(windows_L[start:end]), jnp.asarray(inv_freq_LxH2[start:end]),
            None if keys_L is None else keys_L[start:end],
            None if route_ids is None or not n_moe else route_ids[moe_done:moe_done + n_moe])
      moe_done += n_moe
      if cfg.scan_layers:
        x, routing = jax.lax.scan(body, x, xs)
        routings.append(routing)
      else:
        for i in range(end - start):
          x, routing = body(x, jax.tree.map(lambda a: a[i], xs))
          routings.append(jax.tree.map(lambda a: a[None], routing))
    routings = [r for r in routings if r is not None]
    routing = jax.tree.map(lambda *a: jnp.concatenate(a), *routings) if routings else None
    if zigzag:  # back to the tokens' own order: the losses and the log-prob kernels read the sequence as given
      x = shard_tokens(from_zigzag(x, shards))
      if routing is not None:
        routing = dataclasses.replace(routing, ids_BxTxK=from_zigzag(routing.ids_BxTxK, shards, axis=2))
    return rms_norm(x, self.final_norm[...], cfg), None, routing

  def response_hidden(self, tokens_NxT, **kw) -> jax.Array:
    """`response_routed`'s hidden states alone."""
    return self.response_routed(tokens_NxT, **kw)[0]

  def response_routed(self, tokens_NxT, *, segment_ids, positions, response_len: int, group_size: int = 0,
                      dropout_rng: jax.Array | None = None, routes_NxTxLxK: jax.Array | None = None,
                      replay: bool = True) -> tuple[jax.Array, moe_block.Routing | None]:
    """Hidden states [N, R, D] that predict each row's last R = `response_len` columns (the prompt's last one,
    then the response's own), and an MoE model's `Routing`. Rows are a prompt left-padded to T - R columns, then a
    response right-padded to R. `routes_NxTxLxK`: the experts the sampler used for each token (-1 = none), compared
    with the router's own and, with `replay`, used (`forward_routed`).

    `group_size` > 1: rows i*g .. i*g+g-1 share one prompt (a GRPO group's samples, a DPO pair's chosen and
    rejected). The prompt then runs once per group and its keys/values are repeated under the group's responses,
    which run on top of them as on a decoding cache: the same values (up to rounding) for a fraction of the work
    when prompts are long next to responses (its routing counted once per group). Not with dropout or remat (the
    cached path runs neither): those take the whole rows."""
    r = response_len
    p = tokens_NxT.shape[1] - r
    routes = None if routes_NxTxLxK is None else jnp.moveaxis(routes_NxTxLxK, 2, 0)  # [L, N, T, k]
    if group_size <= 1 or dropout_rng is not None or self.cfg.remat != "none":
      hidden, _, routing = self.forward_routed(tokens_NxT, segment_ids=segment_ids, positions=positions,
                                               dropout_rng=dropout_rng, route_ids=routes, replay=replay)
      return hidden[:, p - 1:p + r - 1], routing
    g = group_size
    cache = KVCache.init(self.cfg, tokens_NxT.shape[0] // g, p + r - 1)
    prompt_hidden, cache, routing = self.forward_routed(
        tokens_NxT[::g, :p], segment_ids=segment_ids[::g, :p], positions=positions[::g, :p], cache=cache,
        route_ids=None if routes is None else routes[:, ::g, :p], replay=replay)
    first = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)
    if r == 1:
      return first, routing
    rest, _, rest_routing = self.forward_routed(
        tokens_NxT[:, p:p + r - 1], segment_ids=segment_ids[:, p:p + r - 1], positions=positions[:, p:p + r - 1],
        cache=cache.repeat(g), route_ids=None if routes is None else routes[:, :, p:p + r - 1], replay=replay)
    return jnp.concatenate([first, rest], axis=1), moe_block.merge(routing, rest_routing, g)

  def logits(self, hidden_BxTxD) -> jax.Array:
    logits = _dense(hidden_BxTxD, self.unembed().astype(hidden_BxTxD.dtype)).astype(jnp.float32)
    if self.cfg.final_softcap is not None:  # Gemma 2
      logits = jnp.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
    return logits

  def __call__(self, input_ids_BxT, attention_mask=None, **kw) -> jax.Array:
    hidden, _ = self.forward(input_ids_BxT, attention_mask, **kw)
    return self.logits(hidden)


def create(cfg: ModelConfig, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None,
           rules=DEFAULT_RULES) -> Decoder:
  """A randomly initialised decoder; on a mesh each parameter is created directly in its sharded layout (the
  full model is never materialised on one device)."""
  if mesh is None:
    return Decoder(cfg, rngs=nnx.Rngs(seed))
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed)))
  graphdef, _ = nnx.split(abstract)
  params = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed))),
                   out_shardings=state_shardings(abstract, mesh, rules))()
  return nnx.merge(graphdef, params)
