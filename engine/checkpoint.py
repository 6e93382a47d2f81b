"""Read a Hugging Face MoE checkpoint (single-file or sharded safetensors) tensor by tensor.

The Hugging Face key layout of each family comes from its file in engine/models/
(``dense_tensors``, ``expert_names``). Routed experts are read per expert, from per-expert
tensors (published checkpoints, save_pretrained) or from slices of fused 3-D tensors
(``mlp.experts.gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I]), one expert at a time.

FP8 block-scaled checkpoints (DeepSeek-V3 / R1, Kimi-K2, the GLM FP8 releases): a matrix
``X.weight`` stored as float8_e4m3fn [O, N] with ``X.weight_scale_inv`` float32
[ceil(O / bo), ceil(N / bi)] (``quantization_config.weight_block_size`` [bo, bi], 128 x 128 in
the published ones) reads as weight[o, n] * scale_inv[o // bo, n // bi] in float32, tensor by
tensor, so the converter's peak RSS stays one tensor (source: DeepSeek-V3's
inference/fp8_cast_bf16.py weight_dequant, and transformers' finegrained_fp8 integration).

Families whose experts exist only as fused tensors of their own layout (gpt-oss) name them
with ``family.expert_tensors(args, i, mxfp4)`` and turn one expert's slices into store parts
with ``family.expert_from_fused`` (float) / ``family.expert_from_mxfp4`` (the published MXFP4
blocks and e8m0 scales, ``quantization_config.quant_method: mxfp4``, kept as bytes for an
mxfp4 store: :meth:`Checkpoint.quantized_expert`; decoded exactly for any other store).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from .config import ModelArgs
from .errors import CheckpointError
from .mtp import dense_tensors, kept_heads, with_heads
from .models import base, family_for
from .quant import mxfp4_nonfinite_block

LFS_MAGIC = b"version https://git-lfs"

# why a checkpoint tensor may go unused (Checkpoint.skipped_tensors): a name fragment -> hint
_UNUSED_HINTS = (("_scale_inv", "; its weight is not float8"), ("q_norm", "; use_qk_norm is false"),
                 ("k_norm", "; use_qk_norm is false"),
                 ("_proj.bias", "; attention_bias is false"), ("q_a_", "; q_lora_rank is null"),
                 ("inv_freq", "; rotary frequencies are computed from config.json"))


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
    """Every tensor a (per-expert) checkpoint of args' family holds, with its expected shape."""
    return base.hf_names(family_for(args.model_type), args)


class Checkpoint:
    """An opened HF checkpoint folder: ``args``, ``family`` (engine.models module),
    ``get(name) -> float32 ndarray``, ``expert(layer, e) -> {proj: float32 ndarray}``.

    Opening checks (before any compute): config.json valid; every weight file present, not a
    Git LFS pointer, with a complete safetensors header; every expected tensor present with
    the shape the config implies; dtype bf16 / f16 / f32, or float8 with float block scales
    (``weight_scale_inv``) of the shape ``weight_block_size`` implies (the scales must be
    positive and finite: checked when the tensor is read, naming the scale tensor).
    Tensors config.json does not use are listed by :meth:`skipped_tensors`.

    Raises:
        ConfigError, CheckpointError: naming the file or tensor and what to do.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a folder; give the folder that holds "
                                  f"config.json and the *.safetensors files")
        self.args = ModelArgs.from_hf_config(self.folder / "config.json")
        self.family = family_for(self.args.model_type)
        self._fused: dict[int, tuple[str, str]] = {}  # transformer layer -> (gate_up, down) names
        self._family_fused: dict[int, tuple[dict, bool]] = {}  # layer -> ({name: shape}, mxfp4) (gpt-oss)
        self._files = self._weight_files()
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self._spans: dict[str, tuple[int, int, str, list]] = {}  # name -> (start, end, dtype, shape)
        self._fds: dict[Path, int] = {}
        self._used: set[str] = set()  # the tensors the config reads (filled by _check_tensors)
        self._fp8_block = self._fp8_block_size()
        for f in self._files:
            h = self._open(f)
            for k in h.keys():
                self._where[k] = f
            self._read_spans(f)
        a = self.args = with_heads(self.args, kept_heads(self.args, self._where))  # engine/mtp.py
        # at least the family's dense tensors + 2 per MoE layer (fused experts), checked before
        # listing every expected name (huge for a bad config)
        want = len({t.hf for t in self.family.dense_tensors(a)}) + 2 * a.num_moe_layers
        if len(self._where) < want:
            raise CheckpointError(
                f"{self.folder / 'config.json'}: describes {a.num_hidden_layers} layers x {a.num_experts} "
                f"experts (at least {want} tensors) but the weight files hold {len(self._where)}; "
                f"config.json and the weights do not match - download the model again")
        self._check_tensors()

    def _fp8_block_size(self) -> tuple[int, int]:
        """``quantization_config.weight_block_size`` of an FP8 checkpoint (default 128 x 128)."""
        try:
            qc = json.loads((self.folder / "config.json").read_text(encoding="utf-8")).get("quantization_config")
        except (OSError, ValueError):
            qc = None
        # why 128 x 128 is assumed (named when the scales do not fit it), or None
        self._fp8_block_assumed = ("quantization_config" if not isinstance(qc, dict) else
                                   "quantization_config.weight_block_size" if not qc.get("weight_block_size") else None)
        if not isinstance(qc, dict):
            return (128, 128)
        if qc.get("quant_method") == "mxfp4" and hasattr(self.family, "expert_from_mxfp4"):
            return (128, 128)  # MXFP4 experts (gpt-oss): read by the family's layout, no FP8 blocks
        if qc.get("quant_method", "fp8") != "fp8":
            raise CheckpointError(f"{self.folder / 'config.json'}: quantization_config.quant_method "
                                  f"{qc.get('quant_method')!r} is not read; use the model's bf16 or FP8 release")
        bs = qc.get("weight_block_size") or [128, 128]
        if (not isinstance(bs, list) or len(bs) != 2 or
                any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs)):
            raise CheckpointError(f"{self.folder / 'config.json'}: quantization_config.weight_block_size "
                                  f"{bs!r} must be two positive integers")
        return (bs[0], bs[1])

    def skipped_tensors(self) -> list[str]:
        """The checkpoint's tensors that config.json does not use, one line per group:
        ``model.layers.N.*`` for a layer beyond num_hidden_layers (the multi-token-prediction
        layers, described by num_nextn_predict_layers or not), else names with the layer
        number replaced by ``*`` (q/k norms under use_qk_norm false, ...), with a count."""
        a = self.args
        nhl, mtp = a.num_hidden_layers, getattr(a, "num_nextn_predict_layers", 0)
        beyond: dict[int, int] = {}
        other: dict[str, int] = {}
        for n in self._where:
            if n in self._used:
                continue
            m = re.match(r"model\.layers\.(\d+)\.", n)
            if m and int(m.group(1)) >= nhl:
                beyond[int(m.group(1))] = beyond.get(int(m.group(1)), 0) + 1
            else:
                g = re.sub(r"\.layers\.\d+\.", ".layers.*.", n)
                other[g] = other.get(g, 0) + 1
        lines = []
        for L in sorted(beyond):
            k = beyond[L]
            if L - nhl < a.mtp_layers:  # a kept head's copies of embed_tokens / shared_head.head
                why = "the kept multi-token-prediction head's copies of the main model's tensors, not needed"
            elif L - nhl < mtp:
                why = "multi-token-prediction layer, not used to generate"
            else:
                why = (f"a layer beyond num_hidden_layers {nhl} that num_nextn_predict_layers {mtp} "
                       f"does not describe (a multi-token-prediction layer?), not used")
            lines.append(f"model.layers.{L}.* ({k} tensor{'s' * (k > 1)}: {why})")
        for g in sorted(other):
            k = other[g]
            hint = next((h for key, h in _UNUSED_HINTS if key in g), "")
            lines.append(f"{g} ({k} tensor{'s' * (k > 1)}: not used by config.json's {a.model_type} "
                         f"settings{hint})")
        return lines

    def _scale_name(self, name: str) -> str:
        return name + "_scale_inv"

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
            base.check_not_gguf(self.folder, has_config=True)
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

    def _defaults_hint(self) -> str:
        """'' or, for a family with ``DEFAULTED_KEYS``, the ones config.json (or its
        ``text_config``) lacks and the defaults used for them: "; config.json has no 'k' (...)"."""
        keys = getattr(self.family, "DEFAULTED_KEYS", None)
        try:
            cfg = json.loads((self.folder / "config.json").read_text(encoding="utf-8")) if keys else None
        except (OSError, ValueError):
            cfg = None
        if not isinstance(cfg, dict):
            return ""
        cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        absent = [k for k in keys if k not in cfg]
        if not absent:
            return ""
        return "; " + ", ".join(f"config.json has no '{k}' (transformers' default {keys[k]} was used)"
                                for k in absent) + " - add the model's values from its original config.json"

    def _check_one(self, name: str, shape: tuple, raw: bool = False) -> bool:
        """False if ``name`` is absent; raises if present with the wrong shape or dtype
        (``raw``: must be uint8, the MXFP4 blocks and scales)."""
        f = self._where.get(name)
        if f is None:
            return False
        self._used.add(name)
        sl = self._handles[f].get_slice(name)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{f}: tensor '{name}' has shape {list(got)} but config.json "
                                  f"implies {list(shape)}; config and weights do not match{self._defaults_hint()}")
        if raw:
            if sl.get_dtype() != "U8":
                raise CheckpointError(f"{f}: tensor '{name}' has dtype {sl.get_dtype()}; MXFP4 blocks and "
                                      f"scales are uint8 (U8) - the checkpoint is damaged, download it again")
            return True
        if sl.get_dtype() == "F8_E4M3":
            sn = self._scale_name(name)
            bo, bi = self._fp8_block
            want = (-(-got[0] // bo), -(-got[1] // bi)) if len(got) == 2 else None
            if want is None or sn not in self._where:
                raise CheckpointError(f"{f}: tensor '{name}' is float8 but has no block scales "
                                      f"'{sn}'; only FP8 checkpoints with weight_scale_inv are read")
            self._used.add(sn)
            ssl = self._handles[self._where[sn]].get_slice(sn)
            if ssl.get_dtype() not in ("BF16", "F16", "F32"):
                raise CheckpointError(f"{self._where[sn]}: tensor '{sn}' has dtype {ssl.get_dtype()}; FP8 block "
                                      f"scales must be float32 (or bf16 / f16) - the checkpoint is damaged or "
                                      f"was written by another tool: download the model's FP8 release again")
            if tuple(ssl.get_shape()) != want:
                if self._fp8_block_assumed:
                    src = (f"config.json has no {self._fp8_block_assumed}, so {bo}x{bi} "
                           f"blocks were assumed; add \"quantization_config\": {{\"quant_method\": \"fp8\", "
                           f"\"weight_block_size\": [rows, cols]}} with the model's values to config.json")
                else:
                    src = (f"config.json's quantization_config.weight_block_size {[bo, bi]} implies "
                           f"{list(want)}; config and weights do not match")
                raise CheckpointError(f"{self._where[sn]}: tensor '{sn}' has shape {list(ssl.get_shape())} "
                                      f"for '{name}' {list(got)}, but {src}")
        elif sl.get_dtype() in ("I64", "I32") and len(got) == 2 and name.endswith(".tid2eid"):
            pass  # DeepSeek-V4's token -> experts table: integers, read as float32 (exact below 2^24)
        elif sl.get_dtype() not in ("BF16", "F16", "F32"):
            raise CheckpointError(f"{f}: tensor '{name}' has dtype {sl.get_dtype()}; only "
                                  f"bf16, f16, f32 and block-scaled float8 (e4m3) checkpoints are supported")
        return True

    def _missing(self, name: str) -> CheckpointError:
        a = self.args
        return CheckpointError(f"{self.folder}: tensor '{name}' is missing from the checkpoint "
                               f"(config.json says {a.model_type}, {a.num_hidden_layers} layers, "
                               f"{a.num_moe_layers} with {a.num_experts} experts)")

    def _check_tensors(self) -> None:
        a = self.args
        for t in dense_tensors(self.family, a):
            if not self._check_one(t.hf, t.shape):
                raise self._missing(t.hf)
        shapes = base.expert_shapes(a)
        E, I, D = a.num_experts, a.moe_intermediate_size, a.hidden_size
        for i in a.moe_layers:
            if hasattr(self.family, "expert_tensors"):  # the family's own fused layout (gpt-oss)
                self._check_family_experts(i)
                continue
            en = self.family.expert_names(a, i)
            fused = next((p for p in en.fused_prefixes if p + "gate_up_proj" in self._where), None)
            if fused is not None and en.name(0, "gate_proj") not in self._where:
                gu, dn = fused + "gate_up_proj", fused + "down_proj"
                self._check_one(gu, (E, 2 * I, D))
                if not self._check_one(dn, (E, D, I)):
                    raise self._missing(dn)
                self._fused[i] = (gu, dn)
                continue
            for e in range(E):
                for p in base.EXPERT_PROJS:
                    if not self._check_one(en.name(e, p), shapes[p]):
                        raise self._missing(en.name(e, p))

    def _check_family_experts(self, i: int) -> None:
        """Layer i's experts in the family's fused layout: MXFP4 (blocks + scales) when its
        gate_up_proj_blocks is present, else bf16 / f16 / f32. Raises CheckpointError."""
        a = self.args
        mx = self.family.expert_tensors(a, i, mxfp4=True)
        use_mx = next(iter(mx)) in self._where
        if use_mx and (a.hidden_size % 32 or a.moe_intermediate_size % 32):
            raise CheckpointError(f"{self.folder}: MXFP4 experts need hidden_size and intermediate_size to be "
                                  f"multiples of 32 (config.json says {a.hidden_size} and {a.moe_intermediate_size})")
        names = mx if use_mx else self.family.expert_tensors(a, i)
        for n, shape in names.items():
            if not self._check_one(n, shape, raw=use_mx and not n.endswith("_bias")):
                raise self._missing(n)
        self._family_fused[i] = (names, use_mx)

    def _family_rows(self, layer: int, e: int) -> dict[str, np.ndarray]:
        """Expert ``e``'s slices of layer ``layer``'s fused tensors; MXFP4 blocks / scales as
        stored, refused (CheckpointError naming the ``*_scales`` tensor, expert, row and block)
        when a block decodes to NaN or inf."""
        names, mx = self._family_fused[layer]
        rows = {n: (self._read_raw(n, e) if mx and not n.endswith("_bias") else self._read(n, e)) for n in names}
        for n in names if mx else ():
            if n.endswith("_scales"):
                hit = mxfp4_nonfinite_block(rows[n[:-len("_scales")] + "_blocks"], rows[n])
                if hit is not None:
                    r, g, byte = hit
                    raise CheckpointError(
                        f"{self._where[n]}: tensor '{n}' expert {e} row {r} block {g}: scale byte {byte} "
                        f"decodes to {'NaN' if byte == 255 else 'inf'} (MXFP4 scales are finite below 255, and "
                        f"254 only under codes below 2); the checkpoint is broken: download it again. "
                        f"Nothing was converted.")
        return rows

    def is_mxfp4(self, layer: int) -> bool:
        """True when transformer layer ``layer``'s experts are stored as MXFP4 blocks + scales."""
        return self._family_fused.get(layer, ({}, False))[1]

    def quantized_expert(self, layer: int, e: int, quant: str, group_size: int
                         ) -> dict[str, dict[str, np.ndarray]] | None:
        """An MXFP4 expert converted to an mxfp4 store: its codes, scale bytes and float32
        biases as stored ({proj: {"w", "s", "b"}}, never decoded); None otherwise (the
        converter then quantizes :meth:`expert`)."""
        if quant != "mxfp4" or not self.is_mxfp4(layer):
            return None
        return self.family.expert_from_mxfp4(self.args, layer, self._family_rows(layer, e))

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        """Expert ``e`` of transformer layer ``layer``: {"gate_proj": [I, D], "up_proj": [I, D],
        "down_proj": [D, I]} float32, read alone (a fused tensor is read one expert's rows);
        gpt-oss adds the biases "gate_proj.b", "up_proj.b", "down_proj.b"."""
        if layer in self._family_fused:
            rows = self._family_rows(layer, e)
            if self.is_mxfp4(layer):
                return self.family.dequantized_expert(self.args, layer, rows)
            return self.family.expert_from_fused(self.args, layer, rows)
        if layer in self._fused:
            gu, dn = self._fused[layer]
            I = self.args.moe_intermediate_size
            g_u = self._read(gu, e)
            return {"gate_proj": g_u[:I], "up_proj": g_u[I:], "down_proj": self._read(dn, e)}
        en = self.family.expert_names(self.args, layer)
        return {p: self.get(en.name(e, p)) for p in base.EXPERT_PROJS}

    def expert_nbytes(self, layer: int) -> int:
        """Checkpoint bytes of one expert of transformer layer ``layer``."""
        if layer in self._family_fused:
            return sum(self.nbytes(n) for n in self._family_fused[layer][0]) // self.args.num_experts
        if layer in self._fused:
            return sum(self.nbytes(n) for n in self._fused[layer]) // self.args.num_experts
        en = self.family.expert_names(self.args, layer)
        return sum(self.nbytes(en.name(0, p)) for p in base.EXPERT_PROJS)

    def file_of(self, name: str) -> Path:
        """The weight file holding tensor ``name``."""
        return self._where[name]

    def nbytes(self, name: str) -> int:
        sl = self._handles[self._where[name]].get_slice(name)
        size = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8, "I32": 4}[sl.get_dtype()]
        return int(np.prod(sl.get_shape())) * size

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a new float32 array (read with pread, page cache dropped)."""
        return self._read(name)

    def _bytes(self, name: str, row: int | None = None) -> tuple[bytes, str, list]:
        """The stored bytes of tensor ``name`` (or its ``row``-th slice along dim 0), its dtype
        name and shape (read with pread, page cache dropped)."""
        path = self._where[name]
        start, end, dt, shape = self._spans[name]
        if row is not None:
            step = (end - start) // shape[0]
            start, end, shape = start + row * step, start + (row + 1) * step, shape[1:]
        fd = self._fds[path]
        try:
            raw = os.pread(fd, end - start, start)
            if len(raw) != end - start:
                raise OSError(f"short read ({len(raw)} of {end - start} bytes)")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise CheckpointError(f"{path}: reading tensor '{name}' failed ({e})") from None
        return raw, dt, shape

    def _read_raw(self, name: str, row: int | None = None) -> np.ndarray:
        """A uint8 tensor (MXFP4 blocks / scales) or its ``row``-th slice, as stored."""
        raw, _, shape = self._bytes(name, row)
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape)

    def _read(self, name: str, row: int | None = None) -> np.ndarray:
        """Tensor ``name`` (or only its ``row``-th slice along dim 0) as float32."""
        path = self._where[name]
        raw, dt, shape = self._bytes(name, row)
        if dt == "U8":
            raise CheckpointError(f"{path}: tensor '{name}' is uint8 where a float tensor belongs; "
                                  f"the checkpoint is damaged or of another layout - download it again")
        if dt in ("BF16", "F8_E4M3"):  # ml_dtypes costs most of a CPU second to import: only for them
            import ml_dtypes
            np_dt = ml_dtypes.bfloat16 if dt == "BF16" else ml_dtypes.float8_e4m3fn
        else:
            np_dt = {"F16": np.float16, "F32": np.float32, "I64": np.int64, "I32": np.int32}[dt]
        w = np.frombuffer(raw, dtype=np_dt).reshape(shape).astype(np.float32)
        if dt == "F8_E4M3":
            if row is not None or w.ndim != 2:
                raise CheckpointError(f"{path}: tensor '{name}' is float8 with {w.ndim + (row is not None)} "
                                      f"dimensions; only 2-D block-scaled float8 matrices are read")
            bo, bi = self._fp8_block
            sn = self._scale_name(name)
            s = self._read(sn)  # [ceil(O / bo), ceil(N / bi)]
            bad = ~(np.isfinite(s) & (s > 0))
            if bad.any():
                r, c = (int(x) for x in np.argwhere(bad)[0])
                raise CheckpointError(
                    f"{self._where[sn]}: tensor '{sn}' element [{r}, {c}] = {s[r, c]} ({int(bad.sum())} of "
                    f"{s.size} block scales are zero, negative, NaN or inf); FP8 block scales are positive and "
                    f"finite - the checkpoint is broken: download it again. Nothing was converted.")
            w *= np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:w.shape[0], :w.shape[1]]
        return w

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
