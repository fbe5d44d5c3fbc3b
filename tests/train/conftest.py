import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny-model training is dominated by per-op overhead: one intra-op thread is faster, and
    on a busy 2-core machine two spinning OpenMP threads make these runs 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
