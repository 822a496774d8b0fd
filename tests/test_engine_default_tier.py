"""Without an explicit experts factory the engine lets the planner place experts on a GPU."""
from __future__ import annotations

import torch

from runtime.engine import default_experts_factory, resident_experts_factory
from runtime.experts.hybrid import hybrid_experts_factory


def test_gpu_loads_go_through_the_planner_and_cpu_loads_stay_resident():
    assert default_experts_factory(torch.device("cuda")) is hybrid_experts_factory
    assert default_experts_factory(torch.device("cuda:0")) is hybrid_experts_factory
    assert default_experts_factory(torch.device("cpu")) is resident_experts_factory
