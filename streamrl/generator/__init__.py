"""Generators: vLLM engines that sample, score and stream groups for the learner.

- `config`: the `generator` section.
- `main`: one generator process (`run_generator`, what `streamrl generator` runs;
  `build_generator`).
- `loop`: the generator loop (prompts in, scored groups out to the replay stream).
- `rollouts`: every group's episodes through the engine and the environment (`EpisodeDriver`);
  `transcript`: one response's exact token history; `records`: a finished rollout as a stream
  record (how observations become tokens is `streamrl.envs.chat`).
- `agent_episodes`: a user's agent driving its episodes (`generator.env.agent`) through the
  `endpoint` (OpenAI-compatible chat completions on 127.0.0.1), its requests matched to the
  episode's token history by `agent_chat` (`agent_requests`: what a request must be on arrival;
  `agent_messages`: its sampling and messages read; `agent_replies`: the sampled turn answered).
- `engine`: the vLLM engine and loading published weights into it (`weight_worker`).
- `failures`: the user's code failing as a restart would (the same way from the start, or
  agents that never sample): the generator stops, not restarted.
- `group_size`: how many responses each prompt gets (fixed, or adaptive: eq 27).
- `flow_control`: how many prompts may be in flight; `progress`: each index's prompt position.

Imports: `storage`, `streamrl.config`, the packages beneath it (`algorithms`, `data`, `models`,
`envs`, `rewards`, `isolation`), the learner's section (`streamrl.learner.config`) and its share
of a shared GPU (`streamrl.placement.gpu_memory`); nothing of supervision, runs or the command
line.
"""
