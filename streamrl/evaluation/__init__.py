"""Held-out evaluation of published weight versions, in a process of its own (`streamrl eval`).

- `config`: the `eval` section.
- `evaluator`: greedy accuracy and avg@k of a version (`evaluate`, `run_evaluator`).
- `records`: the evaluation log the evaluator appends to and status, curves and artifacts read.

Imports: `storage`, `streamrl.config`, the generator's engine (`streamrl.generator.engine`) and the
packages beneath them; nothing of supervision, runs or the command line.
"""
