"""bench/runners.py: the torch profiler's native start/stop lines are dropped, anything else kept."""
import os

from bench.runners import profiler_noise_dropped


def test_kineto_start_stop_lines_are_dropped_and_other_stderr_kept(capfd):
    with profiler_noise_dropped():
        os.write(2, b"USDT:2026-12-01 18:28:24 32166:32166 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
        os.write(2, b"USDT:2026-12-01 18:28:24 32166:32166 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "a real warning\n"


def test_the_torch_profiler_prints_nothing_under_it(capfd):
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profiler_noise_dropped(), profile(activities=[ProfilerActivity.CPU]):
        torch.ones(3).add_(1)
    assert "profiler_st" not in capfd.readouterr().err
