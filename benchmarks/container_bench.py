"""A run on Docker work pools against the same run on process pools: how long a container takes
from its start to its first sampled token and to the learner's first step, with the page cache
cold and warm, and the steps per minute once running.

    python benchmarks/container_bench.py                 # smollm2-cpu, 10 steps, one generator
    python benchmarks/container_bench.py --size tiny-cpu --steps 6

Three runs of `streamrl/dapo` with `placement.mode=pools`, each on a fresh local stack
(`scripts/stack.sh`) with SeaweedFS, the run on S3:

- `process`: the process pools (`make up S3=1`), files cached;
- `docker, cold`: the Docker pools (`make up DOCKER=1`) right after the kernel's page cache was
  dropped (`/proc/sys/vm/drop_caches`): the image's layers, the interpreter, the libraries and
  the model are read from disk, as on a node that has the image but has not run it lately;
- `docker, warm`: the same again at once.

Times are read from what the run leaves: the container's start (`docker inspect`; for a process
pool, when its flow run started running), the component logs copied to `<run>/logs/<host>/`
(the generator's "start ..., weights vN (loaded in Xs)" line: engine and weights ready; its
"first tokens sampled" line; the learner's "step 1/" line) and the learner's metrics (steps per
minute from step 2 to the last). Needs Docker and root (the page cache); builds the image first
(`scripts/image.sh`). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentTaskRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from storage.fs import Location, open_location
from storage.seaweedfs import read_env_file
from streamrl.learner.metrics_records import read_metrics

ROOT = Path(__file__).resolve().parents[1]
_OWN = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ \S+: (.*)$")


@dataclass
class Startup:
    """Seconds from a component's start to each point of its start-up (None: not seen)."""

    ready_s: float | None = None  # generator: engine built and weights loaded
    weights_s: float | None = None  # generator: of which loading the weight version
    first_token_s: float | None = None  # generator: first tokens sampled
    first_step_s: float | None = None  # learner: step 1 done


@dataclass
class Result:
    mode: str
    generator: Startup
    learner: Startup
    steps_per_min: float
    wall_s: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """A local stack in a temporary folder (`scripts/stack.sh`): Docker pools or process pools."""

    def __init__(self, docker: bool) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="container-bench-"))
        self.dir = self.home / "stack"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "STREAMRL_STACK_DIR": str(self.dir),
            "STREAMRL_PREFECT_PORT": str(_free_port()),
            "STREAMRL_PREFECT_PROFILE": "",
            "PREFECT_HOME": str(self.home / "prefect-home"),
            "DOCKER": "1" if docker else "0",
            "S3": "1",
        }

    def __enter__(self) -> Stack:
        self._stack("up")
        host = (self.dir / "host").read_text()
        self.api = f"http://{host}:{self.env['STREAMRL_PREFECT_PORT']}/api"
        self.auth = (self.dir / "auth").read_text().strip()
        self.s3 = read_env_file(self.dir / "s3.env")
        return self

    def __exit__(self, *exc) -> None:
        self._stack("down")

    def _stack(self, action: str) -> None:
        done = subprocess.run(
            ["bash", "scripts/stack.sh", action], cwd=ROOT, env=self.env, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"stack.sh {action} failed:\n{done.stdout}\n{done.stderr}")

    def run(self, size: str, steps: int) -> tuple[Location, dict[str, datetime], float]:
        """One run to its end: its storage, each child's start, the wall time."""
        uri = f"s3://streamrl/runs/bench-{uuid.uuid4().hex[:8]}"
        overrides = ["placement.mode=pools", f"learner.total_steps={steps}"]
        started = time.monotonic()
        settings = {PREFECT_API_URL: self.api, PREFECT_API_AUTH_STRING: self.auth}
        with temporary_settings(settings), get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("streamrl/dapo")
            parent = client.create_flow_run_from_deployment(
                deployment.id,
                parameters={"size": size, "run_uri": uri, "generators": 1,
                            "overrides": overrides},
            ).id  # fmt: skip
            while not (state := client.read_flow_run(parent).state).is_final():
                time.sleep(2)
            if not state.is_completed():
                raise SystemExit(f"the run ended {state.type.value}: {state.message}")
            tasks = client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[parent]))
            )
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[t.id for t in tasks])
                )
            )
        wall_s = time.monotonic() - started
        starts = {}
        for child in children:  # the parent's: one learner, gen0
            name = child.name.rsplit("-", 1)[-1]
            container = _docker_started(child.id)
            starts[name] = container or child.start_time.astimezone(UTC)
        run = open_location(uri, storage_options=_options(self.s3))
        return run, starts, wall_s


def _options(s3: dict[str, str]) -> dict:
    return {
        "key": s3["AWS_ACCESS_KEY_ID"],
        "secret": s3["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": s3["AWS_ENDPOINT_URL"]},
    }


def _docker_started(flow_run_id) -> datetime | None:
    """When the flow run's container started (None: no container, a process pool)."""
    found = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=io.prefect.flow-run-id={flow_run_id}"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    if not found:
        return None
    stamp = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.StartedAt}}", found[0]],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    return datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00")


def _lines(run: Location, component: str) -> list[tuple[datetime, str]]:
    """streamrl's own lines of the component's copied log: (UTC time, message)."""
    found = []
    for path in run.fs.glob(run.join("logs", "*", f"{component}.log")):
        for line in run.fs.cat_file(path).decode().splitlines():
            if own := _OWN.match(line):
                stamp = datetime.strptime(own[1], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC)
                found.append((stamp, own[2]))
    return sorted(found)


def _since(start: datetime, lines, pattern: str) -> float | None:
    for stamp, message in lines:
        if re.search(pattern, message):
            return (stamp - start).total_seconds()
    return None


def measure(mode: str, stack: Stack, size: str, steps: int) -> Result:
    run, starts, wall_s = stack.run(size, steps)
    generator_lines = _lines(run, "gen0")
    learner_lines = _lines(run, "learner")
    generator = Startup(
        ready_s=_since(starts["gen0"], generator_lines, r"^generator gen0: start \d+"),
        first_token_s=_since(starts["gen0"], generator_lines, r"first tokens sampled"),
    )
    loaded = next((m for _, m in generator_lines if "(loaded in " in m), "")
    if found := re.search(r"\(loaded in ([\d.]+)s\)", loaded):
        generator.weights_s = float(found[1])
    learner = Startup(first_step_s=_since(starts["learner"], learner_lines, r"^step 1/"))
    times = {record["step"]: record["time"] for record in read_metrics(run)}
    rate = (steps - 2) / (times[steps] - times[2]) * 60 if steps > 2 else float("nan")
    return Result(mode, generator, learner, rate, wall_s)


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="smollm2-cpu", help="size preset (default smollm2-cpu)")
    parser.add_argument("--steps", type=int, default=10, help="learner steps per run (default 10)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("run it as root: Docker, and dropping the page cache for the cold start")
    subprocess.run(["bash", "scripts/image.sh"], cwd=ROOT, check=True)

    results = []
    with Stack(docker=False) as stack:
        results.append(measure("process", stack, args.size, args.steps))
    with Stack(docker=True) as stack:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        results.append(measure("docker, cold", stack, args.size, args.steps))
        results.append(measure("docker, warm", stack, args.size, args.steps))

    print(f"\n{args.size}, {args.steps} steps, one generator, one learner node, run on S3")
    print(
        f"{'pools':<14} {'gen: ready':>11} {'(weights)':>10} {'gen: 1st token':>15} "
        f"{'learner: step 1':>16} {'steps/min':>10} {'vs process':>11} {'run':>7}"
    )
    base = results[0].steps_per_min
    for r in results:
        print(
            f"{r.mode:<14} {_fmt(r.generator.ready_s):>11} {_fmt(r.generator.weights_s):>10} "
            f"{_fmt(r.generator.first_token_s):>15} {_fmt(r.learner.first_step_s):>16} "
            f"{r.steps_per_min:>10.2f} {r.steps_per_min / base:>10.2f}x {r.wall_s:>6.0f}s"
        )
    print(
        "(seconds from the component's start: its container's, or its flow run's on a process pool)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
