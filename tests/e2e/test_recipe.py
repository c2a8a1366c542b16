"""The `recipe` flow end to end on the tiny model, against a real (temporary) Prefect server: a
supervised warm start, then RL from its exported model, an evaluation and an export, each a
child flow run in its own folder; resumed, the finished stages are skipped; a stage that fails
fails the recipe with its reason and nothing after it runs."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.testing.utilities import prefect_test_harness
from safetensors.torch import load_file

from storage.fs import open_location
from storage.weights.versions import WeightStore
from streamrl.config.stored import load_run_config

pytestmark = pytest.mark.timeout(900)

RL = [
    "generator.max_tokens=16",
    "generator.segment_groups=2",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "algorithm.dynamic_sampling=false",
    "eval.every_versions=0",
]


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def _conversations(path, numbers) -> str:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"\\boxed{{{2 * i}}}"}]}
            for i in numbers]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _recipe(tmp_path, stages) -> str:
    path = tmp_path / "tiny-agent.yaml"
    path.write_text(yaml.safe_dump({"overrides": ["logging.wandb_mode=disabled"],
                                    "stages": stages}))  # fmt: skip
    return str(path)


def _children(flow_run_id) -> list:
    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
                )
            )

    return asyncio.run(read())


def test_a_recipe_runs_its_stages_in_order_and_resumes_past_the_finished_ones(
    prefect_server, tmp_path
):
    from flows.recipe import recipe

    train = _conversations(tmp_path / "train.jsonl", range(8))
    recipe_file = _recipe(tmp_path, [
        {"name": "warm", "presets": ["tiny-cpu", "sft"],
         "overrides": [f"data.path={train}", "data.val_path=null", "learner.total_steps=2",
                       "learner.batch_groups=4", "learner.mini_batch_groups=4",
                       "learner.warmup_steps=0", "learner.lr=1e-3"]},
        {"name": "rl", "presets": ["dapo", "tiny-cpu"],
         "overrides": [*RL, "learner.total_steps=2"]},
        {"name": "score", "kind": "eval", "of": "rl", "max_prompts": 4, "k": 1},
        {"name": "model", "kind": "export", "of": "rl"},
    ])  # fmt: skip
    root = tmp_path / "recipe"
    state = recipe(name=recipe_file, root=str(root), return_state=True)
    assert state.is_completed(), state
    results = state.result()
    assert [results[s]["state"] for s in ("warm", "rl", "score", "model")] == ["finished"] * 4
    # Each stage a child flow run, named after the recipe and the stage.
    children = _children(state.state_details.flow_run_id)
    assert sorted(c.name for c in children) == [
        "tiny-agent-model",
        "tiny-agent-rl",
        "tiny-agent-score",
        "tiny-agent-warm",
    ]
    # The RL stage started from the warm start's last version, exported.
    warm = open_location(str(root / "warm"))
    assert load_run_config(open_location(str(root / "rl"))).model.path == str(root / "models/warm")
    published, _ = WeightStore(warm).load(2)
    exported = load_file(root / "models" / "warm" / "model.safetensors")
    name = next(n for n in exported if n.endswith("q_proj.weight"))
    assert published[name].equal(exported[name])
    assert json.loads((root / "score" / "eval.json").read_text())["version"] == 2
    assert (root / "model" / "config.json").exists()

    # Resumed: the finished stages are skipped; the missing export is made again.
    steps = (root / "rl" / "metrics" / "learner.jsonl").read_text()
    for item in (root / "model").iterdir():
        item.unlink()
    (root / "model").rmdir()
    again = recipe(name=recipe_file, root=str(root), resume=True)
    assert [again[s]["state"] for s in ("warm", "rl", "score")] == ["skipped (finished before)"] * 3
    assert again["model"]["state"] == "finished"
    assert (root / "rl" / "metrics" / "learner.jsonl").read_text() == steps  # not trained again
    with pytest.raises(ValueError, match="already has stages"):
        recipe(name=recipe_file, root=str(root))


def test_a_failed_stage_fails_the_recipe_with_its_reason_and_nothing_after_it_runs(
    prefect_server, tmp_path
):
    from flows.recipe import recipe

    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    recipe_file = _recipe(tmp_path, [
        {"name": "warm", "presets": ["tiny-cpu", "sft"],
         "overrides": [f"data.path={broken}", "data.val_path=null", "learner.total_steps=2",
                       "learner.warmup_steps=0"]},
        {"name": "rl", "presets": ["dapo", "tiny-cpu"], "overrides": RL},
    ])  # fmt: skip
    root = tmp_path / "recipe"
    state = recipe(name=recipe_file, root=str(root), return_state=True)
    assert state.is_failed()
    reason = r"learner cannot run \(exit code 4\); not restarted"
    with pytest.raises(Exception, match=reason) as failed:
        state.result()
    assert "row 0 (0-based) of" in str(failed.value)
    assert "the conversation has no assistant message" in str(failed.value)
    assert not (root / "rl").exists()
