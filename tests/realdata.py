"""The real material in ../shared/realdata (or $JALIGN_REALDATA): paths, and SmolLM2-135M-Instruct converted from its
GGUF to a Hugging Face directory by transformers' own GGUF loader, once per test session."""
import os

import pytest

from tests.configs_util import ROOT

REALDATA = os.environ.get("JALIGN_REALDATA", os.path.join(os.path.dirname(ROOT), "shared", "realdata"))
SMOLLM2_GGUF = os.path.join("models", "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")


def path(relative: str) -> str:
  """The file under the real-data directory; the test is skipped, saying which file is missing, when it is absent."""
  full = os.path.join(REALDATA, relative)
  if not os.path.exists(full):
    pytest.skip(f"real data not found: {full} (set JALIGN_REALDATA to the directory holding ../shared/realdata)")
  return full


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
  """(HF directory, transformers model in fp32) of SmolLM2-135M-Instruct, dequantised from the GGUF."""
  import torch
  import transformers
  gguf = path(SMOLLM2_GGUF)
  model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                            dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
  model.hf_quantizer = None  # the weights are dequantised fp32 now: save them as such
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  out = tmp_path_factory.mktemp("smollm2-135m-instruct")
  model.save_pretrained(out)
  tok.save_pretrained(out)
  return str(out), model.eval()
