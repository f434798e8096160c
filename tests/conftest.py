"""Test-wide settings: one torch thread (tests use small tensors; on a shared 2-core box two threads
mostly wait on each other) and a fixed hypothesis profile for deterministic CI runs."""

import torch
from hypothesis import settings

torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.load_profile("ci")
