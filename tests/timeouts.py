"""The one limit on how long a test's subprocess (or a wait for one) may take: TIMEOUT seconds, 1800 by
default, or the environment's TORCHKVOPS_TEST_TIMEOUT. It is there to end a hang, not to time anything:
a command that takes 21 s alone took over 120 s on a 2-core machine shared with another job, so the
limit is generous, and a slower machine can raise it without editing a test."""

import os

__all__ = ["TIMEOUT"]

TIMEOUT = float(os.environ.get("TORCHKVOPS_TEST_TIMEOUT", "1800"))
