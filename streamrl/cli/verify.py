"""`streamrl verify`: an audit of a run, read from its storage only (`streamrl.runs.audit`),
shown as a report or a JSON line (`streamrl.runs.audit_format`).

`add_commands(commands)` registers it on the subparsers of `streamrl.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
from typing import Any

EXAMPLES_VERIFY = """\
examples:
  streamrl verify ./runs/demo
  streamrl verify ./runs/demo --json | jq .problems
  AWS_ENDPOINT_URL=http://127.0.0.1:8333 streamrl verify s3://bucket/runs/x
Reads only the run's storage and writes nothing. Checks that the stream's commit log has no
gap and no segment committed twice, that every committed segment reads back whole (sizes,
CRC32s, decoding), that the learner's group counts add up (consumed = trained + dropped stale
+ dropped without signal) and match its checkpoint's stream cursor, that there is one learner
metrics record per step (a resumed learner's rewrites count once), that the newest checkpoint
and every committed weight version verify. Quarantined segments (with the reader's note) and
the open segments of generators that died are reported, not failures. Reads every segment and
weight version: as long as downloading the run. Exit status 0 when the run is whole, 1 with
the list of problems, 2 when there is no run at RUN_URI.
"""


def _cmd_verify(args: argparse.Namespace) -> int:
    from streamrl.cli.status import _open_run
    from streamrl.runs.audit import audit_run
    from streamrl.runs.audit_format import audit_json, format_audit

    audit = audit_run(_open_run(args.run))  # StorageError (no run): exit 2 in main()
    print(audit_json(audit) if args.json else format_audit(audit), flush=True)
    return 0 if audit.whole else 1


def add_commands(commands: Any) -> None:
    """Register `verify` on the `streamrl` command's subparsers."""
    verify = commands.add_parser(
        "verify",
        help="audit a run from its storage: nothing lost or duplicated, every object whole",
        description="Audit a run from its storage alone (live or finished; meant for a "
        "stopped one).",
        epilog=EXAMPLES_VERIFY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("run", metavar="RUN_URI", help="the run's root URI")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(func=_cmd_verify)
