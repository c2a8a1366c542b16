"""The run's configuration.

- `base`: what every section shares — `Section`, the bounds and types of fields
  (`CoreSetting`), `ConfigError`. The bottom layer of `streamrl`: every section imports it.
- `merge`: `deep_merge`, how layered configurations combine.
- `run`: `RunConfig`, every component's section joined, with the rules that span components;
  `StorageConfig`, where the run lives.
- `loading`: a `RunConfig` from presets (`streamrl/presets/`), files and overrides.
- `stored`: a run's configuration in its storage — `run.json` created or checked on resume,
  the current configuration every process reads, the trusted fields.

Each component's own section is defined beside it (`streamrl.<package>.config`).

Imports: `base` and `merge` import only `storage`; the rest imports the sections and the
packages beneath the configuration (`algorithms`, `models`, `data`, `isolation`, `rewards`,
`envs`), never the components that read a `RunConfig` (`generator`, `learner`, ...).
"""
