"""What every configuration section shares: the `Section` base class, the bounds of its
fields, the core-list type of every `*.cpu_cores` field (`CoreSetting`: a count, or a list
such as '0-3,8'), and `ConfigError`, the error a user must fix.

Each component's section is defined beside its code (`streamrl.learner.config`,
`streamrl.generator.config`, ...); `streamrl.config.run.RunConfig` joins them and holds the rules
that span components; `streamrl.config.loading` builds one from presets, files and overrides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    model_validator,
)

from storage.control.credentials import credential_paths

__all__ = [
    "MAX_CORES",
    "MAX_SEED",
    "MAX_SEQUENCE_TOKENS",
    "MAX_STEPS",
    "MAX_WAIT_S",
    "AdamBeta",
    "ConfigError",
    "CoreSetting",
    "Section",
    "credentials_problem",
    "format_cores",
    "parse_cores",
    "tag_or",
    "tagged_classes",
]

MAX_WAIT_S = 30 * 24 * 3600.0
"""The longest duration any `*_s` field takes (30 days): far below `threading.TIMEOUT_MAX`,
the longest timeout a lock, event or queue wait accepts."""
MAX_SEQUENCE_TOKENS = 2**20
"""The longest prompt, response or sequence in tokens any length field takes."""
MAX_SEED = 2**31 - 1
"""The largest seed: every RNG streamrl seeds (Python, NumPy, torch, vLLM) takes it."""
MAX_STEPS = 10**9
"""The largest step, version or interval count."""

# An Adam moment decay: 1 would never forget (and divide by zero in the bias correction).
AdamBeta = Annotated[float, Field(ge=0.0, lt=1.0)]


def tag_or(field: str, default: str) -> Discriminator:
    """A discriminated union's discriminator on `field`, `default` when a block leaves it out
    (so `correction: {is_cap: 3}` means the default method)."""

    def tag(value: Any) -> str:
        if isinstance(value, Mapping):
            return str(value.get(field, default))
        return str(getattr(value, field, default))

    return Discriminator(tag)


def tagged_classes(union: Any, field: str) -> dict[str, type[BaseModel]]:
    """The classes of a discriminated union (`Annotated[A | Annotated[B, Tag(...)] | ...,
    discriminator]`) by their tag: each class's default of `field`, so the union is the one
    place its members are listed."""
    members = get_args(get_args(union)[0]) if get_origin(union) is Annotated else get_args(union)
    classes = (get_args(m)[0] if get_origin(m) is Annotated else m for m in members)
    return {cls.model_fields[field].default: cls for cls in classes}


class ConfigError(ValueError):
    """A configuration the user must fix. `problems` holds one line per problem."""

    def __init__(self, problems: Sequence[str], source: str = "configuration") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {source}:\n{lines}")


class Section(BaseModel):
    """A configuration section: unknown fields refused, every float finite (no inf or nan,
    whatever its bounds), and no credentials anywhere in it (`_no_credentials`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    older_fields: ClassVar[tuple[str, ...]] = ()
    """Older spellings it still reads (suggested for a misspelt field like its own)."""

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and (found := credential_paths(data)):
            raise ValueError(credentials_problem(found))
        return data


def credentials_problem(paths: Sequence[str]) -> str:
    """What to do about credentials found in a configuration at `paths` (never their values)."""
    return (
        f"credentials do not belong in the configuration ({', '.join(paths)}): it is stored in "
        "run.json and control/config.json and shown in wandb and in flow-run parameters. "
        "Remove them and give them to the processes as environment variables (AWS_ACCESS_KEY_ID "
        "/ AWS_SECRET_ACCESS_KEY or an AWS profile for S3, WANDB_API_KEY, HF_TOKEN) or, on "
        "work pools, through the pool's Kubernetes secret (deploy/README.md); the S3 endpoint "
        "is storage.endpoint_url"
    )


MAX_CORES = 65536
"""CPU core counts and core numbers are below this."""


def parse_cores(text: str) -> list[int]:
    """'0-3,8' → [0, 1, 2, 3, 8] (sorted, each core once)."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{text!r} is not a core list like '0-3,8'")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"core range {part!r} runs backwards; write {last}-{first}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"{text!r} names no core; write a core list like '0-3,8' or a count")
    return sorted(cores)


def format_cores(cores: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] → '0-3,8' (the form taskset and VLLM_CPU_OMP_THREADS_BIND read)."""
    ranges: list[str] = []
    ordered = sorted(set(cores))
    start = prev = ordered[0] if ordered else 0
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(ranges) if ordered else ""


def _core_setting(value: Any) -> Any:
    """A count (4, "4") or a core list ("0-3,8", [0, 1, 2, 3, 8]) → int or sorted list."""
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else parse_cores(value)
    if isinstance(value, bool):
        raise ValueError("give a core count (4) or a core list ('0-3,8'), not true/false")
    if isinstance(value, int) and not 1 <= value < MAX_CORES:
        raise ValueError(
            f"a core count must be ≥ 1 and < {MAX_CORES}, got {value}; null picks cores "
            "automatically"
        )
    if isinstance(value, list):
        if not value or any(not isinstance(c, int) or not 0 <= c < MAX_CORES for c in value):
            raise ValueError(f"a core list holds core numbers ≥ 0 and < {MAX_CORES}, got {value}")
        value = sorted(set(value))
    return value


CoreSetting = Annotated[int | list[int] | None, BeforeValidator(_core_setting)]
"""CPU cores of a component: null (automatic), a count, or a core list ("0-3,8")."""
