import pytest
import torch


@pytest.fixture(autouse=True)
def _threads():
    # two cores shared with other test runs: keep every test on one thread, and deterministic
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
