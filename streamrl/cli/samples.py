"""`streamrl samples`: what the model wrote — the run's groups decoded straight from its replay
stream (`streamrl.runs.samples`), shown as text blocks or JSON lines
(`streamrl.runs.samples_format`).

`add_commands(commands)` registers it on the subparsers of `streamrl.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXAMPLES = """\
examples:
  streamrl samples ./runs/demo                        the newest 10 responses
  streamrl samples ./runs/demo --step last            what the last logged step consumed
  streamrl samples ./runs/demo --step 12 --max-reward 0 --limit 4
  streamrl samples ./runs/agent --failed-tools        episodes with a failed tool call
  streamrl samples ./runs/demo --task builtin:arithmetic --version 3 --json | jq .reward
Each sample: the prompt, the response turn by turn (model turns with the weight versions that
sampled them, environment turns: tool results and template text), the tool calls read from
each model turn, the reward with its raw score and terms, the finish reason, and what the
learner did with it — the step that consumed it, the version it read it at, its staleness, and
whether it was trained on or why not (stale, no signal under dynamic sampling, masked as
overlong). That comes from the learner's metrics records; where one is missing the sample says
so. Without --step: the newest matching samples; with it, the first the step consumed; printed
in stream order. Texts are cut to --max-chars (start and end kept); --json prints them whole.
Where to look first when accuracy stays at 0 or the tool is never called: docs/samples.md.
"""


def _step(text: str) -> int | str:
    if text == "last":
        return text
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"--step takes a learner step ≥ 0 or 'last', got {text!r}")
    return step


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"give a whole number ≥ 1, got {text!r}")
    return value


def _cmd_samples(args: argparse.Namespace) -> int:
    from storage.stream.log import StorageUnavailableError
    from streamrl.config.stored import open_existing_run
    from streamrl.isolation.terminal import printable
    from streamrl.learner.samples import SampleDecoder
    from streamrl.runs.samples import ConsumedGroups, SampleFilter, SamplesError, read_samples
    from streamrl.runs.samples_format import format_sample, format_summary

    config, run = open_existing_run(args.run, check=False)
    step = args.step
    if step == "last":
        step = ConsumedGroups.read(run).last_step
        if step is None:
            print(f"streamrl samples: the learner of {run.uri} has logged no step yet; leave "
                  "--step out to see the newest samples", file=sys.stderr)  # fmt: skip
            return 2
    wanted = SampleFilter(
        step=step,
        version=args.version,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        task=args.task,
        failed_tools=args.failed_tools,
        limit=args.limit,
    )
    if not args.trust_remote_code:  # reading a run must not run the code its run.json names
        model = config.model.model_copy(update={"trust_remote_code": False})
        config = config.model_copy(update={"model": model})
    decoder = SampleDecoder.for_run(config, args.tokenizer)
    try:
        report = read_samples(run, config, decoder, wanted)
    except (SamplesError, StorageUnavailableError) as exc:
        print(f"streamrl samples: {exc}", file=sys.stderr)
        return 2
    for sample in report.samples:
        if args.json:
            record = _cut(sample.to_json(), args.max_chars)
            # ASCII: no control character of the model's reaches the terminal raw; default=str
            # for literal_eval's tuples.
            print(json.dumps(record, default=str))
        else:
            print(printable(format_sample(sample, args.max_chars or 1200)), end="\n\n")
    print(format_summary(report, args.limit), file=sys.stderr)
    return 0


def _cut(record: dict[str, Any], max_chars: int | None) -> dict[str, Any]:
    """A sample's JSON with its texts cut to `max_chars` (None: whole)."""
    if max_chars is None:
        return record
    from streamrl.learner.sample_table import elide

    record["prompt"] = elide(record["prompt"], max_chars)
    for turn in record["turns"]:
        turn["text"] = elide(turn["text"], max_chars)
        for result in turn["tool_results"]:
            result["content"] = elide(result["content"], max_chars)
    return record


def add_commands(commands: Any) -> None:
    """Register `samples` on the `streamrl` command's subparsers."""
    samples = commands.add_parser(
        "samples",
        help="what the model wrote: a run's responses decoded from its replay stream",
        description="Decode a run's groups from its replay stream: prompt, turns, tool calls, "
        "rewards, versions, and what the learner did with each.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    samples.add_argument("run", metavar="RUN_URI", help="the run's root URI")
    samples.add_argument(
        "--step", type=_step, metavar="N|last", help="responses learner step N consumed"
    )
    samples.add_argument(
        "--version", type=int, metavar="V", help="responses weight version V sampled (a turn)"
    )
    samples.add_argument("--min-reward", type=float, metavar="R", help="reward ≥ R")
    samples.add_argument("--max-reward", type=float, metavar="R", help="reward ≤ R")
    samples.add_argument(
        "--task", metavar="DATASET", help="prompts of this dataset (the prompt id less its row)"
    )
    samples.add_argument(
        "--failed-tools", action="store_true", help="episodes with a failed tool call"
    )
    samples.add_argument(
        "--limit", type=_positive, default=10, metavar="N", help="at most N responses (10)"
    )
    samples.add_argument(
        "--max-chars",
        type=_positive,
        metavar="N",
        help="cut each text to N characters (default 1200; --json: whole texts)",
    )
    samples.add_argument("--json", action="store_true", help="one JSON object per sample")
    samples.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="decode with this tokenizer (default: the run's model.tokenizer or model.path)",
    )
    samples.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the tokenizer run the code its model folder ships (the run's "
        "model.trust_remote_code is not followed: whoever wrote the run chose it, not you)",
    )
    samples.set_defaults(func=_cmd_samples)
