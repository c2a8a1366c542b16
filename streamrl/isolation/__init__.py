"""Isolation of code streamrl runs but did not write, and of the processes that run it.

- `box`: the one box for model-written code (bubblewrap: a read-only system, a tmpfs scratch,
  PID and network namespaces, an unprivileged uid, rlimits, a syscall filter from `seccomp`,
  capped output; `process`: its I/O loop). No fallback: `streamrl doctor` checks it.
- `pool` + `worker`: `IsolatedPool`, the one mechanism that calls user code (rewards,
  environments, tools) in spawned worker processes, each under a time limit per call, a memory
  limit, without credentials in its environment and dead with its parent.
- `user_code`: a user's object by import path ('package.module:attribute'), checked before
  anything runs and imported only inside a worker.
- `lifetime`: process lifetimes — a child that dies with its parent, the stop event a run's
  process watches (SIGTERM, Ctrl-C).

Imports: `streamrl.config.base` and `storage.control` (what a credential looks like) only.
"""
