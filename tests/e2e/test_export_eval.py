"""Export and evaluation of published versions on the tiny model, fp32, with a real vLLM engine.

Versions are published straight to the weight store (no learner): the tiny model's full state
dict (tied lm_head under both names, as the learner publishes it) with random perturbations
chosen so that greedy decoding differs across prompts and no greedy step is a near tie.
One vLLM engine, built from an exported directory, serves the module; the evaluator then loads
published versions into it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from storage.control.manifest import create_run
from storage.control.requests import request_stop
from storage.fs import Location, StorageError, open_location
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightStore, WeightVersionNotFoundError
from streamrl.cli.evaluate import add_commands
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.data import PromptSource
from streamrl.evaluation.evaluator import (
    EvaluationLoop,
    Evaluator,
    evaluate,
    evaluation_sampling,
    validation_dataset,
)
from streamrl.evaluation.records import read_eval_records
from streamrl.generator.engine import Engine
from streamrl.models import resolve_model_path
from streamrl.runs.export import OutputExistsError, export_version

MAX_TOKENS = 16
# (seed, scale) of each version's perturbation. v2 (the latest, exported): greedy outputs of
# several kinds, no greedy step with a top-2 logit gap under 0.02, so vLLM and transformers pick
# the same tokens. v1: every greedy step wins by a logit gap over 0.25, so sampling at
# temperature 0.01 (vLLM's floor) picks the greedy token too (odds of another below e^-25).
PERTURBATIONS = {1: (2, 2.0), 2: (11, 2.0)}


def longer_than_answer(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """A reward the perturbed random model earns on some prompts and not on others: 1 when the
    response has more characters than the (integer) answer's value."""
    return float(len(response) > int(ground_truth))


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    run_dir = tmp_path_factory.mktemp("export-eval") / "run"
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"generator.max_tokens={MAX_TOKENS}",
            "generator.reward.fn=tests.e2e.test_export_eval:longer_than_answer",
            "eval.k=2",
            "eval.max_prompts=8",
            # Samples of v1 are its greedy responses (see PERTURBATIONS): avg@k is then known.
            "eval.temperature=0.01",
        ],
    )


def _perturbed(base: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in base.items():
        if name == "lm_head.weight":  # tied: the embedding's (perturbed) values
            continue
        noise = torch.randn(tensor.shape, generator=generator)
        state[name] = tensor + scale * tensor.std() * noise
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


@pytest.fixture(scope="module")
def base_state() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen2"))
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    assert "lm_head.weight" in state  # tied, yet in the state dict as the learner publishes it
    return state


def _new_run(config: RunConfig, path: Path) -> Location:
    run = open_location(str(path))
    create_run(run, config.model_dump(mode="json"))
    return run


@pytest.fixture(scope="module")
def run(config: RunConfig, base_state) -> Location:
    location = _new_run(config, Path(config.storage.run_uri))
    store = WeightWriter(location)
    for version, (seed, scale) in PERTURBATIONS.items():
        store.publish(version, _perturbed(base_state, seed, scale))
    return location


@pytest.fixture(scope="module")
def published(run: Location) -> dict[int, dict[str, torch.Tensor]]:
    store = WeightStore(run)
    return {version: store.load(version)[0] for version in store.versions()}


@pytest.fixture(scope="module")
def exported(run: Location, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_version(run, tmp_path_factory.mktemp("exports") / "latest")


@pytest.fixture(scope="module")
def engine(config: RunConfig, exported: Path) -> Iterator[Engine]:
    with Engine(str(exported), config.model, evaluation_sampling(config), seed=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def evaluator(config: RunConfig, run: Location, engine: Engine):
    with Evaluator(run, config, engine=engine) as evaluator:
        yield evaluator


@pytest.fixture(scope="module")
def vllm_greedy_on_export(engine: Engine, evaluator: Evaluator) -> list[list[int]]:
    """Greedy tokens of the engine as built from the export, before any weights are loaded."""
    groups = engine.generate([p.token_ids for p in evaluator.prompts], greedy=True)
    return [g.completions[0].token_ids.tolist() for g in groups]


def _hf_model(path: Path, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


# -- export ------------------------------------------------------------------------------------


def test_export_is_a_hugging_face_directory_of_the_latest_version(exported: Path, published):
    from transformers import AutoTokenizer

    files = set(os.listdir(exported))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= files
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= files
    assert not [f for f in os.listdir(exported.parent) if f.startswith(".")]  # no temp dirs
    model = _hf_model(exported)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    loaded = model.state_dict()
    assert set(loaded) == set(published[2])
    for name, tensor in published[2].items():
        assert torch.equal(loaded[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(exported)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_vllm_greedy_on_the_export_equals_transformers_greedy(
    exported: Path, evaluator: Evaluator, vllm_greedy_on_export
):
    prompts = [p.token_ids for p in evaluator.prompts]
    expected = _hf_greedy(_hf_model(exported), prompts)
    assert vllm_greedy_on_export == expected
    assert len({tuple(t) for t in expected}) > 1  # the prompts are not all answered alike


def test_sharded_export_with_a_dtype_loads_the_chosen_version(run: Location, published, tmp_path):
    out = export_version(run, tmp_path / "v1", 1, dtype="bfloat16", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: the embedding serves
    model = _hf_model(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, published[1][name].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_unknown_version_lists_the_available_ones(run: Location, published, tmp_path):
    with pytest.raises(WeightVersionNotFoundError, match=r"available versions: \[1, 2\]"):
        export_version(run, tmp_path / "out", 7)
    assert not (tmp_path / "out").exists()
    with pytest.raises(WeightVersionNotFoundError, match=r"available versions: \[1, 2\]"):
        evaluate(run, 7)  # before any engine starts


def test_non_empty_out_dir_is_refused_and_left_untouched(run: Location, published, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="overwrite"):
        export_version(run, out)
    assert os.listdir(out) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert os.listdir(tmp_path) == ["out"]
    export_version(run, out, overwrite=True)
    assert "notes.txt" not in os.listdir(out)
    assert "model.safetensors" in os.listdir(out)
    assert os.listdir(tmp_path) == ["out"]


def test_run_without_weights_is_refused(config: RunConfig, tmp_path):
    empty = _new_run(config, tmp_path / "run")
    with pytest.raises(WeightVersionNotFoundError, match="no published weights"):
        export_version(empty, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="streamrl")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_export_and_bad_run_uris(run: Location, published, tmp_path, capsys):
    assert _cli("export", run.uri, "--version", "1", "--out", str(tmp_path / "v1")) == 0
    assert "exported to" in capsys.readouterr().out
    assert _cli("export", run.uri, "--out", str(tmp_path / "v1")) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(StorageError, match="no streamrl run"):
        _cli("export", str(tmp_path / "typo"), "--out", str(tmp_path / "x"))
    assert not (tmp_path / "typo").exists()
    with pytest.raises(StorageError, match="cannot open run URI"):
        _cli("export", "nosuchprotocol://bucket/run", "--out", str(tmp_path / "x"))


# -- evaluation ---------------------------------------------------------------------------------


def _expected_accuracy(
    exported: Path, state: dict[str, torch.Tensor], prompts: list
) -> tuple[float, list[list[int]]]:
    """Greedy accuracy by transformers, scored in this process; and the greedy tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported)
    greedy = _hf_greedy(_hf_model(exported, state), [p.token_ids for p in prompts])
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in greedy]
    scores = [longer_than_answer(t, p.ground_truth) for t, p in zip(texts, prompts, strict=True)]
    return sum(s >= 1 for s in scores) / len(prompts), greedy


@pytest.mark.parametrize("version", [1, 2])
def test_eval_reports_the_accuracy_transformers_gives(
    evaluator: Evaluator, exported: Path, published, vllm_greedy_on_export, version: int
):
    metrics = evaluator.evaluate(version)
    expected, greedy = _expected_accuracy(exported, published[version], evaluator.prompts)
    assert 0 < expected < 1  # a test that can fail both ways
    assert metrics["version"] == version
    assert metrics["val/num_prompts"] == len(evaluator.prompts) == 8
    assert metrics["val/acc_greedy"] == expected
    assert 0 < metrics["val/response_len_mean"] <= MAX_TOKENS
    assert metrics["val/pass@1"] == metrics["val/avg@2"]
    if version == 1:  # its samples are its greedy responses: both right, or both wrong
        assert metrics["val/avg@2"] == metrics["val/pass@2"] == expected
        assert metrics["val/response_len_mean"] == sum(map(len, greedy)) / len(greedy)
    else:  # a mean over k × prompts samples; pass@2: prompts with a right one
        assert metrics["val/avg@2"] * 2 * 8 == round(metrics["val/avg@2"] * 2 * 8)
        assert metrics["val/avg@2"] <= metrics["val/pass@2"] <= 2 * metrics["val/avg@2"]
        assert metrics["val/pass@2"] * 8 == round(metrics["val/pass@2"] * 8)


@pytest.mark.slow  # a vLLM engine of its own (~25 s); benchmarks/learning_study.py uses the path
def test_version_0_is_the_initial_weights(run: Location, config: RunConfig, base_state):
    """`streamrl eval --version 0` measures model.path itself, though the store holds no
    version 0. (A fresh interpreter: a second in-process vLLM engine would tear down the
    process groups the module's engine runs on.)"""
    before = read_eval_records(run)
    argv = [sys.executable, "-m", "streamrl", "eval", "--run", run.uri, "--version", "0"]
    done = subprocess.run([*argv, "--no-record"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout[done.stdout.rindex("{\n") :])  # after any log lines
    dataset, held_out = validation_dataset(config)
    source = PromptSource(dataset, tokenizer_path=resolve_model_path("tiny-qwen2"))
    prompts = source.prompts[: config.eval.max_prompts]
    expected, _ = _expected_accuracy(Path(resolve_model_path("tiny-qwen2")), base_state, prompts)
    assert held_out
    assert 0 < expected < 1
    assert metrics["version"] == 0
    assert metrics["val/acc_greedy"] == expected
    assert read_eval_records(run) == before  # --no-record


@pytest.mark.usefixtures("vllm_greedy_on_export")  # taken before this loads other weights
def test_follow_evaluates_every_eth_and_the_last_version_then_resumes(
    config: RunConfig, engine: Engine, base_state, tmp_path
):
    run = _new_run(config, tmp_path / "run")
    store = WeightWriter(run)
    for version in range(1, 6):
        store.publish(version, _perturbed(base_state, version, 1.0))
    store.retain(3)  # v1, v2 are gone: v2 was due and is reported missed
    stop = threading.Event()
    with Evaluator(run, config, engine=engine) as evaluator:
        loop = EvaluationLoop(evaluator, every_versions=2, poll_s=0.05)
        results: list[list[dict]] = []
        thread = threading.Thread(target=lambda: results.append(loop.run(stop)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not read_eval_records(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # v5 is not due before the run stops
        assert [r["version"] for r in read_eval_records(run)] == [4]
        request_stop(run, "test")
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert [r["version"] for r in results[0]] == [4, 5]
        assert loop.missed == [2]
        records = read_eval_records(run)
        assert [r["version"] for r in records] == [4, 5]
        assert {r["held_out"] for r in records} == {True}  # tiny-cpu's data.val_path
        assert {r["dataset"] for r in records} == {"builtin:arithmetic-test"}
        assert all(0 <= r["val/acc_greedy"] <= 1 and r["k"] == 2 for r in records)
        # A restarted evaluator finds everything done and returns at once.
        again = EvaluationLoop(evaluator, every_versions=2, poll_s=0.05)
        assert again.run(threading.Event()) == []
    assert read_eval_records(run) == records


# Last in the module: a second vLLM engine built in this process stalls the module's shared
# engine for the tests after it (seen with the follow test), so nothing follows this one.
def test_an_agents_answers_are_episodes_scored_by_its_environment(config: RunConfig, run):
    """With an environment the evaluator runs episodes, as the generators do: the model takes
    turns until the environment is done, and the metrics say how many it took. KeepTalking
    answers twice with "go on", then scores a non-empty last turn; the initial tiny model
    writes newlines, so with a newline ending a turn every episode takes 3 empty turns."""
    agent = config.model_copy(
        update={"generator": config.generator.model_copy(update={
            "stop": ["\n"],
            "env": config.generator.env.model_copy(update={
                "fn": "tests.env_fns:KeepTalking", "max_episode_tokens": 256, "workers": 1}),
        })}
    )  # fmt: skip
    with Evaluator(run, agent) as evaluator:  # a fresh engine: the initial weights, version 0
        metrics = evaluator.evaluate(0)
        finished = evaluator._runner.stats.finished
    assert metrics["val/num_prompts"] == 8
    assert metrics["val/turns_mean"] == 3.0  # every episode went on to the environment's end
    assert finished == {"done": 8 * 3}  # greedy and k = 2 samples of each prompt
    assert metrics["val/tool_calls_mean"] == metrics["val/tool_errors_mean"] == 0
    assert metrics["val/tool_use_frac"] == 0.0  # no episode called a tool
    assert metrics["val/acc_greedy"] == metrics["val/avg@2"] == 0.0  # empty last turns
