"""Experiment tests run single-threaded: tiny probe fits are slower in a 2-thread pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Small probe fits crawl in a contended 2-thread intra-op pool; one thread keeps tests fast."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
