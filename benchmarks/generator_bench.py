"""Generator throughput: the streaming loop (vLLM + scoring + stream writing) against plain
vLLM `generate` on the same engine, prompts and sampling settings, plus the time of a live
weight update from the weight store.

    .venv/bin/python -m benchmarks.generator_bench [--preset smollm2-cpu ...] [--seconds 60]

`--preset` may be given several times (a size preset, then a task preset such as `code`).

Raw: `LLM.generate` of a batch of prompts (n = G) at a time, back to back for `--seconds`.
Loop: `GeneratorLoop` for the same time with as many prompts in flight as the raw batch,
scoring every response with the configured reward in worker processes and committing segments
to a local run. Both count the response tokens of *finished* groups per wall-clock second.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time

import torch

from storage.fs import open_location
from storage.stream.writer import StreamReader, StreamWriter
from storage.weights.publish import WeightWriter
from streamrl.config.loading import load_config
from streamrl.data import PromptSource
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine, WeightSource
from streamrl.generator.loop import GeneratorLoop
from streamrl.models import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--preset", action="append", help="presets after dapo (default: smollm2-cpu); repeatable"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each measurement")
    args = parser.parse_args()

    # No learner consumes here: flow control would pause generation at the staleness budget.
    presets = args.preset or ["smollm2-cpu"]
    config = load_config(["dapo", *presets], overrides=["generator.flow_control=off"])
    cfg = config.generator
    model_path = resolve_model_path(config.model.path)
    engine = Engine(model_path, config.model, cfg, seed=0)
    source = PromptSource(config.data, tokenizer=engine.tokenizer)
    batch = cfg.prompts_in_flight
    print(
        f"model {config.model.path} ({config.model.dtype}), G={cfg.group_size}, "
        f"max_tokens={cfg.max_tokens}, {batch} prompts in flight, {args.seconds:.0f}s each"
    )

    # Warm-up: the first requests pay one-off costs (allocation, kernels).
    engine.generate([p.token_ids for p in source.prompts[:2]])

    from vllm.inputs import TokensPrompt

    params = engine.sampling_params()
    prompts = itertools.cycle(source.prompts)
    raw_tokens, raw_groups, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        chunk = [TokensPrompt(prompt_token_ids=next(prompts).token_ids) for _ in range(batch)]
        for output in engine.llm.generate(chunk, params, use_tqdm=False):
            raw_tokens += sum(len(c.token_ids) for c in output.outputs)
            raw_groups += 1
    raw_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        run = open_location(tmp)
        with EnvRunner.from_config(cfg.env, cfg.reward, None) as runner:
            loop = GeneratorLoop(
                config=config,
                run=run,
                engine=engine,
                prompts=source.iterate(),
                runner=runner,
                writer=StreamWriter(run, "gen0"),
                generator_id="gen0",
            )
            stop = threading.Event()
            timer = threading.Timer(args.seconds, stop.set)
            start = time.perf_counter()
            timer.start()
            stats = loop.run(stop)
            loop_s = time.perf_counter() - start
        # Steady state: groups finished after the first one, over the time between them. (The
        # loop's wall-clock rate also charges it for the groups still in flight at the stop.)
        reader = StreamReader(run).groups(timeout_s=5)
        written = [next(reader) for _ in range(stats.groups)]
        finished = sorted(written, key=lambda g: g.finished_at)
        steady_tokens = sum(g.num_tokens for g in finished[1:])
        steady_s = finished[-1].finished_at - finished[0].finished_at

        # Live weight update: publish the engine's model as version 1 and load it in place,
        # then version 2 as a delta (1% of the elements changed) onto the version held.
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, config.weights.resolved_dtype(config.model))
        state = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).state_dict()
        store, weights = WeightWriter(run), WeightSource.of(run, config.weights)
        publish_start = time.perf_counter()
        store.publish(1, state)
        publish_s = time.perf_counter() - publish_start
        update_s = engine.advance_weights(weights, exactly=1)[1]
        changed = {name: _changed(tensor, 0.01) for name, tensor in state.items()}
        store.publish(2, changed, base=(1, state))
        delta_update_s = engine.advance_weights(weights, exactly=2)[1]

    raw_rate, loop_rate = raw_tokens / raw_s, stats.tokens / loop_s
    print("\n| measurement | groups | tokens | seconds | tokens/s | groups/s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| plain vLLM generate | {raw_groups} | {raw_tokens} | {raw_s:.1f} | "
        f"{raw_rate:.1f} | {raw_groups / raw_s:.2f} |"
    )
    print(
        f"| generator loop | {stats.groups} | {stats.tokens} | {loop_s:.1f} | "
        f"{loop_rate:.1f} | {stats.groups / loop_s:.2f} |"
    )
    print(
        f"| generator loop, steady state | {len(finished) - 1} | {steady_tokens} | "
        f"{steady_s:.1f} | {steady_tokens / steady_s:.1f} | {(len(finished) - 1) / steady_s:.2f} |"
    )
    print(
        f"\nloop / raw tokens/s: {loop_rate / raw_rate:.3f} wall clock, "
        f"{steady_tokens / steady_s / raw_rate:.3f} steady state"
    )
    print(
        f"weight update ({sum(t.numel() for t in state.values()) / 1e6:.0f}M parameters): "
        f"publish {publish_s:.2f}s; generator update {update_s:.2f}s, from a 1% delta "
        f"{delta_update_s:.2f}s (workers read + verify + in-place reload + lm_head re-pack + "
        "prefix-cache reset)"
    )
    print(
        f"loop: {stats.segments} segments, "
        f"reward mean {stats.reward_sum / max(stats.responses, 1):.3f}, "
        f"accuracy {stats.correct / max(stats.responses, 1):.3f}"
    )


def _changed(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    """A copy of `tensor` with every (1/fraction)-th element nudged: the same elements of tied
    tensors, so they stay equal."""
    out = tensor.clone()
    out.view(-1)[:: round(1 / fraction)] += 1e-3
    return out


if __name__ == "__main__":
    main()
