"""Read a Hugging Face OLMoE checkpoint (single-file or sharded safetensors) tensor by tensor.

Only this module and convert.py know the Hugging Face key layout.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can return it)
import numpy as np
from safetensors import SafetensorError, safe_open

from .config import ModelArgs
from .errors import CheckpointError

LFS_MAGIC = b"version https://git-lfs"


def is_lfs_pointer(path: Path) -> bool:
    """True if ``path`` is a Git LFS pointer file (a small text file standing in for the data)."""
    try:
        if path.stat().st_size > 1024:
            return False
        with open(path, "rb") as f:
            return f.read(len(LFS_MAGIC)) == LFS_MAGIC
    except OSError:
        return False


def hf_names(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor an OLMoE checkpoint must hold, with its expected shape."""
    D, I, E, V = args.hidden_size, args.intermediate_size, args.num_experts, args.vocab_size
    names = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not args.tie_word_embeddings:
        names["lm_head.weight"] = (V, D)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (args.q_dim, D),
            p + "self_attn.k_proj.weight": (args.kv_dim, D),
            p + "self_attn.v_proj.weight": (args.kv_dim, D),
            p + "self_attn.o_proj.weight": (D, args.q_dim),
            p + "self_attn.q_norm.weight": (args.q_dim,),
            p + "self_attn.k_norm.weight": (args.kv_dim,),
            p + "mlp.gate.weight": (E, D),
        })
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            names.update({q + "gate_proj.weight": (I, D), q + "up_proj.weight": (I, D),
                          q + "down_proj.weight": (D, I)})
    return names


class Checkpoint:
    """An opened HF checkpoint folder: ``args``, and ``get(name) -> float32 ndarray``.

    Opening checks (before any compute): config.json valid; every weight file present, not a
    Git LFS pointer, with a complete safetensors header; every expected tensor present with
    the shape the config implies; dtype bf16 / f16 / f32.

    Raises:
        ConfigError, CheckpointError: naming the file or tensor and what to do.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a folder; give the folder that holds "
                                  f"config.json and the *.safetensors files")
        self.args = ModelArgs.from_hf_config(self.folder / "config.json")
        self._files = self._weight_files()
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self._spans: dict[str, tuple[int, int, str, list]] = {}  # name -> (start, end, dtype, shape)
        self._fds: dict[Path, int] = {}
        for f in self._files:
            h = self._open(f)
            for k in h.keys():
                self._where[k] = f
            self._read_spans(f)
        a = self.args
        want = 2 + (not a.tie_word_embeddings) + a.num_hidden_layers * (9 + 3 * a.num_experts)
        if len(self._where) < want:  # before listing every expected name (huge for a bad config)
            raise CheckpointError(
                f"{self.folder / 'config.json'}: describes {a.num_hidden_layers} layers x {a.num_experts} "
                f"experts ({want} tensors) but the weight files hold {len(self._where)}; config.json and "
                f"the weights do not match - download the model again")
        self._check_tensors()

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            if is_lfs_pointer(index):
                raise CheckpointError(f"{index}: is a Git LFS pointer, not the index; download the "
                                      f"real file (git lfs pull, or use the model wizard)")
            try:
                wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in wm.items()):
                    raise ValueError("'weight_map' must map tensor names to shard file names")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r}); download it "
                                      f"again") from None
            files = []
            for shard in sorted(set(wm.values())):
                p = self.folder / shard
                if Path(shard).is_absolute() or ".." in Path(shard).parts or p.parent != self.folder:
                    raise CheckpointError(f"{index}: shard name {shard!r} is not a file of {self.folder}; "
                                          f"the index is corrupt - download it again")
                if not p.exists():
                    raise CheckpointError(f"{p}: shard named in {index.name} is missing; the download "
                                          f"is incomplete (download the missing shard again)")
                files.append(p)
            return files
        single = self.folder / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.folder.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"{self.folder}: no model.safetensors or model.safetensors.index.json; "
                                  f"only safetensors checkpoints are supported")
        return found

    def _open(self, path: Path):
        if is_lfs_pointer(path):
            raise CheckpointError(f"{path}: is a Git LFS pointer file, not the weights; fetch the real "
                                  f"file (git lfs pull) or download the model with the wizard")
        try:
            with open(path, "rb"):  # the real errno: safetensors reports EACCES as "No such file"
                pass
            h = safe_open(str(path), framework="numpy")
        except PermissionError:
            raise CheckpointError(f"{path}: permission denied; this user cannot read the weights - "
                                  f"make the file readable (chmod a+r) or copy the model") from None
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a complete safetensors file ({e}); the file is truncated "
                                  f"or corrupt - download it again") from None
        self._handles[path] = h
        return h

    def _read_spans(self, path: Path) -> None:
        """Absolute byte spans of each tensor (the header safe_open has just validated), so
        tensors can be read with pread instead of a whole-file mmap: a mapped file's pages
        count in RSS, which would make converter RSS grow with the model size."""
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        base = 8 + n
        for k, v in header.items():
            if k != "__metadata__":
                s, e = v["data_offsets"]
                self._spans[k] = (base + s, base + e, v["dtype"], v["shape"])
        self._fds[path] = os.open(path, os.O_RDONLY)

    def _check_tensors(self) -> None:
        for name, shape in hf_names(self.args).items():
            f = self._where.get(name)
            if f is None:
                raise CheckpointError(f"{self.folder}: tensor '{name}' is missing from the checkpoint "
                                      f"(config.json says {self.args.num_hidden_layers} layers x "
                                      f"{self.args.num_experts} experts)")
            sl = self._handles[f].get_slice(name)
            got = tuple(sl.get_shape())
            if got != shape:
                raise CheckpointError(f"{f}: tensor '{name}' has shape {list(got)} but config.json "
                                      f"implies {list(shape)}; config and weights do not match")
            if sl.get_dtype() not in ("BF16", "F16", "F32"):
                raise CheckpointError(f"{f}: tensor '{name}' has dtype {sl.get_dtype()}; only "
                                      f"bf16, f16 and f32 checkpoints are supported")

    def file_of(self, name: str) -> Path:
        """The weight file holding tensor ``name``."""
        return self._where[name]

    def nbytes(self, name: str) -> int:
        sl = self._handles[self._where[name]].get_slice(name)
        size = {"BF16": 2, "F16": 2, "F32": 4}[sl.get_dtype()]
        return int(np.prod(sl.get_shape())) * size

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a new float32 array (read with pread, page cache dropped)."""
        path = self._where[name]
        start, end, dt, shape = self._spans[name]
        fd = self._fds[path]
        try:
            raw = os.pread(fd, end - start, start)
            if len(raw) != end - start:
                raise OSError(f"short read ({len(raw)} of {end - start} bytes)")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise CheckpointError(f"{path}: reading tensor '{name}' failed ({e})") from None
        np_dt = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}[dt]
        return np.frombuffer(raw, dtype=np_dt).reshape(shape).astype(np.float32)

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
