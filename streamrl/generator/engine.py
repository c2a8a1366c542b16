"""vLLM as a streaming sampler: continuous batching, fp32 behaviour log-probs, live weights.

The engine is vLLM's own `LLMEngine` (built through `vllm.LLM`), driven request by request:
`submit` adds a prompt with n = G samples, `step` advances every request in flight by one
scheduler step and returns the groups that finished. Nothing waits for a whole batch.

Behaviour log-probs are vLLM's *processed* log-probs of each sampled token — log-softmax of
the logits after temperature — i.e. exactly the distribution the token was drawn from, returned
in fp32. (Top-k / top-p would renormalise them over a truncated set the learner does not score;
the configuration refuses them.)

Live weight update (`advance_weights`) is one sequence whether vLLM's engine core runs in this
process (the CPU default) or in a process of its own (the CUDA default, where it steps on its
own between our calls), with one worker or tensor-parallel ones. Every worker first builds the
version from the run's weight store itself (`streamrl.generator.weight_worker`: reads, verifies,
applies deltas to the version it holds); only small values cross vLLM's RPC, never a state
dict. (vLLM runs such a call between engine steps, so no step runs while the workers read.)
Then: pause scheduling with the requests kept
(`sleep(level=0, mode="keep")`: no step runs until resumed), load the built tensors in place in
every worker (`model_runner.reload_weights`; a tied lm_head is re-packed, vLLM's CPU backend
keeps a packed copy of it for its GEMM), reset the prefix cache *including running requests*,
resume. No step ever runs new weights over KV entries of the old ones: requests in flight are
recomputed with the new weights. The version is also vLLM's weight-version label
(`set_weight_version`, set while paused): the engine core stamps every step's output with it, so
each sampled token records the version that produced it (`Completion.versions`), exactly, whether
the core runs in this process or its own; a group's version is the oldest of them.

LoRA runs that publish adapters (`RunConfig.served_adapter`): vLLM runs the base with LoRA
enabled, every request carries the run's one adapter (`streamrl.generator.adapter.AdapterSlot`),
and a new version is built by the slot in this process (an adapter is MBs) and loaded in place
under the same adapter id, in the same pause → load → reset prefix cache → resume sequence.

Seeds: generator `index` of a run, on its `start`-th start, is seeded `generator_seed(...)`, a
63-bit hash, so restarts never replay a random stream. The engine (`LLM(seed=...)`, all that
vLLM's CPU backend supports: per-request seeds fail there) gets it modulo 2^32; on CUDA request
k also gets `request_seed(seed, k, G)`, spaced G apart because vLLM seeds sample i with
seed + i — so no two samples share a seed. With adaptive group size (`generator.adaptive_group`)
requests ask for different n: they are spaced by the largest n any may ask for
(`GeneratorConfig.largest_group_size`), and a request asking for more is refused.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from storage.weights.follower import Advance
from storage.weights.versions import WeightIntegrityError, WeightVersionNotFoundError
from streamrl.generator.adapter import AdapterSlot
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.weight_worker import WeightReloadExtension, WeightSource
from streamrl.models.config import ModelConfig
from streamrl.models.lora import LoraConfig
from streamrl.placement.gpu_memory import engine_memory_utilization

__all__ = [
    "Completion",
    "Engine",
    "FinishedGroup",
    "WeightReloadExtension",
    "WeightSource",
    "configure_cpu_environment",
    "cpu_environment",
    "generator_seed",
    "request_seed",
    "use_cuda",
]

SEED_MODULUS = 2**63  # request seeds stay below it; sample seeds (+ i < G) below 2^64
_ENGINE_SEED_MODULUS = 2**32  # LLM(seed=...) seeds numpy, which takes 32 bits
_WORKER_EXTENSION = f"{WeightReloadExtension.__module__}.{WeightReloadExtension.__name__}"


def use_cuda(device: str) -> bool:
    """Whether `device` ('auto' | 'cpu' | 'cuda') means a CUDA vLLM here."""
    if device == "cuda":
        return True
    return device == "auto" and torch.cuda.is_available()


def generator_seed(base_seed: int, index: int, start: int) -> int:
    """The seed of generator `index` on its `start`-th start (1 = first) in a run seeded
    `base_seed`: a 63-bit hash, so generators and restarts draw unrelated random streams."""
    key = f"streamrl-generator:{base_seed}:{index}:{start}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % SEED_MODULUS


def request_seed(engine_seed: int, request: int, group_size: int) -> int:
    """The seed of request number `request` (0-based) of an engine seeded `engine_seed`.

    vLLM seeds sample i of a request with seed + i, so requests are spaced `group_size` apart
    (the most samples any request of the engine asks for): within one engine every (request,
    sample) seed is distinct; two engines' seeds (63-bit hashes) meet only if they land within
    group_size × requests of each other."""
    return (engine_seed + request * group_size) % SEED_MODULUS


def cpu_environment(
    kv_cache_gib: int, cores: str | None = None, *, engine_process: bool = False
) -> dict[str, str]:
    """vLLM's CPU-backend environment: KV-cache size, OpenMP thread binding (the placement's
    `VLLM_CPU_OMP_THREADS_BIND` when set, else `cores`, else the cores this process may use),
    and whether the engine core runs in a process of its own (`engine_process`)."""
    if cores is None:
        allowed = sorted(os.sched_getaffinity(0))
        cores = ",".join(str(c) for c in allowed)
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if engine_process else "0",
    }


def configure_cpu_environment(
    kv_cache_gib: int, cores: str | None = None, *, engine_process: bool = False
) -> None:
    """Set vLLM's CPU-backend environment in this process (before vllm is imported):
    `cpu_environment`'s."""
    os.environ.update(cpu_environment(kv_cache_gib, cores, engine_process=engine_process))


@dataclass(frozen=True)
class Completion:
    """One sampled response: tokens, their behaviour log-probs and the weight version that
    sampled each (same length), decoded text."""

    token_ids: np.ndarray  # [L] int32
    logprobs: np.ndarray  # [L] float32
    text: str
    finish_reason: str
    versions: np.ndarray  # [L] int64

    @property
    def truncated(self) -> bool:
        """Stopped by max_tokens rather than by EOS or a stop string."""
        return self.finish_reason == "length"


@dataclass(frozen=True)
class FinishedGroup:
    """All G completions of one submitted prompt."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    policy_version: int  # the oldest weights that sampled any of its tokens
    submitted_at: float


class Engine:
    """A vLLM engine sampling G responses per prompt with live weight updates."""

    def __init__(
        self,
        model_path: str,
        model: ModelConfig,
        generator: GeneratorConfig,
        *,
        seed: int | None = None,
        policy_version: int = 0,
        adapter: LoraConfig | None = None,
    ) -> None:
        self.cuda = use_cuda(generator.device)
        if not self.cuda:
            configure_cpu_environment(
                generator.cpu_kv_cache_gib, engine_process=generator.cpu_engine_process
            )
        from vllm import LLM  # after the environment is set

        from streamrl.models import resolve_model_path

        self.generator = generator
        self.seed = generator.seed if seed is None else seed
        engine_args: dict[str, Any] = {
            "model": model_path,
            "tokenizer": resolve_model_path(model.tokenizer) if model.tokenizer else model_path,
            "dtype": model.dtype,
            "max_model_len": model.max_model_len,
            "seed": self.seed % _ENGINE_SEED_MODULUS,
            "trust_remote_code": model.trust_remote_code,
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": generator.enforce_eager or not self.cuda,
            "worker_extension_cls": _WORKER_EXTENSION,
        }
        if self.cuda:
            utilization = engine_memory_utilization(generator.gpu_memory_utilization)
            engine_args["gpu_memory_utilization"] = utilization
            engine_args["tensor_parallel_size"] = generator.tensor_parallel_size
        self.adapter: AdapterSlot | None = None
        if adapter is not None:  # versions are LoRA adapters, loaded into one slot
            self.adapter = AdapterSlot(adapter, model_path, model.trust_remote_code)
            engine_args.update(AdapterSlot.engine_args(adapter))
        self.llm = LLM(**engine_args)
        self._engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self.policy_version = policy_version
        self._engine.set_weight_version(str(policy_version))
        # Where the last version loaded came from: "storage", or "handoff" (the learner's memory)
        self.weights_from = "storage"
        self._in_flight: dict[str, tuple[list[int], int, float]] = {}
        self._next_request = 0

    # -- sampling ----------------------------------------------------------------------------

    def sampling_params(
        self,
        request_seed: int | None = None,
        *,
        greedy: bool = False,
        n: int | None = None,
        max_tokens: int | None = None,
    ) -> Any:
        """n = G samples (or `n`) with the configured sampling (or one greedy response), at most
        `max_tokens` (default `generator.max_tokens`), with the fp32 log-prob of each sampled
        token."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        cfg = self.generator
        return SamplingParams(
            n=1 if greedy else (n or cfg.group_size),
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0 if greedy else cfg.top_p,
            top_k=0 if greedy else cfg.top_k,
            max_tokens=max_tokens or cfg.max_tokens,
            stop=list(cfg.stop) or None,
            logprobs=0,
            seed=request_seed if self.cuda else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        request_id: str | None = None,
        *,
        greedy: bool = False,
        n: int | None = None,
        max_tokens: int | None = None,
    ) -> str:
        """Start sampling G responses (or `n` ≤ `generator.largest_group_size`, or one greedy
        one, each at most `max_tokens`) to a tokenised prompt; returns its request id."""
        from vllm.inputs import TokensPrompt

        spacing = self.generator.largest_group_size
        if n is not None and n > spacing:  # its samples' seeds would meet the next request's
            raise ValueError(
                f"a request of {n} samples exceeds the {spacing} this engine spaces request "
                "seeds by (generator.group_size, or adaptive_group's G_max)"
            )
        if request_id is None:
            request_id = f"r{self._next_request}"
        seed = request_seed(self.seed, self._next_request, spacing)
        self._next_request += 1
        ids = [int(t) for t in prompt_token_ids]
        params = self.sampling_params(
            seed if self.cuda else None, greedy=greedy, n=n, max_tokens=max_tokens
        )
        self._engine.add_request(
            request_id,
            TokensPrompt(prompt_token_ids=ids),
            params,
            lora_request=None if self.adapter is None else self.adapter.request,
        )
        self._in_flight[request_id] = (ids, self.policy_version, time.time())
        return request_id

    @property
    def num_in_flight(self) -> int:
        """Prompts submitted whose groups have not finished."""
        return len(self._in_flight)

    def step(self) -> list[FinishedGroup]:
        """One engine step; the groups that finished in it."""
        finished = []
        for output in self._engine.step():
            if not output.finished or output.request_id not in self._in_flight:
                continue
            prompt_ids, version, submitted_at = self._in_flight.pop(output.request_id)
            completions = [
                Completion(
                    token_ids=np.asarray(c.token_ids, dtype=np.int32),
                    logprobs=_sampled_logprobs(c.token_ids, c.logprobs),
                    text=c.text,
                    finish_reason=str(c.finish_reason),
                    versions=_token_versions(len(c.token_ids), c.weight_versions, version),
                )
                for c in sorted(output.outputs, key=lambda c: c.index)
            ]
            sampled = [int(c.versions.min()) for c in completions if len(c.versions)]
            version = min(sampled, default=version)
            finished.append(
                FinishedGroup(output.request_id, prompt_ids, completions, version, submitted_at)
            )
        return finished

    def abort(self, request_id: str) -> None:
        """Drop one request in flight (an agent episode that ended while it was sampled)."""
        if self._in_flight.pop(request_id, None) is not None:
            self._engine.abort_request([request_id])

    def abort_all(self) -> int:
        """Drop every request in flight (their groups are lost); how many there were."""
        request_ids = list(self._in_flight)
        if request_ids:
            self._engine.abort_request(request_ids)
        self._in_flight.clear()
        return len(request_ids)

    def generate(
        self, prompts: Iterable[Sequence[int]], *, greedy: bool = False
    ) -> list[FinishedGroup]:
        """Submit `prompts` and step until all of them finished (evaluation, tests, benchmarks)."""
        ids = [self.submit(p, greedy=greedy) for p in prompts]
        done: dict[str, FinishedGroup] = {}
        while len(done) < len(ids):
            done.update((g.request_id, g) for g in self.step())
        return [done[i] for i in ids]

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Shut vLLM's engine down now (idempotent): its workers, its KV cache and the
        torch.distributed group its core process joined. Left to the garbage collector instead,
        an in-process core (the CPU default) is shut down whenever its client is collected,
        and its shutdown destroys the process's default group, whoever initialised that by
        then."""
        self._in_flight.clear()
        self._engine.engine_core.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- weights -----------------------------------------------------------------------------

    def advance_weights(
        self,
        source: WeightSource,
        *,
        newer_than: int | None = None,
        skip: Collection[int] = (),
        exactly: int | None = None,
    ) -> tuple[Advance, float]:
        """Move to the newest intact version of `source` above `newer_than` (default: the
        engine's version) and not in `skip` — or to `exactly` that version — loading it in
        place, atomically for the requests in flight; what happened and the seconds taken,
        reading included.

        Every worker reads and verifies the version before the engine pauses, so a corrupt,
        vanished or missing version leaves the engine untouched: versions found corrupt or
        vanished on the way are reported in the `Advance` (whose `version` is None when nothing
        was loaded). `exactly` a version that cannot be built raises `WeightIntegrityError` or
        `WeightVersionNotFoundError`. Requests in flight are recomputed with the new weights;
        their tokens so far keep the version that sampled them."""
        start = time.perf_counter()
        found = self._prepare(
            source,
            self.policy_version if newer_than is None else newer_than,
            sorted(skip),
            exactly,
        )
        if exactly is not None and found.version is None:
            if exactly in found.corrupt:
                raise WeightIntegrityError(found.corrupt[exactly])
            raise WeightVersionNotFoundError(
                f"weight version {exactly} of {source.run_uri} has no manifest or vanished "
                "while it was read (removed by weight retention)"
            )
        if found.version is not None:
            self._engine.sleep(level=0, mode="keep")  # pause: requests stay, no step runs
            try:
                if self.adapter is not None:
                    self.adapter.load(self._engine)
                    self.weights_from = "storage"
                else:
                    sources = set(self.llm.collective_rpc("apply_streamrl_weights"))
                    self.weights_from = sources.pop() if len(sources) == 1 else "storage"
                self._engine.reset_prefix_cache(reset_running_requests=True)
                self._engine.set_weight_version(str(found.version))
            finally:
                self._engine.wake_up(tags=["scheduling"])  # resume
            self.policy_version = found.version
        return found, time.perf_counter() - start

    def _prepare(
        self, source: WeightSource, newer_than: int, skip: list[int], exactly: int | None
    ) -> Advance:
        """Have every worker build the version (they must agree on which one), or the adapter
        slot build the adapter version."""
        if self.adapter is not None:
            return self.adapter.prepare(source, newer_than, skip, exactly)
        found = reports = self._prepare_workers(source, newer_than, skip, exactly)
        if len({f.version for f in found}) > 1 and exactly is None:
            # Workers list the versions one after another: one committed in between is seen by
            # some of them only. All move to the newest one a worker could build.
            newest = max(f.version for f in found if f.version is not None)
            found = self._prepare_workers(source, newer_than, skip, newest)
            reports = reports + found
        built = {f.version for f in found}
        if len(built) > 1:
            raise RuntimeError(
                f"the engine's workers built different weight versions ({sorted(built, key=str)})"
                f" from {source.run_uri}: a version was deleted while they read it (keep "
                "weights.keep_versions at 2 or more) or the workers see different storage (give "
                f"them the same credentials). The engine keeps version {self.policy_version}"
            )
        corrupt = {v: why for f in reports for v, why in f.corrupt.items()}
        vanished = sorted({v for f in reports for v in f.vanished})
        return Advance(built.pop(), corrupt, vanished)

    def _prepare_workers(
        self, source: WeightSource, newer_than: int, skip: list[int], exactly: int | None
    ) -> list[Advance]:
        """What each worker's `prepare_streamrl_weights` did."""
        results = self.llm.collective_rpc(
            "prepare_streamrl_weights", args=(asdict(source), newer_than, skip, exactly)
        )
        return [Advance(**result) for result in results]


def _sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> np.ndarray:
    """fp32 log-prob of each sampled token from vLLM's per-position dicts."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    return np.fromiter(
        (lp[t].logprob for t, lp in zip(token_ids, logprobs, strict=True)),
        dtype=np.float32,
        count=len(token_ids),
    )


def _token_versions(length: int, spans: Any, submitted: int) -> np.ndarray:
    """`[length] int64`: the weight version that sampled each token, from vLLM's spans (the
    version labels this engine set); the version at submission where vLLM gave none."""
    versions = np.full(length, submitted, dtype=np.int64)
    for span in spans or ():
        versions[span.start : span.end] = int(span.version)
    return versions
