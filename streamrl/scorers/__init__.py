"""Models that score — a teacher (on-policy distillation), reward models, LLM judges — each an
OpenAI-compatible endpoint: served by the run (`serve`: vLLM's own server, placed and
supervised like a generator) or external (`config`: `scorers.<name>.url`). Generators call them
off the sampling path (`client`); the teacher gives per-token log-probs of an episode's exact
token ids (`teacher`); reward models and judges give reward terms (`terms`), a judge seeing the
response fenced and reading its verdict from one place (`judging`)."""
