"""The worker class of ``bench_start.py`` whose module imports torch and transformers, as a real
worker's does (importable by worker processes and Ray actors; not a benchmark itself)."""

from __future__ import annotations

import os

import torch
import transformers  # noqa: F401 - importing it is what the benchmark measures


class TorchWorker:
    """Answers with its pid once built."""

    def __init__(self) -> None:
        self.zero = torch.zeros(1)

    def ping(self) -> int:
        return os.getpid()
