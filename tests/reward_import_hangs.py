"""A reward module whose import never ends (as one waiting on a network share, a lock or
input would): always without $STREAMRL_TEST_MARKERS, else while the file `hang-import` is in
that folder. `reward` is `tests.reward_fns.scripted`. Never import it in a test process."""

from __future__ import annotations

import os
import time

from tests.reward_fns import scripted as reward

__all__ = ["reward"]

_markers = os.environ.get("STREAMRL_TEST_MARKERS")
while _markers is None or os.path.exists(os.path.join(_markers, "hang-import")):
    time.sleep(0.1)
