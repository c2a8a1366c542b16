"""`streamrl eval` and `streamrl export`: evaluate and export a run's published weight versions.

`add_commands(commands)` registers both on the subparsers of `streamrl.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXAMPLES_EVAL = """\
examples:
  streamrl eval --run ./runs/demo                        the latest version
  streamrl eval --run ./runs/demo --version 12 --k 8 --max-prompts 200
  streamrl eval --run ./runs/demo --version 0            the initial weights (model.path)
  streamrl eval --run ./runs/demo --dataset aime-2024.parquet --prompt-field problem \\
      --answer-field answer
  streamrl eval --run s3://bucket/runs/x --follow        the evaluator process of a run
Scores val/acc_greedy (one greedy response per prompt), val/avg@k = val/pass@1 and val/pass@k
(k samples at eval.temperature, else generator.temperature) with the run's reward function,
prints them as JSON and appends them to <run>/metrics/eval.jsonl (--no-record: print only).
Without --dataset the prompts are eval.dataset, else data.val_path, else the training prompts
(not held out). --follow evaluates every eval.every_versions-th version (--every) and the last
one, until the run's stop marker appears; versions already in the log are not evaluated again.
"""

EXAMPLES_EXPORT = """\
examples:
  streamrl export ./runs/demo --out ./exports/demo-latest
  streamrl export ./runs/demo --version 12 --out ./exports/demo-v12 --dtype bfloat16
  streamrl export s3://bucket/runs/x --version 40 --out ./x-v40 --overwrite
  streamrl export ./runs/lora --out ./exports/lora-merged --adapter-out ./exports/lora-adapter
Writes a Hugging Face model directory (config.json, generation_config.json, tokenizer with chat
template, safetensors weights) that transformers' from_pretrained and vLLM load directly:
  vllm serve ./exports/demo-v12
The directory appears complete or not at all; a non-empty one is refused without --overwrite.
A LoRA run's adapter version is exported merged into its base model (model.path);
--adapter-out also writes the adapter alone, for peft or `vllm serve BASE --enable-lora`.
"""


def _open_run(run_uri: str) -> Any:
    """The existing run at `run_uri`, opened with its configuration's storage settings."""
    from storage.fs import open_location
    from streamrl.config.stored import load_run_config

    run = open_location(run_uri, check=False)  # a mistyped local URI must not create a folder
    storage = load_run_config(run).storage  # StorageError naming the URI when no run is there
    return open_location(
        run_uri, endpoint_url=storage.endpoint_url, storage_options=storage.storage_options
    )


def _cmd_eval(args: argparse.Namespace) -> int:
    from streamrl.config.base import ConfigError
    from streamrl.config.stored import load_run_config
    from streamrl.evaluation.evaluator import evaluate, run_evaluator

    if args.follow:
        one_off = ("version", "dataset", "k", "max_prompts", "temperature", "prompt_field",
                   "answer_field")  # fmt: skip
        given = [f"--{n.replace('_', '-')}" for n in one_off if getattr(args, n) is not None]
        if given or args.no_record:
            given += ["--no-record"] if args.no_record else []
            raise ConfigError(
                [f"--follow evaluates as the run's eval section says; drop {', '.join(given)} "
                 "or set eval.* in the run's configuration"],
                "command line",
            )  # fmt: skip
        records = run_evaluator(args.run, poll_s=args.poll_s, every_versions=args.every)
        print(f"evaluator: {len(records)} versions evaluated")
        return 0
    run = _open_run(args.run)
    dataset = None
    if args.dataset is not None:
        dataset = _dataset_config(args, load_run_config(run))
    metrics = evaluate(
        run,
        args.version,
        dataset=dataset,
        k=args.k,
        max_prompts=args.max_prompts,
        temperature=args.temperature,
        record=not args.no_record,
    )
    print(json.dumps(metrics, indent=2))
    return 0


def _dataset_config(args: argparse.Namespace, config: Any) -> Any:
    """--dataset and its field options over the run's eval.dataset (else data) section,
    validated as eval.dataset so a mistake names the option's field."""
    from streamrl.config.loading import validate_config

    base = (config.eval.dataset or config.data).model_dump()
    fields = {"path": args.dataset, "val_path": None}
    if args.prompt_field is not None:
        fields["prompt_field"] = args.prompt_field
    if args.answer_field is not None:
        fields["answer_field"] = args.answer_field
    section = {**config.eval.model_dump(), "dataset": {**base, **fields}}
    checked = validate_config({**config.model_dump(), "eval": section}, source="--dataset")
    return checked.eval.dataset


def _cmd_export(args: argparse.Namespace) -> int:
    from streamrl.runs.export import OutputExistsError, export_version

    try:
        out = export_version(
            _open_run(args.run),
            args.out,
            args.version,
            overwrite=args.overwrite,
            dtype=args.dtype,
            adapter_dir=args.adapter_out,
        )
    except OutputExistsError as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


def add_commands(commands: Any) -> None:
    """Register `eval` and `export` on the `streamrl` command's subparsers."""
    raw = argparse.RawDescriptionHelpFormatter

    evaluate = commands.add_parser(
        "eval",
        help="evaluate published weight versions on held-out prompts",
        description="Greedy accuracy, avg@k (pass@1) and pass@k of a run's published weights.",
        epilog=EXAMPLES_EVAL,
        formatter_class=raw,
    )
    evaluate.add_argument("--run", required=True, metavar="RUN_URI", help="the run's root URI")
    evaluate.add_argument(
        "--version",
        type=int,
        metavar="V",
        help="weight version (default: the latest; 0: the initial weights)",
    )
    evaluate.add_argument(
        "--dataset", metavar="PATH_OR_NAME", help="JSONL/Parquet file or builtin:NAME"
    )
    evaluate.add_argument("--prompt-field", metavar="FIELD", help="prompt field of --dataset")
    evaluate.add_argument("--answer-field", metavar="FIELD", help="answer field of --dataset")
    evaluate.add_argument("--k", type=int, metavar="K", help="samples per prompt (eval.k)")
    evaluate.add_argument(
        "--max-prompts", type=int, metavar="N", help="prompts evaluated (eval.max_prompts)"
    )
    evaluate.add_argument(
        "--temperature", type=float, metavar="T", help="temperature of the k samples"
    )
    evaluate.add_argument(
        "--no-record", action="store_true", help="print only; do not append to eval.jsonl"
    )
    evaluate.add_argument(
        "--follow", action="store_true", help="evaluate new versions until the run stops"
    )
    evaluate.add_argument(
        "--every",
        type=int,
        metavar="E",
        help="with --follow: every E-th version (eval.every_versions)",
    )
    evaluate.add_argument(
        "--poll-s", type=float, default=10.0, metavar="S", help="with --follow: poll interval"
    )
    evaluate.set_defaults(func=_cmd_eval)

    export = commands.add_parser(
        "export",
        help="write a published weight version as a Hugging Face model directory",
        description="Export a run's weight version for transformers and vLLM.",
        epilog=EXAMPLES_EXPORT,
        formatter_class=raw,
    )
    export.add_argument("run", metavar="RUN_URI", help="the run's root URI")
    export.add_argument(
        "--version", type=int, metavar="V", help="weight version (default: the latest)"
    )
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty output directory"
    )
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="cast the weights (default: as published)",
    )
    export.add_argument(
        "--adapter-out",
        metavar="DIR",
        help="LoRA runs: also write the version's adapter as a PEFT adapter directory",
    )
    export.set_defaults(func=_cmd_export)
