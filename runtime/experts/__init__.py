"""The hybrid expert tier: host store, GPU slot cache, CPU executor, placement policy, prefetch."""
