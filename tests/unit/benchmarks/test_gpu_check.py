"""The GPU machine's script (`scripts/gpu_check.sh`, `benchmarks.gpu_check`), dry-run on CPU so
that it cannot rot between the rare times a GPU is lent: every part's code path runs on tiny
shapes and its figures land in the JSON; a part that fails or outruns its budget is recorded
and the others' figures stay."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import PARTS, Part, run_part

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(900)
def test_the_dry_run_runs_every_part_and_writes_every_figure(tmp_path):
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == len(PARTS)  # one line per part
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    assert list(report["parts"]) == list(PARTS)
    assert report["budget_s"] == sum(p.budget_s for p in PARTS.values()) <= 480  # 8 minutes
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part)
        assert part["seconds"] <= part["budget_s"]
    env = report["parts"]["env"]["figures"]
    assert env["versions"]["torch"]
    assert env["cuda_available"] is False
    tests = report["parts"]["tests"]["figures"]
    assert tests["tests"] >= 7  # every gpu test collected ...
    assert tests["skipped"] == tests["tests"]  # ... and skipped for want of CUDA
    learner = report["parts"]["learner"]["figures"]
    assert set(learner["phases"]) == {"bare", "today", "new", "learner"}
    assert learner["learner_over_bare"] > 0
    assert learner["publish_learner"]["weights_MB"] > 0
    attention = report["parts"]["attention"]["figures"]
    assert attention["exact"] is True  # fp32 on CPU: FlexAttention equals SDPA to rounding
    assert attention["sdpa"]["tokens_per_s"] > 0
    assert attention["flex_attention"]["tokens_per_s"] > 0
    publish = report["parts"]["publish"]["figures"]
    assert publish["v1"]["full"] is True
    assert publish["v2"]["full"] is False  # a delta ...
    assert 0 < publish["v2"]["stored_MB"] < publish["v1"]["stored_MB"]  # ... smaller
    shared = report["parts"]["shared"]["figures"]
    assert shared["plan"]["handoff"] is True
    assert [x["version"] for x in shared["engine"]["loads"]] == [1, 2, 3]  # every version ...
    assert all(x["intact"] and x["exact"] for x in shared["engine"]["loads"])  # ... handed whole
    assert shared["handoff_s_per_version"] > 0
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"==== {name} (budget" in log for name in PARTS)


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(device="cpu", dry_run=True, out=str(tmp_path), parts=None)


def test_a_part_past_its_budget_is_killed_with_its_children_and_recorded(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time, pathlib;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid));"
        "time.sleep(60)"
    )
    part = Part(2, lambda args, figures: [sys.executable, "-c", script])
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        result = run_part("slow", part, _args(tmp_path), log)
    assert time.monotonic() - started < 10
    assert result["status"] == "timeout"
    assert "budget of 2 s" in result["error"]
    grandchild = Path(f"/proc/{pid_file.read_text()}/status")
    time.sleep(0.5)
    # The part's whole process group went with it (gone, or a zombie nobody reaped yet).
    assert not grandchild.exists() or "\nState:\tZ" in grandchild.read_text()


def test_a_failed_part_is_recorded_and_the_next_part_still_runs(tmp_path, monkeypatch, capsys):
    def writes(figures_text: str, code: int) -> Part:
        script = f"import pathlib, sys; pathlib.Path(sys.argv[1]).write_text({figures_text!r}); sys.exit({code})"  # noqa: E501
        return Part(30, lambda args, figures: [sys.executable, "-c", script, str(figures)])

    monkeypatch.setattr(
        gpu_check,
        "PARTS",
        {"env": writes("{oops", 1), "publish": writes('{"v1": {"sync_s": 1, "upload_s": 2}}', 0)},
    )
    report = gpu_check.run(_args(tmp_path))
    assert report["parts"]["env"]["status"] == "failed"
    assert "exit code 1" in report["parts"]["env"]["error"]
    assert report["parts"]["publish"]["status"] == "ok"
    stored = json.loads((tmp_path / "gpu_check.json").read_text())
    assert stored["parts"]["publish"]["figures"] == {"v1": {"sync_s": 1, "upload_s": 2}}
    assert stored["parts"]["env"]["figures"] is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["env", "failed"]
    assert lines[1].split()[:2] == ["publish", "ok"]


def test_a_part_that_exits_zero_without_its_figures_is_a_failure(tmp_path):
    silent = Part(30, lambda args, figures: [sys.executable, "-c", "pass"])
    with open(tmp_path / "log", "w") as log:
        result = run_part("tests", silent, _args(tmp_path), log)
    assert result["status"] == "failed"
    assert "wrote no figures" in result["error"]
