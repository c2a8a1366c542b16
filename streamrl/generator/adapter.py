"""The LoRA adapter a generator's engine serves (`model.lora` with `weights.lora_publish:
adapter`): one adapter id, its versions loaded in place.

vLLM runs the base model with LoRA enabled (`engine_args`) and every request carries
`AdapterSlot.request`: one adapter name and id for the whole run, so that requests in flight
keep running on the slot whatever version it holds. Before the first version the slot holds
an adapter of zeros (exactly the base model). A new version is read from the run's weight store
in the generator's process (`prepare`: a `WeightFollower`, checksums verified, deltas applied to
the version held; an adapter is MBs), written as a PEFT adapter directory, and loaded
(`load`: vLLM's `add_lora` with `load_inplace`, under the same id) while the engine is paused;
the engine then resets its prefix cache, whose blocks are keyed on the adapter's name and
would otherwise serve KV entries of the previous version.

The request's path is a link to the version loaded last: should vLLM ever reload the adapter
from its path (it does not while one adapter fits its cache), it reads the current version.
Version directories live in a temporary folder removed with the slot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from storage.weights.follower import Advance, WeightFollower
from streamrl.generator.weight_worker import WeightSource, advance_follower
from streamrl.models.lora import LoraConfig, adapter_files, vllm_max_lora_rank, zero_adapter

__all__ = ["ADAPTER_ID", "AdapterSlot"]

ADAPTER_ID = 1  # vLLM's id of the run's one adapter (ids start at 1)
_ADAPTER_NAME = "streamrl-policy"


class AdapterSlot:
    """The adapter an engine serves, and the versions it moves through."""

    def __init__(self, lora: LoraConfig, model_path: str, trust_remote_code: bool) -> None:
        from vllm.lora.request import LoRARequest

        self.lora, self.model_path = lora, model_path
        self._folder = tempfile.TemporaryDirectory(prefix="streamrl-adapter-")
        self.current = Path(self._folder.name) / "current"
        zeros = zero_adapter(model_path, lora, trust_remote_code)
        self._template = {name: tuple(value.shape) for name, value in zeros.items()}
        self._follower: WeightFollower | None = None
        self._source: WeightSource | None = None
        self._built: Path | None = None
        self._loaded = self._write("v0", zeros)
        self._point_current_at(self._loaded)
        self.request = LoRARequest(_ADAPTER_NAME, ADAPTER_ID, str(self.current))

    @staticmethod
    def engine_args(lora: LoraConfig) -> dict[str, Any]:
        """vLLM engine arguments that serve one adapter of `lora`'s rank."""
        return {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_max_lora_rank(lora.rank)}

    def prepare(
        self, source: WeightSource, newer_than: int, skip: list[int], exactly: int | None
    ) -> Advance:
        """Build the newest intact version above `newer_than` not in `skip` (or `exactly`) and
        write it as an adapter directory for `load`; what was found (corrupt or vanished
        versions are reported, never raised, as the engine's workers report them)."""
        if self._follower is None or source != self._source:
            self._follower = WeightFollower(source.open(), hold=source.hold)
            self._source = source
        found = advance_follower(self._follower, newer_than, skip, exactly)
        if found.version is not None:
            tensors = self._follower.tensors()
            self._check(tensors, found.version)
            self._built = self._write(f"v{found.version}", tensors)
            self._follower.release()
        return found

    def load(self, engine: Any) -> None:
        """Load the version `prepare` built under the slot's id, in place (`engine`: vLLM's
        `LLMEngine`, paused by the caller), and let the old version's files go."""
        from vllm.lora.request import LoRARequest

        if self._built is None:
            raise RuntimeError("AdapterSlot.load before prepare built a version")
        built, self._built = self._built, None
        engine.add_lora(LoRARequest(_ADAPTER_NAME, ADAPTER_ID, str(built), load_inplace=True))
        self._point_current_at(built)
        shutil.rmtree(self._loaded, ignore_errors=True)
        self._loaded = built

    def _check(self, tensors: dict[str, Any], version: int) -> None:
        shapes = {name: tuple(value.shape) for name, value in tensors.items()}
        if shapes != self._template:
            differ = (
                sorted(set(shapes).symmetric_difference(self._template))[:3]
                or [n for n in sorted(shapes) if shapes[n] != self._template[n]][:3]
            )
            raise ValueError(
                f"weights v{version} is not an adapter of model.lora {self.lora.model_dump()} on "
                f"{self.model_path} (names or shapes differ: {differ}); the run's learner and "
                "this generator must share model.path and model.lora"
            )

    def _write(self, name: str, tensors: dict[str, Any]) -> Path:
        folder = Path(self._folder.name) / name
        shutil.rmtree(folder, ignore_errors=True)  # a version built before and not loaded
        return adapter_files(folder, tensors, self.lora, self.model_path)

    def _point_current_at(self, folder: Path) -> None:
        link = self.current.with_name("current.new")
        link.unlink(missing_ok=True)
        link.symlink_to(folder.name)
        os.replace(link, self.current)
