"""The generator's side of test_lora_generator.py, in a fresh interpreter (vLLM changes its
process's environment and process groups; the learner's side stays in the test's process).

A fresh `Engine` serving `model.lora` samples PROMPTS at version 0 (the adapter of zeros), loads
version 1 of RUN_DIR's weight store into its adapter slot and samples them again, then starts
them once more, loads version 2 in place after a few engine steps and finishes them. Every
completion (tokens, log-probs, per-token versions) goes to OUT_JSON.

    python -m tests.integration.generator.lora_engine_worker \
        RUN_DIR OUT_JSON PROMPTS_JSON OVERRIDES_JSON
"""

from __future__ import annotations

import json
import sys

from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.generator.engine import Engine, WeightSource
from streamrl.models import resolve_model_path


def _completions(groups) -> list[list[dict]]:
    return [
        [
            {
                "tokens": c.token_ids.tolist(),
                "logprobs": c.logprobs.tolist(),
                "versions": c.versions.tolist(),
            }
            for c in group.completions
        ]
        for group in groups
    ]


def main(run_dir: str, out: str, prompts_json: str, overrides_json: str) -> None:
    config = load_config(["dapo", "tiny-cpu"], overrides=json.loads(overrides_json))
    prompts = json.loads(prompts_json)
    engine = Engine(
        resolve_model_path("tiny-qwen2"),
        config.model,
        config.generator,
        seed=0,
        adapter=config.served_adapter,
    )
    source = WeightSource.of(open_location(run_dir), config.weights)
    result = {"v0": _completions(engine.generate(prompts))}
    found, _ = engine.advance_weights(source, exactly=1)
    result["loaded"] = [found.version]
    result["v1"] = _completions(engine.generate(prompts))

    ids = [engine.submit(p) for p in prompts]
    done = {}
    for _ in range(6):  # some tokens are sampled by version 1
        done.update((g.request_id, g) for g in engine.step())
    found, _ = engine.advance_weights(source, exactly=2)
    result["loaded"].append(found.version)
    while len(done) < len(ids):
        done.update((g.request_id, g) for g in engine.step())
    result["swapped"] = _completions([done[i] for i in ids])
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # the engine core may be spawned: it re-imports this module
    main(*sys.argv[1:])
