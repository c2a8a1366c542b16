"""`streamrl samples` on a real stream: groups written as generators write them (a single-turn
group, one without signal, a tool episode with a tool call that works and one that fails),
consumed by the learner's own batch collector at three steps and logged by its own reporter
(wandb offline, with its samples table). Checked: decoding (turns by loss mask, tool calls and
results, versions per turn), what the learner did with each group (step, version, staleness,
trained or why not), every filter, the newest-first selection, the JSON lines, the bounds of the
terminal text, the wandb table's rows and the flow's samples artifact."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from flows.artifacts import RunArtifacts
from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.reader import StreamReader
from storage.stream.records import ScoredGroup
from storage.stream.writer import StreamWriter
from streamrl.cli.main import main
from streamrl.config.loading import load_config
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.formats import TaggedFormat
from streamrl.envs.tools import ToolResult
from streamrl.learner.batching import BatchCollector
from streamrl.learner.reporting import MetricsReporter
from streamrl.learner.sample_table import SAMPLE_MAX_CHARS, TABLE_COLUMNS, SampleTable
from streamrl.learner.samples import SampleDecoder, ToolCallText, ToolResultText
from streamrl.runs.samples import ConsumedGroups, SampleFilter, SamplesError, read_samples
from streamrl.runs.samples_format import format_sample, samples_markdown

pytestmark = pytest.mark.timeout(300)

EOT = "<|im_end|>"
QUESTION = "What is 2 + 3? Answer with the number."
LONG = "Let me think. " * 40  # a truncated response, longer than the bounds below


def _prompt(tokenizer, text: str, system: str | None = None) -> np.ndarray:
    messages = [{"role": "system", "content": system}] if system else []
    ids = ChatRenderer(tokenizer).prompt_ids([*messages, {"role": "user", "content": text}])
    return np.asarray(ids, np.int32)


def _single(tokenizer, prompt_id, texts, raw, version, *, truncated=None) -> ScoredGroup:
    """A single-turn group: rule reward 2·raw − 1."""
    tokens = [np.asarray(tokenizer.encode(t, add_special_tokens=False), np.int32) for t in texts]
    raw = np.asarray(raw, np.float32)
    truncated = np.zeros(len(texts), bool) if truncated is None else np.asarray(truncated)
    return ScoredGroup(
        prompt_id=prompt_id,
        prompt_tokens=_prompt(tokenizer, QUESTION),
        ground_truth="5",
        response_tokens=tokens,
        behaviour_logprobs=[np.full(len(t), -0.5, np.float32) for t in tokens],
        rewards=2 * raw - 1,
        raw_scores=raw,
        truncated=truncated,
        finish_reasons=["max_tokens" if t else "done" for t in truncated],
        policy_version=version,
        generator_id="gen0",
        created_at=time.time() - 1,
        finished_at=time.time(),
    ).validate()


def _episode(tokenizer, turns: list[tuple[str, str | None, int]]):
    """One tool episode's arrays: each (model text, the tool's answer or None, version)."""
    renderer, fmt = ChatRenderer(tokenizer), TaggedFormat()
    parts = []
    for text, answer, version in turns:
        ids = tokenizer.encode(text + EOT, add_special_tokens=False)
        parts.append((ids, np.full(len(ids), -0.5), np.ones(len(ids)), np.full(len(ids), version)))
        if answer is not None:
            ok = not answer.startswith("Error:")
            observation = fmt.observe([ToolResult("calculate", answer, ok)])
            env = renderer.observation_ids(observation, ended_with_eos=True)
            parts.append((env, np.zeros(len(env)), np.zeros(len(env)), np.full(len(env), version)))
    kinds = (np.int32, np.float32, np.uint8, np.int64)
    return [
        np.concatenate([np.asarray(p[k]) for p in parts]).astype(d) for k, d in enumerate(kinds)
    ]


def _tool_group(tokenizer, version: int) -> ScoredGroup:
    """Two episodes of a calculator environment: the first calls the tool, reads 5 and
    answers; the second calls a tool that is not there and gives up."""
    good = _episode(tokenizer, [('<tool>calculate(expression="2 + 3")</tool>', "5", version),
                                ("The answer is 5.", None, version + 1)])  # fmt: skip
    bad = _episode(tokenizer, [("<tool>divide(a=1)</tool>",
                                "Error: unknown tool 'divide'; the tools are: calculate", version),
                               ("I cannot tell.", None, version + 1)])  # fmt: skip
    episodes = [good, bad]
    return ScoredGroup(
        prompt_id="calculator:0",
        prompt_tokens=_prompt(tokenizer, QUESTION, system="You can use the calculate tool."),
        ground_truth="5",
        response_tokens=[e[0] for e in episodes],
        behaviour_logprobs=[e[1] for e in episodes],
        rewards=np.array([1.0, -1.0], np.float32),
        raw_scores=np.array([1.0, 0.0], np.float32),
        truncated=np.zeros(2, bool),
        finish_reasons=["done", "done"],
        policy_version=version,
        generator_id="gen1",
        created_at=time.time() - 1,
        finished_at=time.time(),
        loss_masks=[e[2] for e in episodes],
        token_versions=[e[3] for e in episodes],
        turns=np.array([2, 2], np.int32),
        tool_calls=np.array([1, 1], np.int32),
        tool_errors=np.array([0, 1], np.int32),
        tools_offered=True,
        reward_terms={"math": np.array([1.0, -1.0], np.float32)},
    ).validate()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run whose learner (B = 1, max_staleness 0, dynamic sampling, overlong filter) trained
    three steps on its stream, logging them to wandb offline with 2 samples a step; one group
    is not consumed yet.

        step 1 at v0: arith:0 (v0) trained
        step 2 at v1: arith:1 (v1, every response wrong) no signal; calculator:0 (v1-2) trained
        step 3 at v2: arith:2 (v1) stale; arith:3 (v2) trained
        not consumed: arith:4 (v2)
    """
    mp = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("samples")
    mp.setenv("WANDB_SILENT", "true")  # wandb offline, its settings and caches in the module's
    mp.delenv("WANDB_API_KEY", raising=False)  # folder, as tests/unit/learner/test_reporting.py
    mp.delenv("WANDB_DIR", raising=False)
    mp.setenv("NETRC", str(home / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        mp.setenv(name, str(home / "wandb-home" / name.lower()))
    run_dir = home / "run"
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[f"storage.run_uri={run_dir}", "learner.max_staleness=0", "learner.total_steps=3",
                   "algorithm.overlong.filter=true", "logging.wandb_mode=offline",
                   "logging.log_samples=2"],
    )  # fmt: skip
    run = open_location(str(run_dir))
    create_run(run, config.model_dump(mode="json"))
    decoder = SampleDecoder.for_run(config)
    tok = decoder.tokenizer
    right, wrong = "The answer is 5.", "The answer is 6."
    first = [
        _single(tok, "arith:0", [right + EOT, wrong + EOT, LONG], [1, 0, 0], 0,
                truncated=[False, False, True]),
        _single(tok, "arith:1", [wrong + EOT, wrong + EOT], [0, 0], 1),
    ]  # fmt: skip
    StreamWriter(run, "gen0").write(first)
    StreamWriter(run, "gen1").write([_tool_group(tok, 1)])
    StreamWriter(run, "gen0").write(
        [_single(tok, f"arith:{i}", [right + EOT, wrong + EOT], [1, 0], v)
         for i, v in ((2, 1), (3, 2), (4, 2))]
    )  # fmt: skip
    collector = BatchCollector(
        batch_groups=1, max_staleness=0, dynamic_sampling=True, vocab_size=len(tok),
        max_seq_len=4096,
    )  # fmt: skip
    reader = StreamReader(run, prefetch_rounds=0)
    groups = reader.groups(timeout_s=5)
    reporter = MetricsReporter(
        run, config.logging, config={}, total_steps=config.learner.total_steps
    )
    table = SampleTable(config, reporter)
    with reporter:
        for step in (1, 2, 3):
            batch = collector.collect(groups, lambda: reader.cursor, current_version=step - 1)
            reporter.log(batch.metrics() | {"step": step, "policy_version": step})
            table.log(batch, step)
    groups.close()
    yield config, run, decoder
    mp.undo()


def _samples(trained, **wanted):
    config, run, decoder = trained
    return read_samples(run, config, decoder, SampleFilter(**wanted)).samples


def _ids(samples) -> list[tuple[str, int]]:
    return [(s.prompt_id, s.response) for s in samples]


def test_a_tool_episode_decodes_into_turns_with_its_calls_results_and_versions(trained):
    good, bad = _samples(trained, task="calculator")
    assert good.prompt.endswith("<|im_start|>assistant\n")
    assert "You can use the calculate tool." in good.prompt
    assert QUESTION in good.prompt
    assert [t.role for t in good.turns] == ["model", "environment", "model"]
    assert good.turns[0].text == '<tool>calculate(expression="2 + 3")</tool>' + EOT
    assert good.turns[0].tool_calls == (ToolCallText("calculate", {"expression": "2 + 3"}),)
    assert good.turns[1].tool_results == (ToolResultText("calculate", "5", True),)
    assert good.turns[2].text == "The answer is 5." + EOT
    assert [t.versions for t in good.turns] == [(1,), (), (2,)]
    assert (good.versions, good.policy_version) == ((1, 2), 1)
    assert (good.reward, good.raw_score, good.reward_terms) == (1.0, 1.0, {"math": 1.0})
    assert (good.tool_calls, good.tool_errors, good.tools_offered) == (1, 0, True)
    assert sum(t.tokens for t in good.turns) == good.response_tokens
    (result,) = bad.turns[1].tool_results
    assert not result.ok
    assert result.content.startswith("Error: unknown tool 'divide'")
    assert bad.tool_errors == 1
    assert good.learner.step == 2
    assert good.learner.filtered is None


def test_what_the_learner_did_with_each_group_comes_from_its_records(trained):
    everything = _samples(trained, limit=100)
    learner = {(s.prompt_id, s.response): s.learner for s in everything}
    assert _ids(everything)[:3] == [("arith:0", 0), ("arith:0", 1), ("arith:0", 2)]
    assert len(everything) == 3 + 2 + 2 + 2 * 3
    step1 = learner["arith:0", 0]
    assert (step1.step, step1.version, step1.staleness, step1.filtered) == (1, 0, 0, None)
    assert learner["arith:0", 2].filtered.startswith("overlong: truncated")
    assert learner["arith:1", 0].filtered.startswith("no signal: dropped, every response")
    assert learner["arith:1", 0].step == 2
    stale = learner["arith:2", 1]
    assert (stale.step, stale.version, stale.staleness) == (3, 2, 1)
    assert stale.filtered.startswith("stale: dropped, staleness 1 > learner.max_staleness=0")
    assert learner["arith:3", 0].filtered is None
    assert learner["arith:3", 0].step == 3
    pending = next(s for s in everything if s.prompt_id == "arith:4")
    assert pending.learner is None
    assert pending.learner_note.startswith("not consumed yet: group 6 of the stream")
    assert pending.position == (2, 2)
    assert everything[0].position == (0, 0)


def test_every_filter(trained):
    assert {s.prompt_id for s in _samples(trained, step=2)} == {"arith:1", "calculator:0"}
    assert _ids(_samples(trained, step=3, limit=3)) == [
        ("arith:2", 0),
        ("arith:2", 1),
        ("arith:3", 0),
    ]
    assert _ids(_samples(trained, version=2)) == [
        ("calculator:0", 0), ("calculator:0", 1), ("arith:3", 0), ("arith:3", 1), ("arith:4", 0),
        ("arith:4", 1),
    ]  # a later turn sampled by v2 counts  # fmt: skip
    assert all(s.reward >= 0.5 for s in _samples(trained, min_reward=0.5, limit=100))
    assert len(_samples(trained, min_reward=0.5, limit=100)) == 5
    assert {s.reward for s in _samples(trained, max_reward=-0.5, limit=100)} == {-1.0}
    assert {s.task for s in _samples(trained, task="arith", limit=100)} == {"arith"}
    assert _ids(_samples(trained, failed_tools=True)) == [("calculator:0", 1)]
    assert _samples(trained, task="nothing") == []
    # the newest that match, in stream order
    assert _ids(_samples(trained, limit=3)) == [("arith:3", 1), ("arith:4", 0), ("arith:4", 1)]
    with pytest.raises(SamplesError, match="no record of step 9"):
        _samples(trained, step=9)


def test_json_lines_and_bounded_text_from_the_command_line(trained, capsys):
    _, run, _ = trained
    assert main(["samples", run.uri, "--failed-tools", "--json"]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    record = json.loads(line)
    assert (record["prompt_id"], record["response"], record["tool_errors"]) == (
        "calculator:0",
        1,
        1,
    )
    assert record["learner"] == {"step": 2, "version": 1, "staleness": 0, "filtered": None,
                                 "pretrain_step": None}  # fmt: skip
    assert [t["role"] for t in record["turns"]] == ["model", "environment", "model"]
    assert err.splitlines()[-1] == "1 sample from 6 groups read of 6 in the stream"

    assert main(["samples", run.uri, "--step", "last", "--max-chars", "60"]) == 0
    out, _ = capsys.readouterr()
    assert out.count("━━ ") == 4
    assert "arith:3" in out
    assert "learner: step 3 at v2, staleness 1, NOT TRAINED — stale: dropped" in out
    long = _samples(trained, limit=100)[2]  # the truncated response
    text = format_sample(long, 60)
    assert f"[{len(long.turns[0].text) - 60} characters cut]" in text
    assert len(text) < 60 * 6 + 600  # header lines, the prompt and the turn, each cut


def test_consumption_that_the_records_cannot_tell_is_said_not_guessed():
    records = [
        {"step": 0, "value_pretrain_step": 1, "stream/consumed_total": 4},
        {"step": 1, "policy_version": 1, "stream/consumed_total": 6},
        {"step": 3, "policy_version": 3, "stream/consumed_total": 9},  # step 2's record is lost
    ]
    steps = ConsumedGroups(records)
    assert (steps.at(0).step, steps.at(0).version, steps.at(0).pretrain_step) == (0, 0, 1)
    assert (steps.at(5).step, steps.at(5).version) == (1, 0)
    gap = steps.at(6)
    assert gap.version is None
    assert "records between step 1 and step 3 are missing" in gap.note
    assert steps.at(9) is None
    assert "had consumed 9" in steps.pending_note(9)
    assert "no learner metrics record" in ConsumedGroups([]).pending_note(0)


def _wandb_tables(run_dir: Path) -> dict[int, list[list]]:
    tables = {}
    for path in run_dir.glob("wandb/wandb/offline-run-*/files/media/table/samples_*.table.json"):
        data = json.loads(path.read_text())
        assert data["columns"] == list(TABLE_COLUMNS)
        tables[int(path.name.split("_")[1])] = data["data"]
    return tables


def test_the_wandb_table_and_the_artifact_show_the_same_samples_of_each_step(trained):
    config, run, _ = trained
    tables = _wandb_tables(Path(run.path))
    assert sorted(tables) == [1, 2, 3]
    column = {name: i for i, name in enumerate(TABLE_COLUMNS)}
    step2 = tables[2]
    assert [(r[column["prompt_id"]], r[column["response"]]) for r in step2] == [
        ("calculator:0", 0), ("calculator:0", 1)
    ]  # the best reward, then the worst  # fmt: skip
    assert all(r[column["step"]] == 2 and r[column["staleness"]] == 0 for r in step2)
    assert '→ calculate(expression="2 + 3")' in step2[0][column["transcript"]]
    assert "← calculate FAILED: Error: unknown tool" in step2[1][column["transcript"]]
    step1 = tables[1]
    assert step1[1][column["filtered"]].startswith("overlong")  # the worst: the truncated one
    for row in (r for rows in tables.values() for r in rows):
        for text in (row[column["prompt"]], row[column["transcript"]]):
            assert len(text) <= SAMPLE_MAX_CHARS + 40

    artifacts = RunArtifacts(config, run)
    for step, rows in tables.items():
        markdown = artifacts.samples_markdown(step)
        shown = [line for line in markdown.splitlines() if line.startswith("#### ")]
        assert shown == [
            f"#### {n}. `{r[column['prompt_id']]}` — response {r[column['response']] + 1} of "
            f"{2 if r[column['prompt_id']] != 'arith:0' else 3}"
            for n, r in enumerate(rows, 1)
        ]
    markdown = artifacts.samples_markdown(1)
    assert "Samples of run — step 1: 2 responses" in markdown
    assert "````" not in markdown
    assert markdown.count("```text") == 4
    bounded = samples_markdown(_samples(trained, limit=100), "all", max_chars=100)
    assert len(bounded) < 13 * (2 * 100 + 700)


def test_a_viewer_never_writes_to_the_run(tmp_path):
    """`streamrl samples` reads; a segment it cannot read is skipped, no quarantine note written
    (an older streamrl reading a newer run must not make the learner skip groups)."""
    from storage.stream.reader import StreamReader
    from storage.stream.writer import StreamWriter, quarantined
    from tests.unit.runs.built_runs import group, new_run

    run, _ = new_run(tmp_path / "run")
    StreamWriter(run, "gen0").write([group(i, 0, [1.0, 0.0, 1.0, 0.0]) for i in range(2)])
    segment = next(p for p in (tmp_path / "run" / "stream" / "segments").rglob("*") if p.is_file()
                   and p.name not in ("zarr.json",))  # fmt: skip
    segment.write_bytes(b"damaged")
    items = StreamReader(run, prefetch_rounds=0, write_notes=False).poll()
    assert all(not isinstance(group, ScoredGroup) for _, group in items)
    assert quarantined(run) == []
