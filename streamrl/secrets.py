"""Which names hold credentials or say where storage is: one definition for every place that
must keep them out (reward workers' environments, the run's stored configuration).

`is_secret_name` matches a credential by its name, in any letter case: a name starting with
`AWS_`, ending with `_KEY` (or the bare `KEY` of fsspec/s3fs storage options), or containing
`TOKEN`, `SECRET` or `PASSWORD`, plus `WANDB_API_KEY`, `HF_TOKEN`, `PREFECT_API_KEY` and
`PREFECT_API_AUTH_STRING`. `is_storage_setting` matches where object storage is and how it is
reached (`AWS_*`, `FSSPEC_*`, `S3_*`, anything with `ENDPOINT`): not secret, but user code has
no business with the run's storage. Matching is by name only; a value is never inspected.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["is_secret_name", "is_storage_setting", "remove_credentials"]

_SECRET_NAMES = frozenset(
    {"KEY", "WANDB_API_KEY", "HF_TOKEN", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING"}
)
_SECRET_PARTS = ("TOKEN", "SECRET", "PASSWORD")
_STORAGE_PREFIXES = ("AWS_", "FSSPEC_", "S3_")


def is_secret_name(name: str) -> bool:
    """Whether a variable or key called `name` holds a credential (module docstring)."""
    upper = name.upper()
    return (
        upper in _SECRET_NAMES
        or upper.startswith("AWS_")
        or upper.endswith("_KEY")
        or any(part in upper for part in _SECRET_PARTS)
    )


def is_storage_setting(name: str) -> bool:
    """Whether a variable called `name` configures object storage (module docstring)."""
    upper = name.upper()
    return upper.startswith(_STORAGE_PREFIXES) or "ENDPOINT" in upper


def remove_credentials(environ: MutableMapping[str, str]) -> list[str]:
    """Delete every credential and storage setting from `environ` (e.g. `os.environ`, which
    also unsets them for child processes); returns the names removed, sorted."""
    removed = sorted(n for n in environ if is_secret_name(n) or is_storage_setting(n))
    for name in removed:
        del environ[name]
    return removed
