"""A run across containers: the local stack with Docker work pools (`make up DOCKER=1`: the
`learner` and `generators` pools run each flow run as a container of the `streamrl:cpu` image,
on an internal network where only the Prefect API and SeaweedFS, on the host, are reachable).

One `streamrl/dapo` deployment run with `placement.mode=pools` on S3 — a learner of two nodes
and two generators, each in a container of its own — goes through what a cluster does to it:

- a generator's container is killed (`docker kill`, a spot preemption): the parent starts a
  new flow run with its index, in a new container;
- another generator is cut off the network for 30 s (`docker network disconnect`) and rejoins
  with a new address (another container took its old one): its connections to the old one are
  dead; it either goes on (S3 requests time out and retry on new connections) or, stuck, stops
  beating its heartbeat and is ended — by its flow run's own supervisor, or cancelled by the
  parent — and replaced (`placement.liveness_timeout_s`);
- `streamrl scale` asks for a third generator: a third container starts;
- a learner node's container is killed mid-step: the attempt fails, a new attempt (two new
  containers) resumes from the last committed checkpoint.

The run completes; its commit log holds every committed group exactly once (gap-free, nothing
quarantined, no group twice, the cut-off generator's groups from before and after the cut); the
versions and checkpoints are all there; and the final weights equal, bit for bit, those of a
learner replaying the run's stream alone: the faults changed when things happened, not what was
trained. Needs Docker (root) and the image: the fixture runs `scripts/image.sh` (cached).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from uuid import UUID

import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from storage.checkpoints.dcp import CheckpointStore
from storage.control.manifest import create_run
from storage.fs import Location, open_location
from storage.seaweedfs import read_env_file
from storage.stream.learner_progress import read_learner_progress
from storage.weights.versions import WeightStore
from streamrl.config.run import RunConfig
from streamrl.config.stored import load_run_config
from streamrl.learner.metrics_records import read_metrics
from streamrl.supervision.launch import learner_command
from tests.e2e.test_pools import _children, _named, _state, _wait_for, free_port, stack_sh
from tests.e2e.test_storage_outage import committed_groups

ROOT = Path(__file__).resolve().parents[2]
NETWORK = "streamrl"  # deploy/docker/pool.json
# Steps long enough (48 sampled tokens, 4 groups a step: ~3 s with two generators) that the
# faults below, about two minutes of them, all fall inside the run.
STEPS = 80
CHECKPOINT_EVERY = 4
TINY = [
    "placement.mode=pools",
    "learner.nnodes=2",
    "generator.max_tokens=48",
    "generator.segment_groups=2",
    "learner.batch_groups=4",
    "learner.mini_batch_groups=4",
    f"learner.checkpoint_every={CHECKPOINT_EVERY}",
    "algorithm.dynamic_sampling=false",  # the random tiny model's groups are mostly all-wrong
    f"learner.total_steps={STEPS}",
    "placement.liveness_timeout_s=60",  # a generator stuck after the cut is replaced in time
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def _docker(*args: str, check: bool = True) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert not check or done.returncode == 0, f"docker {shlex.join(args)}: {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def docker_stack(tmp_path_factory):
    """The image (built when missing) and the stack with Docker pools; yields the env of a
    client of it (Prefect API, S3 keys) and the stack's folder (`STREAMRL_STACK_DIR`)."""
    image = subprocess.run(
        ["bash", "scripts/image.sh"], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    assert image.returncode == 0, f"scripts/image.sh:\n{image.stdout}\n{image.stderr}"
    home = tmp_path_factory.mktemp("docker-stack")
    stack_dir = home / "stack"
    env = {
        **os.environ,
        "DOCKER": "1",
        "STREAMRL_STACK_DIR": str(stack_dir),
        "STREAMRL_PREFECT_PORT": str(free_port()),
        "STREAMRL_PREFECT_PROFILE": "",
        "PREFECT_HOME": str(home / "prefect-home"),
    }
    for inherited in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE", "S3"):
        env.pop(inherited, None)

    try:
        stack_sh("up", env)
        gateway = (stack_dir / "gateway").read_text()  # the host on the containers' network
        assert gateway != "127.0.0.1"
        api = f"http://127.0.0.1:{env['STREAMRL_PREFECT_PORT']}/api"  # the server: host only
        auth = (stack_dir / "auth").read_text().strip()
        s3 = read_env_file(stack_dir / "s3.env")
        assert s3["AWS_ENDPOINT_URL"].startswith(f"http://{gateway}:")
        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            yield {**env, **s3, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth}
    finally:
        print(stack_sh("down", env))
    assert not _docker("ps", "-aq", "--filter", "label=io.prefect.worker-name=streamrl-learner")
    assert not _docker("network", "ls", "-q", "--filter", "name=^streamrl$")  # nothing left


def _storage_options(env: dict[str, str]) -> dict:
    return {
        "key": env["AWS_ACCESS_KEY_ID"],
        "secret": env["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"]},
    }


def _container(flow_run_id: UUID) -> str | None:
    """The running container of a flow run (the Docker worker labels it with the run's id)."""
    found = _docker("ps", "-q", "--filter", f"label=io.prefect.flow-run-id={flow_run_id}")
    return found.splitlines()[0] if found else None


def _running(parent: UUID, name: str, count: int = 1):
    """The newest flow run of `name` once `count` of them exist and the newest runs in a
    container; else None."""
    runs = _named(_children(parent), name)
    if len(runs) < count or not runs[-1].state.is_running():
        return None
    return runs[-1] if _container(runs[-1].id) else None


def _progress_step(run: Location) -> int:
    progress = read_learner_progress(run)
    return progress.step if progress else 0


def _still_running(run: Location, what: str) -> None:
    """The next fault needs the learner to have steps left; fail clearly if it outran the test."""
    assert _progress_step(run) < STEPS - 2 * CHECKPOINT_EVERY, f"the run nearly ended before {what}"


def _replay_offline(run: Location, folder: Path) -> Location:
    """A fresh local run holding `run`'s stream, trained by a learner alone: one node of two
    ranks (the same world size as the run's two nodes of one rank), each with as many threads
    as a node's rank had (each container saw every core of this machine; torchrun would give
    two ranks one thread each): a rank's bits depend on its threads, which split some of its
    sums differently."""
    replay = open_location(str(folder))
    fields = load_run_config(run).model_dump(mode="json")
    fields["storage"]["run_uri"] = str(folder)
    fields["learner"].update(nnodes=1, nproc_per_node=2)
    fields["placement"] = {"mode": "local"}
    config = RunConfig.model_validate(fields)
    create_run(replay, config.model_dump(mode="json"))
    run.fs.get(run.join("stream") + "/", str(folder / "stream"), recursive=True)
    learner = subprocess.run(
        learner_command(config), cwd=folder, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(os.cpu_count())},
    )  # fmt: skip
    assert learner.returncode == 0, learner.stderr[-3000:]
    return replay


def test_a_run_on_docker_pools_survives_preemption_a_partition_and_a_lost_learner(
    docker_stack, tmp_path
):
    uri = f"s3://streamrl/runs/docker-{uuid.uuid4().hex[:8]}"
    run = open_location(uri, storage_options=_storage_options(docker_stack))
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("streamrl/dapo")
        parent = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"size": "tiny-cpu", "run_uri": uri, "generators": 2, "overrides": TINY},
        ).id
    started = time.monotonic()

    # Every process of the run in a container of its own, each with its own host name.
    first = {
        name: _wait_for(f"{name} in a container", lambda n=name: _running(parent, n), 900)
        for name in ("gen0", "gen1", "node0", "node1")
    }
    containers = {name: _container(run.id) for name, run in first.items()}
    assert len(set(containers.values())) == 4
    hostnames = {_docker("inspect", "-f", "{{.Config.Hostname}}", c) for c in containers.values()}
    assert len(hostnames) == 4
    _wait_for("the learner's second step", lambda: _progress_step(run) >= 2, 900)
    print(f"first step after {time.monotonic() - started:.0f} s")

    # A spot preemption: gen0's container is killed; a new flow run of gen0 replaces it.
    _still_running(run, "gen0 was killed")
    _docker("kill", containers["gen0"])
    _wait_for("gen0's replacement", lambda: _running(parent, "gen0", count=2), 600)

    # A partition: gen1 off the network for 30 s, then back with a new address.
    _still_running(run, "gen1 was cut off")
    address = '{{(index .NetworkSettings.Networks "' + NETWORK + '").IPAddress}}'
    old_address = _docker("inspect", "-f", address, containers["gen1"])
    _docker("network", "disconnect", NETWORK, containers["gen1"])
    cut_at = time.time()
    squatter = _docker("run", "-d", "--rm", "--network", NETWORK, "--entrypoint", "sleep",
                       "streamrl:cpu", "600")  # fmt: skip
    time.sleep(30)
    _docker("network", "connect", NETWORK, containers["gen1"])
    rejoined_at = time.time()
    assert _docker("inspect", "-f", address, containers["gen1"]) != old_address

    # Scaling out: a third generator's flow run starts in a container of its own.
    scaled = subprocess.run(
        [sys.executable, "-m", "streamrl", "scale", uri, "--generators", "3"],
        capture_output=True, text=True, env=docker_stack, timeout=120,
    )  # fmt: skip
    assert scaled.returncode == 0, scaled.stderr
    _wait_for("gen2 in a container", lambda: _running(parent, "gen2"), 600)

    # A lost learner node mid-step: its attempt fails, a new one resumes from the checkpoint.
    _still_running(run, "a learner node was killed")
    step = _progress_step(run)
    _wait_for("a step in progress", lambda: _progress_step(run) > step, 600)
    _docker("kill", containers["node1"])
    killed_at_step = _progress_step(run)
    _wait_for("the learner's next attempt", lambda: _running(parent, "node1", count=2), 600)

    _wait_for("the run to end", lambda: _state(parent).is_final(), 1800)
    _docker("rm", "-f", squatter, check=False)
    print(f"run: {time.monotonic() - started:.0f} s")
    assert _state(parent).is_completed(), _state(parent)
    names = sorted(c.name.rsplit("-", 1)[-1] for c in _children(parent))
    gen1 = ["gen1"] if _state(first["gen1"].id).is_completed() else ["gen1", "gen1"]
    assert names == ["gen0", "gen0", *gen1, "gen2", "node0", "node0", "node1", "node1"], names
    assert _state(first["gen0"].id).is_crashed()
    if len(gen1) == 2:  # the cut-off generator was stuck: ended as hung, and replaced
        cut_off = _state(first["gen1"].id)  # by its own flow run's supervisor, or the parent
        assert cut_off.is_cancelled() or "hung (no heartbeat for" in cut_off.message, cut_off
    # Every call the flow runs made for themselves passed the API gate (deploy/docker/api_gate.py).
    gate_log = (Path(docker_stack["STREAMRL_STACK_DIR"]) / "gate.log").read_text()
    assert not [line for line in gate_log.splitlines() if "refused" in line or "dropped" in line]

    groups = committed_groups(run)
    writers = {group.generator_id for group in groups}
    assert writers == {"gen0", "gen1", "gen2"}
    gen1_times = [group.created_at for group in groups if group.generator_id == "gen1"]
    assert min(gen1_times) < cut_at  # its groups from before the cut
    assert max(gen1_times) > rejoined_at  # and from after it
    store = WeightStore(run)
    kept = store.versions()  # retention keeps the newest
    assert kept == list(range(STEPS - len(kept) + 1, STEPS + 1))
    committed = CheckpointStore(run).committed_steps()
    assert committed[-1] == STEPS
    assert all(s % CHECKPOINT_EVERY == 0 for s in committed[:-1]), committed
    assert killed_at_step < STEPS
    steps = [record["step"] for record in read_metrics(run)]
    assert steps[-1] == STEPS
    assert sorted(set(steps)) == list(range(1, STEPS + 1))  # every step trained, none skipped

    trained, _ = store.load(STEPS)
    replayed, _ = WeightStore(_replay_offline(run, tmp_path / "replay")).load(STEPS)
    assert trained.keys() == replayed.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, replayed[name]), name
