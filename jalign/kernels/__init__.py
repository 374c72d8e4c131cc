"""The hot paths: attention from segment ids and positions without a [T, S] mask (`attention`); log-probabilities,
entropy and logsumexp of target tokens, and the exact KL between two models' next-token distributions, from hidden
states and unembeddings without materialising [tokens, vocab] logits."""
from jalign.kernels.attn import attention
from jalign.kernels.kl import full_kl
from jalign.kernels.logprobs import IMPLS, LogprobOptions, token_logprobs

__all__ = ["IMPLS", "attention", "LogprobOptions", "full_kl", "token_logprobs"]
