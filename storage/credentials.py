"""Credentials: which names hold one, where they sit in a configuration, and keeping them out.

One rule for every place that must keep credentials away: the run's stored configuration
(run.json, control/config.json, wandb), flow-run parameters, and the environment of user code
(reward workers). Matching is by name only; a value is never inspected, except a URL that
carries a password. Secrets reach a process through its environment (or a Kubernetes secret),
never through the run's configuration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "CREDENTIAL_NAME",
    "credential_paths",
    "is_credential_name",
    "is_storage_setting",
    "remove_credentials",
    "without_credentials",
]

CREDENTIAL_NAME = (
    r"(?:aws_[\w-]*"
    r"|[\w-]*(?:secret|passw(?:or)?d|credential|auth_string|connection_string"
    r"|api_?key|private_?key|access_?key)[\w-]*"
    r"|[\w-]*token(?!s(?![a-z])|iz)[\w-]*"
    r"|(?:[\w-]*[_-])?key)"
)
"""A name (case-insensitive) that holds a credential: `AWS_*`, `*SECRET*`, `*PASSWORD*`,
`*TOKEN*` (not `max_tokens` nor `TOKENIZERS_*`), `*_KEY`, `key`, API / private / access keys
(`WANDB_API_KEY`, `HF_TOKEN`, `PREFECT_API_KEY`, `PREFECT_API_AUTH_STRING`, s3fs's `key`,
`secret`, `token`). No field of the typed run configuration matches it, so it is checked on
every key of a configuration, at any depth. A regular expression, for JSON schemas too."""

_CREDENTIAL_NAME = re.compile(CREDENTIAL_NAME, re.IGNORECASE)
_URL_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#@\s:]*:[^/?#@\s]+@", re.IGNORECASE)
_STORAGE_PREFIXES = ("AWS_", "FSSPEC_", "S3_")


def is_credential_name(name: object) -> bool:
    """Whether a configuration key or environment variable name holds a credential."""
    return bool(_CREDENTIAL_NAME.fullmatch(str(name)))


def credential_paths(value: Any, path: str = "") -> list[str]:
    """Dotted paths in `value` (mappings and lists, any depth) of credentials: keys that
    `is_credential_name`, and URLs with a password (`https://user:password@host`)."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if is_credential_name(key):
                found.append(where)
            else:
                found.extend(credential_paths(item, where))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found.extend(credential_paths(item, f"{path}.{index}" if path else str(index)))
    elif isinstance(value, str) and _URL_PASSWORD.match(value.strip()):
        found.append(path or "value")
    return found


def without_credentials(value: Any) -> Any:
    """A deep copy of `value` without the keys that `is_credential_name`, at any depth."""
    if isinstance(value, Mapping):
        return {
            str(k): without_credentials(v) for k, v in value.items() if not is_credential_name(k)
        }
    if isinstance(value, list | tuple):
        return [without_credentials(v) for v in value]
    return value


def is_storage_setting(name: str) -> bool:
    """Whether an environment variable called `name` says where object storage is or how it
    is reached (`AWS_*`, `FSSPEC_*`, `S3_*`, anything with `ENDPOINT`): not always secret, but
    user code has no business with the run's storage."""
    upper = name.upper()
    return upper.startswith(_STORAGE_PREFIXES) or "ENDPOINT" in upper


def remove_credentials(environ: MutableMapping[str, str]) -> list[str]:
    """Delete every credential and storage setting from `environ` (e.g. `os.environ`, which
    also unsets them for child processes); returns the names removed, sorted."""
    removed = sorted(n for n in environ if is_credential_name(n) or is_storage_setting(n))
    for name in removed:
        del environ[name]
    return removed
