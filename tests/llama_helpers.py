"""llama.cpp (through llama-cpp-python, tests only) against a reference's logits: shared by the
GGUF tests (tests/test_bench_peers.py, tests/test_bench_gguf_seed.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# A llama.cpp source tree built with cmake (build/bin: llama-quantize, llama-tokenize, libllama.so ...):
# tests that need llama.cpp's own tools find it here, and skip (saying so) without it.
LLAMA_CPP_DIR_ENV = "LLAMA_CPP_DIR"


def llama_cpp_dir() -> Path | None:
    """The llama.cpp source tree named by $LLAMA_CPP_DIR when it holds a cmake build, else None."""
    d = os.environ.get(LLAMA_CPP_DIR_ENV)
    if d and (Path(d) / "build" / "bin").is_dir():
        return Path(d)
    return None


def llama_cpp_tool(name: str) -> Path:
    """The path of llama.cpp's native tool ``name`` (build/bin), or skip the test saying how to get it."""
    d = llama_cpp_dir()
    if d is None or not (d / "build" / "bin" / name).is_file():
        pytest.skip(f"needs llama.cpp's {name}: set {LLAMA_CPP_DIR_ENV} to a llama.cpp source tree built with "
                    f"cmake (cmake -B build && cmake --build build)")
    return d / "build" / "bin" / name


def import_llama_cpp():
    """The llama_cpp module (llama-cpp-python), its shared library taken from $LLAMA_CPP_DIR's
    build when the package was installed without one; skip the test when it cannot load."""
    d = llama_cpp_dir()
    if d is not None and not os.environ.get("LLAMA_CPP_LIB_PATH"):
        os.environ["LLAMA_CPP_LIB_PATH"] = str(d / "build" / "bin")
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as e:  # FileNotFoundError: a package built without its library
        pytest.skip(f"needs llama-cpp-python with its library ({type(e).__name__}: {e}); set {LLAMA_CPP_DIR_ENV} "
                    f"to a built llama.cpp tree for a package installed with LLAMA_BUILD=OFF")
    return llama_cpp


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats per row for logits float [N, V] (softmax of each)."""
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lq = q_logits - q_logits.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return (p * (np.log(p) - lq)).sum(-1)


def llama_logits(llama_cpp, model_path, ids, threads: int):
    """(float32 [len(ids), V]: llama.cpp's logits at every position of one batched eval, the Llama)."""
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=threads,
                          logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32), llm


def agreement(ref: np.ndarray, got: np.ndarray):
    """(top-1 agree bool [N], the reference's top-2 margin [N], max |got - ref|, max |ref|, KL [N])."""
    assert got.shape == ref.shape
    top2 = np.sort(ref, -1)[:, -2:]
    return (got.argmax(-1) == ref.argmax(-1), top2[:, 1] - top2[:, 0], float(np.abs(got - ref).max()),
            float(np.abs(ref).max()), kl(ref, got))


# llama.cpp's converter, run with a family's class reading the checkpoint's byte-level BPE
# vocabulary as every gpt2-style model does (GLM's own set_vocab looks up GLM's special tokens,
# ERNIE's and Hunyuan's read their own tokenizer files)
_WITH_QWEN2_VOCAB = """
import runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
import conversion.{module} as m
m.{cls}.set_vocab = lambda self: self._set_vocab_gpt2()
runpy.run_path(script, run_name="__main__")
"""
_OWN_VOCAB = {"glm4_moe": ("glm", "Glm4MoeModel"), "glm4_moe_lite": ("glm", "Glm4MoeLiteModel"),
              "ernie4_5_moe": ("ernie", "Ernie4_5Model"),
              "hunyuan_v1_moe": ("hunyuan", "HunYuanMoEModel")}


def convert_command(d: Path, checkpoint: Path, out: Path, family: str) -> list[str]:
    """The command line of llama.cpp's Hugging Face -> GGUF converter (tree ``d``) writing ``out``
    as F16 (Qwen3-Next: without multi-token-prediction layers); for GLM-4 MoE, ERNIE 4.5 and Hunyuan with the
    checkpoint's byte-level BPE vocabulary (see above)."""
    args = [str(d / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile", str(out), "--outtype", "f16"]
    if family in _OWN_VOCAB:
        module, cls = _OWN_VOCAB[family]
        args = ["-c", _WITH_QWEN2_VOCAB.format(module=module, cls=cls), *args]
    if family == "qwen3_next":  # Qwen3-Next's config does not count its MTP layers: the converter asks
        args.append("--no-mtp")
    return [sys.executable, *args]
