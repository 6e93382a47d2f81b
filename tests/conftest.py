"""Shared fixtures: tiny random OLMoE checkpoints and converted stores."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Tests are not benchmarks: OpenMP threads that sleep instead of spinning keep the suite's
# time steady when the machine is shared (spinning threads slowed it 10-50x under load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Kernels compile in the test process (and the processes it starts), not in a child of each
# Engine.open on a fresh cache (engine.kernel_prepare): its RSS is nobody's budget.
# tests/test_sizing.py::test_first_open_compiles_in_a_child_process tests the child.
os.environ.setdefault("COLIBRI_COMPILE_IN_PROCESS", "1")


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Never touch the user's real data or config directories."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(base / "userdata"))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(base / "userconfig"))
    monkeypatch.setenv("COLIBRI_CLAIMS_DIR", str(base / "budget-claims"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny OLMoE checkpoint the fake hub serves (hubserver.tiny_checkpoint, seed 0)."""
    import hubserver
    return hubserver.tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random OLMoE checkpoint (hidden 64, 2 layers, 8 experts, top-2, GQA 4/2) in HF layout."""
    from engine.bench.synthetic import olmoe_config, write_checkpoint
    d = tmp_path_factory.mktemp("ck") / "tiny"
    return write_checkpoint(d, olmoe_config(num_key_value_heads=2), seed=3)


@pytest.fixture(scope="session")
def tiny_store(tiny_checkpoint, tmp_path_factory):
    from engine import convert_checkpoint
    return convert_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("st") / "tiny-int8", quant="int8")


@pytest.fixture(scope="session")
def medium_checkpoint(tmp_path_factory):
    """Bigger random model (4 layers x 16 experts, top-4) so small caps really stream."""
    from engine.bench.synthetic import olmoe_config, write_checkpoint
    d = tmp_path_factory.mktemp("ck") / "medium"
    cfg = olmoe_config(hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_experts=16,
                       num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return write_checkpoint(d, cfg, seed=5)


@pytest.fixture(scope="session")
def medium_store(medium_checkpoint, tmp_path_factory):
    from engine import convert_checkpoint
    return convert_checkpoint(medium_checkpoint, tmp_path_factory.mktemp("st") / "medium-int8", quant="int8")
