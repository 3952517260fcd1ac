"""FSDP2 training across a process group (examples/fsdp2_training.py), and sc.init_distributed() misuse."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fsdp2_example(monkeypatch):
    # Imported as examples.fsdp2_training with the repository root on sys.path, so worker
    # processes (which get the controller's sys.path, or Ray's PYTHONPATH) can import its classes.
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("examples.fsdp2_training")


@pytest.mark.timeout(300)
def test_fsdp2_training_loss_falls_and_gathered_weights_match(fsdp2_example, process_backend):
    # 15 rows: the split pads one row onto rank 1 and every step still trains on both ranks.
    result = fsdp2_example.main(["--backend", process_backend, "--steps", "10", "--batch-size", "15"])

    losses = result["losses"]
    assert len(losses) == 10
    assert losses[-1] < 0.7 * losses[0], f"the loss did not fall: {losses}"
    # The gathered full state dict, loaded into a fresh model, reproduces the sharded model's logits.
    assert result["max_logit_diff"] <= 1e-5
    assert result["num_tensors"] == 27  # embeddings, 2 layers x 12 tensors, final norm, lm head


@pytest.mark.timeout(300)
def test_fsdp2_example_refuses_the_inline_backend(fsdp2_example, capsys):
    with pytest.raises(SystemExit) as excinfo:
        fsdp2_example.main(["--backend", "inline"])
    assert excinfo.value.code == 2
    assert "inline" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_init_distributed_outside_a_worker_raises(monkeypatch):
    import torch.distributed as dist

    import spmdcall as sc

    assert not dist.is_initialized(), "a test left a process group in the pytest process"
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="inside a worker"):
        sc.init_distributed()
    assert not dist.is_initialized()
