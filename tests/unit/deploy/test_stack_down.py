"""`make down` of a Docker stack (`scripts/stack.sh down` after `make up DOCKER=1`) leaves no
Docker object of the stack behind: the flow runs' containers, the secret volume, and the
internal network `streamrl`, removed last, once its containers and what listened on its gateway
are gone. A stack dir of a Docker stack with nothing running, and stand-ins for `docker` (which
records what it is asked) and `iptables` (the host's firewall is not a test's to change); the
Docker stack itself, with a daemon, is tests/e2e/test_docker.py (slow)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

DOCKER = """#!/usr/bin/env bash
printf '%s\\n' "$*" >>"$DOCKER_CALLS"
if [[ "$1" == ps ]]; then echo c0ffee; fi
"""
IPTABLES = """#!/usr/bin/env bash
exit 0
"""


def test_down_removes_the_containers_then_the_network(tmp_path: Path) -> None:
    stack, bin_dir, calls = tmp_path / "stack", tmp_path / "bin", tmp_path / "docker-calls"
    stack.mkdir()
    (stack / "docker").touch()  # the marker of a stack started with DOCKER=1
    bin_dir.mkdir()
    for name, text in {"docker": DOCKER, "iptables": IPTABLES}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DOCKER_CALLS": str(calls),
        "STREAMRL_STACK_DIR": str(stack),
        "STREAMRL_PREFECT_PROFILE": "",
    }
    done = subprocess.run(
        ["bash", "scripts/stack.sh", "down"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    asked = calls.read_text().splitlines()
    removed = [call for call in asked if call.startswith(("rm ", "volume rm", "network rm"))]
    assert removed == ["rm -f c0ffee", "volume rm streamrl-secrets", "network rm streamrl"]
    assert "removed the Docker network streamrl" in done.stdout
    assert not (stack / "docker").exists()
