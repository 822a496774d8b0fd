"""`freetoken bench model`'s own arithmetic (the GPU rows run on the GPU machine)."""
from __future__ import annotations

import numpy as np

from runtime.experts.bench_model import distinct_per_layer


def test_distinct_experts_per_layer_call_count_each_call_once():
    """[S, L, T, K] routing -> the mean number of distinct experts a layer call touches: a batch whose tokens share
    experts touches fewer than T*K; one token always touches K."""
    one = np.array([[[[1, 2]], [[3, 4]]]])                          # S 1, L 2, T 1, K 2
    assert distinct_per_layer(one) == 2.0
    shared = np.array([[[[1, 2], [2, 3]], [[5, 5], [5, 5]]]])       # layer 0: {1,2,3}; layer 1: {5}
    assert distinct_per_layer(shared) == 2.0
    steps = np.stack([shared[0], one[0].repeat(2, axis=1)])         # a second step: {1,2}, {3,4}
    assert distinct_per_layer(steps) == (3 + 1 + 2 + 2) / 4
