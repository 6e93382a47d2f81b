"""The GGUF models already on this computer: LM Studio's and Ollama's model folders and the
Hugging Face cache, each with its name, size, quantization, architecture and whether colibri
runs it (family supported, RAM verdict). Only headers are read; nothing is changed or moved.

Where each keeps them:
  - LM Studio: ``~/.lmstudio/models/<publisher>/<repo>/*.gguf`` (older versions
    ``~/.cache/lm-studio/models``), plain files; a split model's parts side by side.
  - Ollama: ``$OLLAMA_MODELS`` or ``~/.ollama/models``: ``manifests/<registry>/<namespace>/
    <name>/<tag>`` is a JSON manifest whose layer of mediaType
    ``application/vnd.ollama.image.model`` names the GGUF blob ``blobs/sha256-<hex>`` (a file
    without a .gguf suffix, which the import reads by its GGUF magic).
  - Hugging Face cache: huggingface_hub's ``scan_cache_dir`` (``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else its default), the .gguf files of each model repository's snapshots.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT_REGISTRY = ("registry.ollama.ai", "library")


@dataclass(frozen=True)
class FoundGGUF:
    """One GGUF model found on this computer.

    name: what the app calls it (LM Studio / cache: the file's name without .gguf or split
    suffix; Ollama: ``name:tag``). path: the file to import (a split's first part). where:
    "LM Studio", "Ollama" or "Hugging Face cache". size: bytes of every part. quant: llama.cpp's
    file type ("Q4_K_M", "" when the file does not say). architecture: ``general.architecture``
    ("" when unreadable). runs: colibri imports it and this computer's RAM holds it.
    message: one line: why it does not run, or the RAM verdict's.
    """

    name: str
    path: str
    where: str
    size: int
    quant: str
    architecture: str
    runs: bool
    message: str

    @property
    def model_name(self) -> str:
        """``name`` as a store's folder name can hold it (Ollama's "ns/name:tag" -> "ns-name-tag")."""
        return re.sub(r"[^\w.+-]+", "-", self.name).strip("-.") or "model"


def _home(home) -> Path:
    return Path(home) if home is not None else Path.home()


def lmstudio_files(home=None) -> list[tuple[str, Path]]:
    """(name, file) of each GGUF model in LM Studio's model folders (a split model once, by its
    first part; projector files ``mmproj*`` left out)."""
    from ..gguf_import import SPLIT_RE
    out = []
    for root in (_home(home) / ".lmstudio" / "models", _home(home) / ".cache" / "lm-studio" / "models"):
        try:
            files = sorted(root.glob("*/*/*.gguf"))
        except OSError:
            continue
        for f in files:
            m = SPLIT_RE.match(f.name)
            if f.name.lower().startswith("mmproj") or (m and int(m.group("no")) != 1) or not f.is_file():
                continue
            out.append((m.group("stem") if m else f.stem, f))
    return out


def ollama_files(home=None, models: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """(name:tag, blob) of each model in Ollama's store whose manifest names a GGUF blob that
    exists. ``models``: the store (default $OLLAMA_MODELS, else ~/.ollama/models)."""
    root = Path(models or os.environ.get("OLLAMA_MODELS") or _home(home) / ".ollama" / "models")
    manifests = root / "manifests"
    out = []
    try:
        found = sorted(p for p in manifests.glob("*/*/*/*") if p.is_file())
    except OSError:
        return out
    for p in found:
        registry, namespace, name, tag = p.relative_to(manifests).parts
        try:
            layers = json.loads(p.read_text(encoding="utf-8")).get("layers") or []
            digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE)
        except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
            continue  # not a model manifest (or unreadable): nothing to list
        blob = root / "blobs" / str(digest).replace(":", "-", 1)
        if not blob.is_file():
            continue
        if (registry, namespace) == OLLAMA_DEFAULT_REGISTRY:
            label = f"{name}:{tag}"
        elif registry == OLLAMA_DEFAULT_REGISTRY[0]:
            label = f"{namespace}/{name}:{tag}"
        else:
            label = f"{registry}/{namespace}/{name}:{tag}"
        out.append((label, blob))
    return out


def hf_cache_files(cache_dir: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """(name, file) of the .gguf files in the Hugging Face cache's model snapshots (a split model
    once, by its first part). ``cache_dir``: default $HF_HUB_CACHE, else $HF_HOME/hub, else
    huggingface_hub's default."""
    from ..gguf_import import SPLIT_RE
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        return []
    if cache_dir is None:
        cache_dir = os.environ.get("HF_HUB_CACHE") or (
            str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None)
    try:
        info = scan_cache_dir(cache_dir)
    except Exception as e:  # noqa: BLE001 - no cache (CacheNotFound) or one it cannot read: nothing found there
        log.debug("Hugging Face cache not scanned: %s", e)
        return []
    out, seen = [], set()
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            for f in sorted(rev.files, key=lambda f: f.file_name):
                m = SPLIT_RE.match(f.file_name)
                if (not f.file_name.lower().endswith(".gguf") or f.file_name.lower().startswith("mmproj")
                        or (m and int(m.group("no")) != 1) or f.blob_path in seen):
                    continue
                seen.add(f.blob_path)
                out.append((m.group("stem") if m else Path(f.file_name).stem, Path(f.file_path)))
    return out


def file_type_name(ft) -> str:
    """llama.cpp's name of ``general.file_type`` ("Q4_K_M"), "" when absent or unknown."""
    try:
        from gguf import LlamaFileType
        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except (ImportError, ValueError, TypeError):
        return ""


def describe_gguf(name: str, path: Path, where: str, context_length: int = 0) -> FoundGGUF:
    """A FoundGGUF of the model at ``path`` (its header read; a file that cannot be imported is
    one that does not run, with its one-line reason)."""
    from ..errors import CheckpointError, ConfigError
    from ..gguf_import import GGUFModel, GGUFSource, gguf_estimate
    from ..sizing import machine_ram, ram_verdict
    size, quant, arch = 0, "", ""
    try:
        size = path.stat().st_size
        with GGUFModel(path) as g:
            size = sum(f.stat().st_size for f in g.files)
            quant, arch = file_type_name(g.kv.get("general.file_type")), g.arch
            source = GGUFSource(g)
            est = gguf_estimate(source, context_length)
        total, avail = machine_ram()
        verdict, msg = ram_verdict(est, source.args.num_experts_per_tok, total, avail)
        return FoundGGUF(name, str(path), where, size, quant, arch, verdict != "no", msg)
    except (CheckpointError, ConfigError, OSError) as e:
        return FoundGGUF(name, str(path), where, size, quant, arch, False, str(e).splitlines()[0] if str(e) else
                         type(e).__name__)
    except Exception as e:  # noqa: BLE001 - one odd file must not hide the others from the list
        log.warning("%s: cannot be described: %r", path, e)
        return FoundGGUF(name, str(path), where, size, quant, arch, False,
                         f"{path}: cannot be read as a GGUF model ({type(e).__name__}); try importing it to see why")


def find_gguf_models(home: str | os.PathLike | None = None, ollama_models: str | os.PathLike | None = None,
                     hf_cache: str | os.PathLike | None = None, context_length: int = 0) -> list[FoundGGUF]:
    """Every GGUF model in LM Studio's and Ollama's folders and the Hugging Face cache, in that
    order (``home`` default the user's; the other two as :func:`ollama_files` /
    :func:`hf_cache_files`). Never raises for what it finds: an unreadable file is listed as not
    running, with the reason."""
    found = [("LM Studio", n, p) for n, p in lmstudio_files(home)]
    found += [("Ollama", n, p) for n, p in ollama_files(home, ollama_models)]
    found += [("Hugging Face cache", n, p) for n, p in hf_cache_files(hf_cache)]
    return [describe_gguf(n, p, where, context_length) for where, n, p in found]
