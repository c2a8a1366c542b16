"""Running a test's worker script as a real multi-rank job under torchrun (gloo, 127.0.0.1)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(
    script: str | Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None
) -> None:
    """Run `script args` on `nproc` ranks of one node; fail the test with the job's output if
    it does not exit 0. `env` adds to this process's environment (one thread per rank)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"torchrun {script} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
