"""Everything a GPU machine's rare, short lease is for, in one command: the environment, the
`gpu` tests, the learner benchmark on the 0.5B shape, shared-prompt attention (SDPA against
FlexAttention), a publish from GPU memory, and one GPU shared by the learner and a generator's
stand-in (planned memory, the weight hand-off: `benchmarks.shared_gpu_bench`).
`scripts/gpu_check.sh` runs it after installing the wheels that machine lacks
(`scripts/device_wheels.sh`).

    scripts/gpu_check.sh                          # on the GPU machine; OUT=<dir> for the files
    scripts/gpu_check.sh --device cpu --dry-run   # here: every part on tiny shapes

Each part runs in a process of its own under its own time budget (`PARTS`; together 480 s, so
the whole, wheels included, ends within 8 minutes). A part that fails or runs out of time is
recorded as such and the next one starts. Every figure goes to `<out>/gpu_check.json` as soon as
its part ends (the file is rewritten whole after each part), and every part's output to
`<out>/gpu_check.log`; the terminal shows one line per part. `--dry-run` runs the same code
paths on tiny shapes (`tiny-qwen2`, a few short groups): the default test suite runs it on CPU
(tests/unit/benchmarks/test_gpu_check.py), so the script cannot rot between leases.

The JSON: `{"device", "dry_run", "started", "budget_s", "parts": {name: {"status": ok | failed |
timeout, "seconds", "budget_s", "command", "figures", "error"}}}`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.learner_measures import figures_json

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# The measurement: Qwen2.5-0.5B's shape, DAPO, G = 16, responses of 512–2048 tokens.
FULL = {
    "model": "qwen2.5-0.5b-shape",
    "shape": ["--group-size", "16", "--min-response-len", "512", "--max-response-len", "2048"],
    # Attention: a whole group in one row (16 × 2048 + a prompt at most), where FlexAttention
    # skips the blocks between responses that a dense mask computes and masks.
    "attention": ["--micro-batch-tokens", "40960"],
}
# Every code path, in seconds on a CPU.
DRY = {
    "model": "tiny-qwen2",
    "shape": [
        "--groups", "2", "--group-size", "2", "--prompt-len", "8", "12",
        "--min-response-len", "4", "--max-response-len", "8", "--repeats", "1",
    ],
    "attention": [],
}  # fmt: skip


@dataclass(frozen=True)
class Part:
    """One part: its command (given the options and the file its figures go to), its time
    budget, and how its figures are read back (default: the JSON file the command wrote)."""

    budget_s: int
    command: Callable[[argparse.Namespace, Path], list[str]]
    read: Callable[[Path], dict[str, Any]] = lambda path: json.loads(path.read_text())


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    return DRY if args.dry_run else FULL


def _env_command(args: argparse.Namespace, figures: Path) -> list[str]:
    return [PYTHON, "-m", "benchmarks.gpu_check", "--part", "env", "--device", args.device,
            "--model", _shape(args)["model"], "--figures", str(figures)]  # fmt: skip


def _tests_command(args: argparse.Namespace, figures: Path) -> list[str]:
    return [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
            f"--junitxml={figures}", "tests/gpu"]  # fmt: skip


def _read_junit(path: Path) -> dict[str, Any]:
    """pytest's JUnit XML: counts, and each failing test with its message's first line."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failing = {}
    for case in suite.iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                message = (found.get("message") or "").strip().splitlines()
                failing[f"{case.get('classname')}::{case.get('name')}"] = (
                    message[0][:300] if message else outcome
                )
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts | {"failing": failing}


def _learner_command(args: argparse.Namespace, figures: Path) -> list[str]:
    shape = _shape(args)
    return [PYTHON, "-m", "benchmarks.learner_bench", "--device", args.device,
            "--model", shape["model"], *shape["shape"], "--phases", "bare,today,new,learner",
            "--json", str(figures)]  # fmt: skip


def _attention_command(args: argparse.Namespace, figures: Path) -> list[str]:
    shape = _shape(args)
    return [PYTHON, "-m", "benchmarks.attention_bench", "--device", args.device,
            "--model", shape["model"], *shape["shape"], *shape["attention"],
            "--json", str(figures)]  # fmt: skip


def _publish_command(args: argparse.Namespace, figures: Path) -> list[str]:
    return [PYTHON, "-m", "benchmarks.gpu_check", "--part", "publish", "--device", args.device,
            "--model", _shape(args)["model"], "--figures", str(figures)]  # fmt: skip


def _shared_command(args: argparse.Namespace, figures: Path) -> list[str]:
    return [PYTHON, "-m", "benchmarks.shared_gpu_bench", "--device", args.device,
            *(["--dry-run"] if args.dry_run else []), "--json", str(figures)]  # fmt: skip


# In order; the budgets add up to 480 s (FlexAttention compiles its kernels on first use, in
# `tests` and in `attention`).
PARTS = {
    "env": Part(45, _env_command),
    "tests": Part(110, _tests_command, _read_junit),
    "learner": Part(130, _learner_command),
    "attention": Part(95, _attention_command),
    "publish": Part(40, _publish_command),
    "shared": Part(60, _shared_command),
}


# -- the parts run in-process by a child of the parent -------------------------------------


def environment(device: str, model: str) -> dict[str, Any]:
    """Versions, the device, and the model prepared in the cache (so later parts find it)."""
    import torch

    from streamrl.models import resolve_model_path

    versions = {}
    for package in ("torch", "transformers", "peft", "zarr", "pydantic", "numpy", "safetensors"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "versions": versions,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": props.name,
            "gpu_memory_GB": props.total_memory / 1e9,
            "capability": list(torch.cuda.get_device_capability(0)),
            "multiprocessors": props.multi_processor_count,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "bf16": torch.cuda.is_bf16_supported(),
        }
    started = time.perf_counter()
    resolve_model_path(model)
    out["model_prepare_s"] = time.perf_counter() - started
    return out


def publish_from_device(device: str, model: str) -> dict[str, Any]:
    """The learner's publish path from device memory: the policy (FSDP2, one rank) through
    `WeightPublisher` in bf16 — a full version, then a delta after a small change — into a
    local folder. Per version: seconds on the training path (`perf/weight_sync_s`: the
    shard's snapshot to host memory), then the upload's (serialise, checksum, write, commit;
    waited for at once here), the bytes stored."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from storage.fs import open_location
    from storage.weights.publish import WeightWriter
    from streamrl.learner.config import WeightsConfig
    from streamrl.learner.model import full_state_dict, load_policy, shard_model
    from streamrl.learner.publish import WeightPublisher
    from streamrl.learner.topology import Topology
    from streamrl.models.config import ModelConfig

    weights = WeightsConfig(full_every=4, background=True)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder, Topology.from_env(device) as topology:
        policy = load_policy(model, ModelConfig(path=model))
        shard_model(policy, topology, mixed_precision="fp32", activation_checkpointing=False)
        writer = WeightWriter(open_location(folder))
        store = writer.reader
        publisher = WeightPublisher(writer, topology, weights, torch.bfloat16)
        out["parameters"] = sum(p.numel() for p in policy.parameters())
        for version in (1, 2):
            if version == 2:  # a few elements moved: the delta's case
                state = full_state_dict(policy, topology)
                for tensor in state.values():
                    tensor.view(-1)[::1000] += 1e-2
                set_model_state_dict(policy, state, options=StateDictOptions(full_state_dict=True))
            synced = publisher.publish(policy, version)
            started = time.perf_counter()
            publisher.flush()  # the background upload, from the snapshot in host memory
            manifest = store.read_manifest(version)
            out[f"v{version}"] = {
                "sync_s": synced["perf/weight_sync_s"],
                "upload_s": time.perf_counter() - started,
                "stored_MB": manifest.stored_bytes / 1e6,
                "full": manifest.is_full,
            }
    return out


# -- the parent ----------------------------------------------------------------------------


def run_part(name: str, part: Part, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Run `part` under its budget (its process group killed at the end of it), its output
    into `log`; its status, seconds and figures."""
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / f"{name}.out"
        command = part.command(args, figures)
        log.write(f"\n==== {name} (budget {part.budget_s} s): {' '.join(command)}\n")
        log.flush()
        started = time.monotonic()
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=part.budget_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status, code = "timeout", None
        result: dict[str, Any] = {
            "status": status,
            "seconds": round(time.monotonic() - started, 1),
            "budget_s": part.budget_s,
            "command": command,
            "figures": None,
            "error": None,
        }
        if figures.exists():
            try:
                result["figures"] = part.read(figures)
            except (ValueError, ET.ParseError, OSError) as exc:
                result["error"] = f"its figures could not be read: {exc!r}"
        if status == "failed":
            result["error"] = f"exit code {code}; see gpu_check.log"
        if status == "ok" and result["figures"] is None:  # every part writes its figures
            result["status"] = "failed"
            result["error"] = result["error"] or "it exited 0 but wrote no figures"
        if status == "timeout":
            result["error"] = f"ran past its budget of {part.budget_s} s; see gpu_check.log"
    return result


def _headline(name: str, result: dict[str, Any]) -> str:
    """The part's one line on the terminal."""
    f = result["figures"] or {}
    line = f"{name:<10} {result['status']:<8} {result['seconds']:>6.1f} s"
    if name == "env" and f:
        line += f"  {f.get('gpu', 'cpu')}, torch {f['versions']['torch']}, cuda {f['cuda']}"
    elif name == "tests" and f:
        failed = f["failures"] + f["errors"]
        line += f"  {f['passed']} passed, {failed} failed, {f['skipped']} skipped"
    elif name == "learner" and "learner_over_bare" in f:
        mfu = f["phases"]["learner"]["best_mfu"]
        line += f"  learner/bare {f['learner_over_bare']:.3f}×" + (
            f", MFU {mfu:.1%}" if mfu is not None else ""
        )
    elif name == "attention" and f:
        line += f"  flex/sdpa {f['flex_over_sdpa']:.2f}×, exact {f['exact']}"
    elif name == "publish" and f:
        line += f"  full {f['v1']['sync_s']:.3g} s + upload {f['v1']['upload_s']:.3g} s"
    elif name == "shared" and f.get("handoff_s_per_version") is not None:
        line += (
            f"  hand-off {f['handoff_s_per_version']:.3g} s/version, storage "
            f"{f['storage_s_per_version']:.3g} s, exact {f['exact']}"
        )
    if result["error"]:
        line += f"  ({result['error']})"
    return line


def write_json(path: Path, report: dict[str, Any]) -> None:
    """`report` to `path` whole, replacing the previous file in one step."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(figures_json(report))
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.parts.split(",") if args.parts else list(PARTS)
    report: dict[str, Any] = {
        "device": args.device,
        "dry_run": args.dry_run,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": sum(PARTS[name].budget_s for name in names),
        "wheels_s": float(os.environ["GPU_CHECK_WHEELS_S"])
        if os.environ.get("GPU_CHECK_WHEELS_S")
        else None,
        "parts": {},
    }
    write_json(out / "gpu_check.json", report)
    with open(out / "gpu_check.log", "a") as log:
        for name in names:
            report["parts"][name] = run_part(name, PARTS[name], args, log)
            write_json(out / "gpu_check.json", report)
            print(_headline(name, report["parts"][name]), flush=True)
    return report


def _child(args: argparse.Namespace) -> None:
    parts = {"env": environment, "publish": publish_from_device}
    figures = parts[args.part](args.device, args.model)
    Path(args.figures).write_text(figures_json(figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--dry-run", action="store_true", help="every part on tiny shapes (tiny-qwen2)"
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or "build/gpu_check",
        help="folder for gpu_check.json and gpu_check.log (default $OUT, else build/gpu_check)",
    )  # fmt: skip
    parser.add_argument("--parts", help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    parser.add_argument("--part", choices=["env", "publish"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--figures", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        _child(args)
        return 0
    if args.parts and set(args.parts.split(",")) - set(PARTS):
        parser.error(f"--parts {args.parts}: of {', '.join(PARTS)}")
    report = run(args)
    return 0 if all(p["status"] == "ok" for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
