"""A stream writer process for the multi-process tests.

    python -m tests.integration.stream_writer RUN_URI WRITER_ID --groups N --segment K
        [--start I] [--pause-s S]

Writes groups `<writer>/<i>` for i in [start, N) in segments of K, printing
`uploaded <segment>` once a segment's objects are stored and `committed <last i>` once its
commit record is. `--pause-s` sleeps between the two, widening the window in which a kill
leaves an orphan segment. S3 credentials and endpoint come from the AWS_* environment.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from storage.fs import open_location
from storage.stream import StreamWriter
from tests.stream_data import random_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_uri")
    parser.add_argument("writer_id")
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--pause-s", type=float, default=0.0)
    args = parser.parse_args()

    import time

    writer = StreamWriter(open_location(args.run_uri), args.writer_id)
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
        if args.pause_s:
            time.sleep(args.pause_s)
        writer.commit(uploaded)
        print(f"committed {stop - 1}", flush=True)
        index = stop
    sys.stdout.flush()


if __name__ == "__main__":
    main()
