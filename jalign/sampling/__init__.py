"""In-graph generation: prefill, then a lax.while_loop decode over a preallocated KV cache."""
from jalign.sampling.filters import sample_logits
from jalign.sampling.prefix import PrefixCache
from jalign.sampling.sampler import GenerateOutput, generate, prompt_bucket

__all__ = ["GenerateOutput", "PrefixCache", "generate", "prompt_bucket", "sample_logits"]
