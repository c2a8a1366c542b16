"""The `streamrl` command line: one module per group of commands.

- `main`: the parser, the process commands (`generator`, `learner`, `run`, `sweep`) and `main`,
  the console script.
- `config`: `streamrl config` and `streamrl models`, and the configuration arguments every run
  command takes.
- `evaluate`: `streamrl eval` and `streamrl export`.
- `status`: `streamrl status` and `streamrl scale`.
- `doctor`: `streamrl doctor`, what this machine can run.

Imports: anything in `streamrl` and `storage` (the top of the package's layers); nothing of
`flows`.
"""
