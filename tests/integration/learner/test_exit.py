"""A learner process ends without finalizing the interpreter (`exit_process`): gloo's worker
threads outlive the process group and may free a collective's tensors while the interpreter
tears down, which aborts a run that succeeded (SIGABRT). Exit handlers and buffered output must
still make it out, and the exit code must be the one asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PROGRAM = textwrap.dedent(
    """
    import atexit, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from streamrl.learner.topology import Topology, exit_process

    out = Path(sys.argv[1])

    class Finalized:
        '''Freed only if the interpreter tears down: the teardown a gloo thread can race.'''
        def __del__(self, path=out / "finalized"):
            path.write_text("the interpreter was finalized")

    marker = Finalized()
    atexit.register(lambda: (out / "handlers").write_text("exit handlers ran"))
    topology = Topology.from_env("cpu")  # a one-rank gloo group: its worker threads run
    summed = torch.ones(4)
    dist.all_reduce(summed)
    topology.destroy()
    print("learner: trained to step", int(summed.sum()))  # buffered: stdout is a pipe
    exit_process(3)
    """
)


@pytest.mark.timeout(120)
def test_a_learner_process_exits_without_a_teardown_after_its_exit_handlers(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[3])},
    )
    assert done.returncode == 3, done.stderr
    assert "learner: trained to step 4" in done.stdout  # flushed before leaving
    assert (tmp_path / "handlers").read_text() == "exit handlers ran"
    assert not (tmp_path / "finalized").exists(), "the interpreter was torn down"
