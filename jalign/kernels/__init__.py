"""Log-probabilities, entropy and logsumexp of target tokens from hidden states and the unembedding."""
from jalign.kernels.logprobs import IMPLS, LogprobOptions, token_logprobs

__all__ = ["IMPLS", "LogprobOptions", "token_logprobs"]
