"""streamrl: asynchronous streaming RL from verifiable rewards.

Packages, bottom up (docs/design.md, "Layers"): `config.base`; `isolation`, `algorithms`, `models`,
`data`; `rewards`, `envs`; `config` (and the sections of the components above it); `placement`,
`generator`, `learner`, `evaluation`; `supervision`; `runs`; `cli`. A package imports its own layer
and those below, and `storage`; nothing of `flows` or Prefect.
"""

__version__ = "0.1.0"
