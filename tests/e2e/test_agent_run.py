"""`streamrl run` of the calculator task as an OpenAI-client agent
(`streamrl.envs.calculator_agent:solve`): the agent's episodes reach the learner, which trains
a few steps on them."""

from __future__ import annotations

import contextlib
import json
import math

import pytest

from storage.fs import open_location
from storage.stream.reader import StreamTimeoutError
from storage.stream.writer import StreamReader
from tests.e2e.test_run_cli import _run

AGENT = [
    "generator.env.agent=streamrl.envs.calculator_agent:solve",
    "generator.env.workers=4",
    "generator.env.max_turns=3",
    "model.max_model_len=1024",
    "generator.max_tokens=16",
    "generator.group_size=2",
    "generator.prompts_in_flight=2",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "algorithm.dynamic_sampling=false",
    "learner.total_steps=3",
]


@pytest.mark.timeout(900)
def test_the_calculator_agent_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    done = _run(f"storage.run_uri={run_dir}", *AGENT)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    metrics = [
        json.loads(line)
        for line in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    groups = []
    with contextlib.suppress(StreamTimeoutError):  # read to the end of what was written
        groups.extend(StreamReader(open_location(str(run_dir))).groups(timeout_s=3))
    assert len(groups) >= 6  # the learner consumed 3 steps × 2 groups
    for group in groups:
        group.validate()
        assert len(group.prompt_tokens) > 300  # the calculator's tools, described
    for m in metrics:  # each step trained on the agent's episodes
        losses = [v for k, v in m.items() if k.endswith("loss") and isinstance(v, float)]
        assert losses
        assert all(math.isfinite(v) for v in losses)
        assert m["rollout/response_len_mean"] > 0
        assert m["rollout/tools_offered_frac"] == 1.0  # the agent offered its tool
