"""One rank of the two-rank learner test over a stream whose first segment read fails
transiently on every rank (run by torchrun from test_ranks.py).

    torchrun --nproc_per_node 2 ranks_worker.py --root RUN_DIR --out DIR

Every rank's filesystem returns a `TimeoutError` in place of the first segment objects it is
asked for — what s3fs's `cat(on_error="return")` hands back for a timed-out GET. The learner
trains `learner.total_steps` steps; each rank writes `<out>/rank<r>.json` with the prompt ids of
each batch it trained on, the cursor and the stream metrics of the last step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from streamrl.config.stored import open_existing_run
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology, exit_process


def fail_first_segment_read(fs) -> None:
    """Wrap `fs.cat` so the first call that fetches segment objects gets errors for them."""
    original, failed = fs.cat, []

    def cat(paths, *args, **kwargs):
        result = original(paths, *args, **kwargs)
        wanted = [p for p in result if "/segments/" in p] if isinstance(result, dict) else []
        if wanted and not failed:
            failed.append(wanted)
            for path in wanted:
                result[path] = TimeoutError(f"injected: GET {path} timed out")
        return result

    fs.cat = cat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    config, run = open_existing_run(args.root)
    fail_first_segment_read(run.fs)
    with Topology.from_env("cpu") as topology:
        learner = Learner(config, run, topology)
        batches = []
        train_on_batch = learner._train_batch

        def recording(**kwargs):
            batch, metrics = train_on_batch(**kwargs)
            batches.append([g.prompt_id for g in batch.groups])
            recording.metrics = metrics
            return batch, metrics

        learner._train_batch = recording
        learner.run()
        state = {
            "rank": topology.rank,
            "batches": batches,
            "metrics": {k: v for k, v in recording.metrics.items() if k.startswith("stream/")},
            "version": learner.state.version,
        }
        (Path(args.out) / f"rank{topology.rank}.json").write_text(json.dumps(state))


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
