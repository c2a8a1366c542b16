"""Two learner ranks over one stream: rank 0 reads and decides, every rank trains on the same
batch, and a transient read error is retried, not quarantined."""

from __future__ import annotations

import json

import numpy as np

from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.writer import StreamWriter, quarantined
from streamrl.config.loading import load_config
from streamrl.models import resolve_model_path
from tests.integration.learner import ranks_worker as worker
from tests.integration.torchrun import torchrun
from tests.stream_data import random_group


def test_rank0_decides_the_batch_and_a_transient_read_error_loses_nothing(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            "learner.total_steps=2",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=4",
            "learner.max_staleness=100",
            "learner.checkpoint_every=100",
            "generator.max_tokens=24",
        ],
    )
    run = open_location(str(run_dir))
    create_run(run, config.model_dump(mode="json"))
    rng = np.random.default_rng(0)
    groups = [
        random_group(rng, prompt_id=f"p{i}", vocab=600, max_len=24, prompt_len=10)
        for i in range(24)
    ]
    writer = StreamWriter(run, "gen0")
    for start in range(0, len(groups), 6):
        writer.write(groups[start : start + 6])
    expected = [g.prompt_id for g in groups if 0 < g.raw_scores.sum() < g.group_size][:8]

    resolve_model_path("tiny-qwen2")  # build the bundled model once, before two ranks race
    torchrun(worker.__file__, f"--root={run_dir}", f"--out={out}")

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["batches"] == ranks[1]["batches"]
    trained = [prompt for batch in ranks[0]["batches"] for prompt in batch]
    assert trained == expected  # every group with signal, in commit order
    assert quarantined(run) == []
    assert ranks[0]["metrics"]["stream/quarantined_total"] == 0
    assert ranks[0]["metrics"]["stream/read_retries_total"] >= 1
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
