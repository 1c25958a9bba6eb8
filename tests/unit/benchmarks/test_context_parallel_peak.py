"""The CP benchmark's peak breakdown (rldock_benchmarks.context_parallel_peak): what is live at a
profiled window's allocation peak, named by the record it was made under, on a window whose peak
is known by construction."""

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rldock_benchmarks.context_parallel_peak import live_at_peak


def test_the_breakdown_holds_what_is_live_at_the_peak_by_its_maker():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        with record_function("FSDP::all_gather (model.layers.1)"):
            gathered = torch.empty(1000)  # 4,000 bytes, live through the peak
            with record_function("c10d::_allgather_base_"):
                work = torch.empty(250)  # 1,000 bytes the collective made, live through the peak
        activation = torch.empty(2000)  # 8,000 bytes: the peak, 12,000
        del activation
        later = torch.empty(500)  # made after the peak: not in it
    peak, live = live_at_peak(profiler)
    assert peak == 13_000
    assert live == {
        "fwd aten::empty": 8_000,
        "FSDP::all_gather (model.layers.1)": 4_000,
        "FSDP::all_gather (model.layers.1) > c10d::_allgather_base_": 1_000,
    }
    assert gathered.numel() + work.numel() + later.numel() == 1_750  # all kept alive to the window's end
