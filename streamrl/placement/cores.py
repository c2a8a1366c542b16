"""What this process may use: its CPU cores and the GPUs it sees, which the planner
(`streamrl.placement.planner`) shares out between a run's processes. Core lists ('0-3,8') are
written and read by `streamrl.config.base` (`CoreSetting`, `parse_cores`, `format_cores`).
"""

from __future__ import annotations

import os

__all__ = ["machine_cpus", "visible_gpus"]


def machine_cpus() -> list[int]:
    """The cores this process may run on (its affinity), which the run's processes share."""
    return sorted(os.sched_getaffinity(0))


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as `CUDA_VISIBLE_DEVICES` names them for a child: that
    variable's entries when it is set (an empty value hides every GPU), else 0..N−1 for the N
    devices torch counts."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
