"""Fixtures shared by the test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models (far faster than two on shared cores), restored after.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``; being module-scoped it is
    set before the module's own module-scoped fixtures (trained runs) are built.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
