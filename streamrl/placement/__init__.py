"""Where a run's processes run.

- `config`: the `placement` section, one class per mode (`local` | `pools`).
- `planner`: on one machine, the CPU cores and GPUs of the learner, each generator and the
  evaluator, decided once before anything starts (`plan_placement`, `place_alone`).
- `gpu_memory`: the memory of a GPU the learner and engines share, planned together.
- `records`: the plan as a record (`PlacementPlan`, `<run>/control/placement.json`) and each
  process's affinity and environment (`ProcessPlacement.env()`, `bind_rank`).
- `cores`: the CPU cores and GPUs this process may use.

Imports: `storage.fs`, `streamrl.config`.
"""

from streamrl.placement.config import (
    LocalPlacement,
    PlacementConfig,
    PlacementError,
    PoolsPlacement,
)
from streamrl.placement.cores import machine_cpus, visible_gpus
from streamrl.placement.planner import place_alone, plan_placement
from streamrl.placement.records import (
    PLACED_VARIABLES,
    PLACEMENT_FILE,
    RANK_CORES_VARIABLE,
    Component,
    PlacementPlan,
    ProcessPlacement,
    bind_rank,
    read_placement,
    write_placement,
)

__all__ = [
    "PLACED_VARIABLES",
    "PLACEMENT_FILE",
    "RANK_CORES_VARIABLE",
    "Component",
    "LocalPlacement",
    "PlacementConfig",
    "PlacementError",
    "PlacementPlan",
    "PoolsPlacement",
    "ProcessPlacement",
    "bind_rank",
    "machine_cpus",
    "place_alone",
    "plan_placement",
    "read_placement",
    "visible_gpus",
    "write_placement",
]
