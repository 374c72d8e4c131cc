"""The one way jalign opens a `.gguf` file (llama.cpp's format, read with the `gguf` package): models read its tensors
(jalign/models/gguf_io.py), tokenizers its vocabulary (jalign/tokenizers/gguf_tokenizer.py)."""
from __future__ import annotations

from typing import Any

from jalign.core.errors import UserError


def read(path: str, error: type[UserError]) -> tuple[Any, dict[str, Any]]:
  """(the `gguf.GGUFReader` of `path`, its metadata {key: value}); a missing package or an unreadable file raises
  `error` naming the file."""
  try:
    import gguf
  except ImportError:
    raise error(f"{path}: reading GGUF files needs the `gguf` package (pip install gguf)") from None
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # gguf raises ValueError / struct errors / OSError for a bad file
    raise error(f"{path}: not a readable GGUF file ({e})") from None
  return reader, {k: f.contents() for k, f in reader.fields.items()}
