"""A run as its user sees it: read from its storage, never from a process.

- `status` (a run's `RunStatus` record) and `status_format` (that record as a table or a JSON
  line): `streamrl status`.
- `curves`: learning curves as text charts and as one image.
- `summary`: what a finished run achieved, for the console.
- `export`: a published weight version as a Hugging Face model directory.
- `scale`: how many generators a run on work pools should have (`streamrl scale`).

Imports: `storage`, `streamrl.config`, and the records the components write
(`streamrl.learner.reporting`, `streamrl.evaluation.records`, ...); nothing of
`streamrl.supervision` or `streamrl.cli`.
"""
