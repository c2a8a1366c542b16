"""A run as its user sees it: read from its storage, never from a process.

- `status` (a run's `RunStatus` record) and `status_format` (that record as a table or a JSON
  line): `streamrl status`; `health`: the health warnings it shows (a starved learner, health
  conditions fired), for a supervisor's log too.
- `audit` (a run's `RunAudit`: nothing lost or duplicated, every object whole), `audit_format`
  and `metrics_history` (the learner records of the run's current training): `streamrl verify`.
- `curves`: learning curves as text charts and as one image.
- `samples` (reading the stream's groups, with what the learner did with each) and
  `samples_format` (for a terminal and the flow's artifact): `streamrl samples`.
- `summary`: what a finished run achieved, for the console.
- `export`: a published weight version as a Hugging Face model directory.
- `scale`: how many generators a run on work pools should have (`streamrl scale`).

Imports: `storage`, `streamrl.config`, and the records the components write
(`streamrl.learner.reporting`, `streamrl.evaluation.records`, ...); nothing of
`streamrl.supervision` or `streamrl.cli`.
"""
