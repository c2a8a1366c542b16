"""Running a run's processes and keeping them running.

- `policy`: the restart rules, in one place (`SupervisionPolicy`), shared by both backends.
- `supervisor`: the local backend — a run's processes on this machine (`Supervisor`), for
  `streamrl run`, the flows and `make demo` (the work-pool backend is `flows.pools`).
- `launch`: each process's command line, and running one under its placement.
- `output`: what the processes print — each line to its log file, the few a terminal shows.
- `rendezvous`: how the nodes of a multi-node learner find each other through storage.

Imports: `storage`, `streamrl.config`, `streamrl.isolation` and the components it starts only
by command line (a generator's index: `streamrl.generator.index`); nothing of `streamrl.runs`,
`streamrl.cli` or `flows`.
"""
