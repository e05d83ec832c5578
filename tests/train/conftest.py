import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # the machine is shared and has 2 cores; tiny shapes are faster on one thread anyway
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
