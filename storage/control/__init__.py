"""The run's control records: small JSON objects that say what the run is and who may write it.

- `manifest`: `run.json`, the configuration and package versions, written once.
- `requests`: what a user asks of a running run — stop markers, the fleet size.
- `lease` + `fencing`: one learner per run (an epoch lease), and the check before each write
  a second learner could clobber.
- `progress`: each generator's starts and prompt position.
- `credentials`: what a credential looks like, by name and by value, so none is stored.

Imports: `storage.fs` only.
"""
