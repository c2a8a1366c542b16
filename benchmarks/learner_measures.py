"""What `benchmarks.learner_bench` measures besides time: a phase process's memory (resident
set size on CPU, the CUDA caching allocator's allocated bytes on a GPU) and the model FLOPs of a
batch, for MFU against a stated peak.

Model FLOPs (PaLM's estimate, appendix B): a training token of a row of S tokens costs
6·N + 12·L·H·S, N the parameters that multiply (the input embedding is a lookup: it counts only
when tied to the LM head, which multiplies), L layers, H hidden size; the attention term counts
the full S×S score matrix, not its causal half. The work of a step is that of one row per
response (its prompt, then the response), unpadded, whatever rows a path actually runs: every
phase is credited the same FLOPs for the same batch, so MFU ratios are speed ratios.
"""

from __future__ import annotations

import json
import math
import os
import resource
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from storage.stream.records import ScoredGroup

MB = 1e6

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of
# `torch.cuda.get_device_name()`; the first match wins, so the specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)


def default_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name` (SXM figures for H100/H200), or None
    when it is not in `PEAK_BF16_TFLOPS` (then MFU needs `--peak-tflops`)."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


# -- model FLOPs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs estimate needs of a causal LM: multiplying parameters N, layers L,
    hidden size H."""

    params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model_dir: str) -> ModelShape:
        """From the model directory's config, with the model built on the meta device."""
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())  # a tied weight counts once
        embedding = model.get_input_embeddings().weight
        if embedding is not model.get_output_embeddings().weight:
            params -= embedding.numel()  # a lookup, no multiplies
        return cls(params, config.num_hidden_layers, config.hidden_size)

    def row_flops(self, length: int) -> float:
        """Forward + backward FLOPs of one row of `length` tokens."""
        return length * (6.0 * self.params + 12.0 * self.layers * self.hidden * length)

    def batch_flops(self, groups: Sequence[ScoredGroup]) -> float:
        """The work of a batch: one row per response, its prompt then the response."""
        return sum(
            self.row_flops(len(group.prompt_tokens) + len(response))
            for group in groups
            for response in group.response_tokens
        )

    def describe(self) -> str:
        return (
            f"model FLOPs per token of a row of S tokens = 6·N + 12·L·H·S with N = "
            f"{self.params / 1e6:.4g} M multiplying parameters, L = {self.layers}, "
            f"H = {self.hidden} (PaLM's estimate: full S×S attention; one unpadded row per "
            "response, the same work credited to every phase)"
        )


# -- memory --------------------------------------------------------------------------------


class RssSampler:
    """This process's RSS every `interval_s` (from `/proc/self/statm`) in a daemon thread;
    `peak(windows)` is the largest sample taken inside any of the `(start, end)` windows."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as statm:
            while not self._stop.is_set():
                statm.seek(0)
                self.samples.append((time.perf_counter(), int(statm.read().split()[1]) * page))
                self._stop.wait(self.interval_s)

    def now(self) -> int:
        time.sleep(2 * self.interval_s)
        return self.samples[-1][1]

    def peak(self, windows: list[tuple[float, float]]) -> int:
        inside = [rss for t, rss in self.samples if any(a <= t <= b for a, b in windows)]
        return max(inside, default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class RssMeter:
    """CPU memory of a phase: RSS sampled every 5 ms, split into training and publishing
    windows, and the process's exact high-water mark (`ru_maxrss`)."""

    kind = "RSS"

    def __init__(self) -> None:
        self.sampler = RssSampler()
        self.setup_bytes = 0
        self.train_windows: list[tuple[float, float]] = []
        self.publish_windows: list[tuple[float, float]] = []

    def set_up(self) -> None:
        """Call once the phase's models and optimiser exist."""
        self.setup_bytes = self.sampler.now()

    def begin_step(self) -> None:
        pass

    def end_step(self, train: tuple[float, float], publish: tuple[float, float] | None) -> None:
        """`train` (and `publish`): `perf_counter` windows of the step just done."""
        self.train_windows.append(train)
        if publish is not None:
            self.publish_windows.append(publish)

    def figures(self, warmup: int) -> dict[str, Any]:
        """In MB: after set-up, peak while training and publishing (measured steps), and the
        high-water mark of the whole process."""
        self.sampler.stop()
        return {
            "mem_kind": self.kind,
            "mem_setup_MB": self.setup_bytes / MB,
            "mem_train_MB": self.sampler.peak(self.train_windows[warmup:]) / MB,
            "mem_publish_MB": self.sampler.peak(self.publish_windows[warmup:]) / MB,
            "mem_high_water_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB,
        }


class CudaMeter:
    """GPU memory of a phase: bytes the caching allocator has handed out
    (`torch.cuda.memory_allocated`) after set-up, and its peak over each step. A step's peak
    spans training and, in the learner, the publish's snapshot (one reset per step).

    The phase processes share one GPU, so after each step (untimed) a phase returns its cached
    blocks to the driver (`empty_cache`) for the next phase's step to use."""

    kind = "CUDA allocated"

    def __init__(self) -> None:
        self.setup_bytes = 0
        self.peaks: list[int] = []

    def set_up(self) -> None:
        torch.cuda.synchronize()
        self.setup_bytes = torch.cuda.memory_allocated()

    def begin_step(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def end_step(self, train: tuple[float, float], publish: tuple[float, float] | None) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())
        torch.cuda.empty_cache()

    def figures(self, warmup: int) -> dict[str, Any]:
        """In MB: after set-up, the peak of the measured steps, and that of every step."""
        return {
            "mem_kind": self.kind,
            "mem_setup_MB": self.setup_bytes / MB,
            "mem_train_MB": max(self.peaks[warmup:], default=0) / MB,
            "mem_publish_MB": float("nan"),  # inside the step's peak
            "mem_high_water_MB": max(self.peaks, default=0) / MB,
        }


def memory_meter(device: str) -> RssMeter | CudaMeter:
    """The meter for `learner.device` (cpu or cuda)."""
    return CudaMeter() if device == "cuda" else RssMeter()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer stopped after it counts it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    """A line naming the device a phase runs on."""
    if device == "cuda":
        name = torch.cuda.get_device_name(torch.cuda.current_device())
        return f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def figures_json(figures: Any) -> str:
    """`figures` as JSON with every NaN or infinity written as null (JSON has neither)."""

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(v) for key, v in value.items()}
        if isinstance(value, list | tuple):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(figures), indent=1, allow_nan=False)
