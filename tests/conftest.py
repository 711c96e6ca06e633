"""Puts the flat repo root on sys.path and registers hypothesis profiles (HYPOTHESIS_PROFILE=dev|ci, default ci)."""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Tensor tests are slower than hypothesis' default 200 ms deadline on a loaded 2-core CI machine.
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
