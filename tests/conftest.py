from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.processes", "tests.redis_server", "tests.etcd_server", "tests.watchdog"]

# CI machines are shared and slow: no per-example deadline, and a profile that
# keeps the default run bounded. HYPOTHESIS_PROFILE=thorough runs more examples.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "thorough", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
