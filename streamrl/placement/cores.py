"""CPU core lists and GPU names: parsing and printing them, and what this process may use.

`CoreSetting` is the type of every `*.cpu_cores` field (a count, or a core list such as
'0-3,8'); the planner (`streamrl.placement.planner`) shares the cores out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BeforeValidator

__all__ = [
    "MAX_CORES",
    "CoreSetting",
    "format_cores",
    "machine_cpus",
    "parse_cores",
    "visible_gpus",
]

MAX_CORES = 65536
"""CPU core counts and core numbers are below this."""


def parse_cores(text: str) -> list[int]:
    """'0-3,8' → [0, 1, 2, 3, 8] (sorted, each core once)."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{text!r} is not a core list like '0-3,8'")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"core range {part!r} runs backwards; write {last}-{first}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"{text!r} names no core; write a core list like '0-3,8' or a count")
    return sorted(cores)


def format_cores(cores: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] → '0-3,8' (the form taskset and VLLM_CPU_OMP_THREADS_BIND read)."""
    ranges: list[str] = []
    ordered = sorted(set(cores))
    start = prev = ordered[0] if ordered else 0
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(ranges) if ordered else ""


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


def _core_setting(value: Any) -> Any:
    """A count (4, "4") or a core list ("0-3,8", [0, 1, 2, 3, 8]) → int or sorted list."""
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else parse_cores(value)
    if isinstance(value, bool):
        raise ValueError("give a core count (4) or a core list ('0-3,8'), not true/false")
    if isinstance(value, int) and not 1 <= value < MAX_CORES:
        raise ValueError(
            f"a core count must be ≥ 1 and < {MAX_CORES}, got {value}; null picks cores "
            "automatically"
        )
    if isinstance(value, list):
        if not value or any(not isinstance(c, int) or not 0 <= c < MAX_CORES for c in value):
            raise ValueError(f"a core list holds core numbers ≥ 0 and < {MAX_CORES}, got {value}")
        value = sorted(set(value))
    return value


CoreSetting = Annotated[int | list[int] | None, BeforeValidator(_core_setting)]
"""CPU cores of a component: null (automatic), a count, or a core list ("0-3,8")."""
