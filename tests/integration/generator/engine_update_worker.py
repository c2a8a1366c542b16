"""A fresh `Engine` takes a weight update (the newest version of RUN_DIR's weight store, its
workers reading it) while greedy requests are in flight; their completions and what the update
reported go to OUT_JSON. ENGINE_PROCESS=1 runs vLLM's engine core in a process of its own
(`generator.cpu_engine_process`), 0 in this one.

Run by tests/integration/generator/test_engine_update.py in a fresh interpreter: vLLM caches its
environment once an engine has started, so an engine started earlier in the test process would
decide this one's mode.

    python -m tests.integration.generator.engine_update_worker \
        RUN_DIR OUT_JSON PROMPTS_JSON ENGINE_PROCESS
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.generator.engine import Engine, WeightSource
from streamrl.models import resolve_model_path


def main(run_dir: str, out: str, prompts_json: str, engine_process: str) -> None:
    overrides = [
        f"generator.cpu_engine_process={engine_process == '1'}",
        "generator.max_tokens=200",
        "data.max_prompt_len=56",
    ]
    config = load_config(["dapo", "tiny-cpu"], overrides=overrides)
    engine = Engine(resolve_model_path("tiny-qwen2"), config.model, config.generator, seed=0)
    client = type(engine.llm.llm_engine.engine_core).__name__
    assert client == ("SyncMPClient" if engine_process == "1" else "InprocClient"), client
    prompts = json.loads(prompts_json)
    ids = [engine.submit(p, greedy=True) for p in prompts]
    done = {}
    for _ in range(10):  # some tokens exist (the engine core also decodes on its own)
        done.update((g.request_id, g) for g in engine.step())
    source = WeightSource.of(open_location(run_dir), config.weights)
    found, _ = engine.advance_weights(source)
    while len(done) < len(ids):
        done.update((g.request_id, g) for g in engine.step())
    completions = [
        {
            "tokens": done[i].completions[0].token_ids.tolist(),
            "logprobs": done[i].completions[0].logprobs.tolist(),
            "policy_version": done[i].policy_version,
        }
        for i in ids
    ]
    result = {
        "completions": completions,
        "advance": asdict(found),
        "version": engine.policy_version,
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # the engine core is spawned: it re-imports this module
    main(*sys.argv[1:])
