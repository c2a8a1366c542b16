"""A stream writer process for the multi-process tests.

    python -m tests.integration.storage.stream.stream_writer RUN_URI WRITER_ID \
        --groups N --segment K
        [--start I] [--pause-s S[,S2,...]] [--commit-deadline-s D]

Writes groups `<writer>/<i>` for i in [start, N) in segments of K, printing
`uploaded <segment>` once a segment's objects are stored and `committed <last i> <segment>`
once its commit record is (the segment committed: another name if the deadline had passed).
`--pause-s` sleeps between the two, widening the window in which a kill leaves an orphan
segment; a comma-separated list is used in turn, one pause per segment. S3 credentials and
endpoint come from the AWS_* environment.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from storage.fs import open_location
from storage.stream.writer import COMMIT_DEADLINE_S, StreamWriter
from tests.stream_data import random_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_uri")
    parser.add_argument("writer_id")
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--pause-s", default="0")
    parser.add_argument("--commit-deadline-s", type=float, default=COMMIT_DEADLINE_S)
    args = parser.parse_args()
    pauses = [float(p) for p in args.pause_s.split(",")]

    writer = StreamWriter(
        open_location(args.run_uri), args.writer_id, commit_deadline_s=args.commit_deadline_s
    )
    rng = np.random.default_rng(abs(hash(args.writer_id)) % 2**32)
    index = args.start
    while index < args.groups:
        stop = min(index + args.segment, args.groups)
        groups = [
            random_group(rng, prompt_id=f"{args.writer_id}/{i}", generator_id=args.writer_id)
            for i in range(index, stop)
        ]
        uploaded = writer.upload(groups)
        print(f"uploaded {uploaded.record.segment}", flush=True)
        time.sleep(pauses[writer.stats.segments % len(pauses)])
        record = writer.commit(uploaded)
        print(f"committed {stop - 1} {record.segment}", flush=True)
        index = stop
    sys.stdout.flush()


if __name__ == "__main__":
    main()
