"""The hot paths: attention from segment ids and positions without a [T, S] mask (`attention`); decode attention
over a packed per-row cache read up to each row's length (`decode_attention`); log-probabilities, entropy and
logsumexp of target tokens, and the exact KL (or distillation's generalized JSD) between two models' next-token
distributions, from hidden states and unembeddings without materialising [tokens, vocab] logits."""
from jalign.kernels.attn import attention
from jalign.kernels.decode import DECODE_IMPLS, decode_attention, decode_impl
from jalign.kernels.kl import full_divergence, full_kl
from jalign.kernels.logprobs import IMPLS, LogprobOptions, token_logprobs

__all__ = ["DECODE_IMPLS", "IMPLS", "attention", "decode_attention", "decode_impl", "LogprobOptions",
           "full_divergence", "full_kl", "token_logprobs"]
