"""Log-probabilities, entropy and logsumexp of target tokens from hidden states and the unembedding."""
from jalign.kernels.logprobs import token_logprobs

__all__ = ["token_logprobs"]
