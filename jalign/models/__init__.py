"""Decoder LM (Flax NNX), scalar heads, and Hugging Face checkpoints in and out."""
from jalign.core.errors import CheckpointError, ConfigError
from jalign.models.config import ModelConfig, RopeConfig
from jalign.models.decoder import Decoder, create
from jalign.models.heads import ScalarHead
from jalign.models.hf import (
                              architectures,
                              from_pretrained,
                              is_sequence_classifier,
                              load_sequence_classifier,
                              save_pretrained,
)
from jalign.models.hf_config import from_hf_config, to_hf_config
from jalign.models.kv_cache import KVCache
from jalign.models.sharding import (
                              DEFAULT_RULES,
                              logical_axes,
                              logical_to_spec,
                              make_mesh,
                              named_sharding,
                              state_shardings,
                              without_fsdp,
)

__all__ = ["CheckpointError", "ConfigError", "DEFAULT_RULES", "Decoder", "KVCache", "ModelConfig", "RopeConfig",
           "ScalarHead", "architectures", "create", "from_hf_config", "from_pretrained", "is_sequence_classifier",
           "load_sequence_classifier", "logical_axes",
           "logical_to_spec", "make_mesh", "named_sharding", "save_pretrained", "state_shardings", "to_hf_config",
           "without_fsdp"]
