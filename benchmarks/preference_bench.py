"""A DPO step against an SFT step on the same pairs' tokens: learner tokens/s, side by side.

    python -m benchmarks.preference_bench [--steps 6] [--pairs 16] [--size smollm2-cpu]

Three `streamrl run`s of the learner alone, one after the other, on the bundled arithmetic task:
SFT on the chosen answers (`builtin:arithmetic-demos`: prompt + chosen), DPO with the
reference's log-probs cached (scored once before step 1, `preference.reference: cached`) and
DPO with the reference scored beside the policy each step (`on_the_fly`), on the pairs of
`builtin:arithmetic-pairs` (prompt + chosen + rejected). Each run takes `--pairs` examples a
step, one optimiser update. tokens/s is `perf/learner_tokens_per_s` (loss tokens over the
step's training time) averaged over the steps after the first; the goal (issue #62): DPO ≥ 0.8×
SFT. The cached run's one-off scoring is timed from its log.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {
    "sft": ["--preset", "sft", "data.path=builtin:arithmetic-demos", "sft.eval_every=0"],
    "dpo (cached reference)": [
        "--preset", "dpo", "data.path=builtin:arithmetic-pairs", "preference.eval_every=0",
        "preference.reference=cached",
    ],
    "dpo (reference on the fly)": [
        "--preset", "dpo", "data.path=builtin:arithmetic-pairs", "preference.eval_every=0",
        "preference.reference=on_the_fly",
    ],
}  # fmt: skip


def run_side(args: argparse.Namespace, name: str, extra: list[str], folder: Path) -> dict:
    run_dir = folder / re.sub(r"\W+", "-", name)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "run", "--preset", args.size, *extra,
         f"storage.run_uri={run_dir}", f"learner.total_steps={args.steps}",
         f"learner.batch_groups={args.pairs}", f"learner.mini_batch_groups={args.pairs}",
         "learner.warmup_steps=0", "logging.wandb_mode=disabled", "data.val_path=null"],
        cwd=ROOT, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    metrics = (run_dir / "metrics" / "learner.jsonl").read_text()
    steps = [json.loads(line) for line in metrics.splitlines()]
    later = steps[1:] or steps
    log = (run_dir / "logs" / "learner.log").read_text()
    return {
        "tokens_per_s": sum(s["perf/learner_tokens_per_s"] for s in later) / len(later),
        "step_s": sum(s["perf/step_s"] for s in later) / len(later),
        "loss_tokens_per_step": sum(s.get("sft/tokens", s.get("pref/tokens", 0)) for s in later)
        / len(later),
        "wall_s": time.monotonic() - started,
        "scored_once": "scored and stored" in log,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--size", default="smollm2-cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as folder:
        results = {name: run_side(args, name, extra, Path(folder)) for name, extra in SIDES.items()}
    sft = results["sft"]["tokens_per_s"]
    header = ("side", "tokens/s", "/ sft", "s/step", "loss tok/step", "wall s")
    print("{:<28} {:>9} {:>7} {:>7} {:>13} {:>7}".format(*header))
    for name, r in results.items():
        ratio = r["tokens_per_s"] / sft
        print(f"{name:<28} {r['tokens_per_s']:>9.0f} {ratio:>6.2f}× {r['step_s']:>7.2f} "
              f"{r['loss_tokens_per_step']:>13.0f} {r['wall_s']:>7.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
