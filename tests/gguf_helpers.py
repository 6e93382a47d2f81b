"""Small GGUF files written with gguf-py's own writer, shared by the tests that need them."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def bert_gguf(path: Path) -> Path:
    """A one-tensor GGUF of an architecture colibri does not run ('bert'); returns `path`."""
    import gguf
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
