"""notebooks/ execute top to bottom (tiny configs on CPU) with nbclient, as a Colab runtime would run them."""
import os

import nbclient
import nbformat
import pytest

from tests.configs_util import ROOT


@pytest.mark.parametrize("name", ["grpo_quickstart", pytest.param("dpo_rm_quickstart", marks=pytest.mark.long)])  # CI time
def test_notebook_runs(name, monkeypatch):
  # The kernel sees one CPU device, as a Colab CPU runtime does (the tests' eight fake devices are covered in-process).
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
  path = os.path.join(ROOT, "notebooks", f"{name}.ipynb")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.dirname(path)}})
  client.execute()
  outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
  assert "configs: tiny" in outputs
  assert "1 cpu device(s)" in outputs
  errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
