"""Intra-op threads follow the CPUs the process may use, unless OMP_NUM_THREADS says."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.executor.loader.model_loader import set_cpu_threads


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_affinity_mask(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert set_cpu_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert set_cpu_threads() == 2


def test_omp_num_threads_wins(monkeypatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert set_cpu_threads() == 1
