"""Where a run's processes run.

- `config`: the `placement` section, one class per mode (`local` | `pools`).
- `planner`: on one machine, the CPU cores and GPUs of the learner, each generator and the
  evaluator, decided once before anything starts (`plan_placement`, `place_alone`).
- `records`: the plan as a record (`PlacementPlan`, `<run>/control/placement.json`) and each
  process's affinity and environment (`ProcessPlacement.env()`, `bind_rank`).
- `cores`: core lists ('0-3,8') and what this process may use.
"""

from streamrl.placement.config import (
    LocalPlacement,
    PlacementConfig,
    PlacementError,
    PoolsPlacement,
)
from streamrl.placement.cores import (
    CoreSetting,
    format_cores,
    machine_cpus,
    parse_cores,
    visible_gpus,
)
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
    "CoreSetting",
    "LocalPlacement",
    "PlacementConfig",
    "PlacementError",
    "PlacementPlan",
    "PoolsPlacement",
    "ProcessPlacement",
    "bind_rank",
    "format_cores",
    "machine_cpus",
    "parse_cores",
    "place_alone",
    "plan_placement",
    "read_placement",
    "visible_gpus",
    "write_placement",
]
