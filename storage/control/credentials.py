"""Credentials: which names hold one, which strings carry one, and keeping them out.

One rule for every place that must keep credentials away: the run's stored configuration
(run.json, control/config.json, wandb), flow-run parameters and job variables. A credential is
found two ways: by the name it is stored under (`is_credential_name`: `HF_TOKEN`, `DB_PASS`,
s3fs's `secret`), and inside any string, whatever its name (`carries_credentials`): a URL with
a user or password before its host (`https://user:pass@host`, `https://TOKEN@host`) or with a
signature or secret query parameter (a presigned URL's `X-Amz-Signature`, `sig=`, `token=`).
Secrets reach a process through its environment (or a Kubernetes secret), never through the
run's configuration. User code (reward and environment workers) gets an environment built from
an allowlist instead (`streamrl.isolation.worker.WORKER_ENVIRONMENT`): names it needs, each
checked against `is_credential_name` and `is_storage_setting` too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CREDENTIAL_NAME",
    "CREDENTIAL_URL",
    "carries_credentials",
    "credential_paths",
    "is_credential_name",
    "is_storage_setting",
    "without_credentials",
]

_COUNTED = (
    "max|min|new|num|n|total|batch|chunk|episode|observation|prompt|response|sequence|seq"
    "|context|input|output|special|stop|added|extra|generated|reserved|eos|pad|step"
)
"""Words before `_tokens` in a count or a list of text tokens (`max_new_tokens`,
`micro_batch_tokens`, `stop_tokens`), never a credential."""

CREDENTIAL_NAME = (
    r"(?:aws_[\w-]*"
    r"|[\w-]*(?:secret|passw(?:or)?d|passphrase|credential|authorization|auth_string"
    r"|connection_string|api_?key|private_?key|access_?key)[\w-]*"
    r"|[\w-]*(?<![a-z])(?:pass|pat|creds?)(?![a-z])[\w-]*"
    r"|[\w-]*token(?!s(?![a-z])|iz)[\w-]*"
    rf"|(?:[\w-]*[_-])?(?!(?:{_COUNTED})[_-]tokens)[a-z0-9]+[_-]tokens"
    r"|(?:[\w-]*[_-])?key)"
)
"""A name (case-insensitive) that holds a credential: `AWS_*`; `*SECRET*`, `*PASSWORD*`,
`*PASSWD*`, `*PASSPHRASE*`, `*CREDENTIAL*`, `*AUTHORIZATION*`; `PASS`, `PAT` (a personal access
token) and `CRED(S)` as a word of the name (`DB_PASS`, `GH_PAT`, `MY_CREDS`, not `path`,
`patience`, `bypass`, `credit`); `*TOKEN*` (not `TOKENIZERS_*` nor `tokenizer`) and `*_TOKENS`
unless it counts tokens (`HF_TOKENS`, not `max_tokens`, `micro_batch_tokens`: `_COUNTED`);
`*_KEY`, `key`; API / private / access keys (`WANDB_API_KEY`, `PREFECT_API_AUTH_STRING`, s3fs's
`key`, `secret`, `token`). No field of the typed run configuration matches it, so it is checked
on every key of a configuration, at any depth. A regular expression that needs the
case-insensitive flag, for JSON schemas too: Python's syntax (fixed-width look-behinds)."""

_URL_START = r"(?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://"
_NAME_BEFORE_AT = r"(?:ssh|sftp|scp|git|git\+ssh|ssh\+git|svn\+ssh|abfss?|az|wasbs?|hf)://"
_SIGNATURE = r"(?:[\w-]*[_-])?sig(?:nature)?"

_URL_CREDENTIALS = {
    # `user:password@` in front of the host, even a password with a '/' in it
    # (`https://KEY:secret/with/slash@host`); not a port (`http://host:8080/@alice`).
    "a URL with a password": rf"{_URL_START}[^\s/?#@:\[]*:(?!\d+(?:[/?#\s]|$))[^\s@]*@",
    # `TOKEN@` in front of the host (`https://ghp_x@github.com`), but not where a scheme puts a
    # login name, an Azure container or a Hugging Face revision there (`ssh://git@host`,
    # `abfs://container@account...`, `hf://gpt2@main`).
    "a URL with a user name or token": rf"(?!{_NAME_BEFORE_AT}){_URL_START}[^\s/?#@:]+@",
    # a presigned URL's `X-Amz-Signature`, `X-Amz-Credential`, Azure's `sig`, `token`, `key`
    "a URL with a signature or a secret in its query": (
        rf"{_URL_START}[^\s?#]*[?#](?:\S*?[&;#])?(?:{CREDENTIAL_NAME}|{_SIGNATURE})=[^\s&;#]"
    ),
}

CREDENTIAL_URL = "|".join(f"(?:{pattern})" for pattern in _URL_CREDENTIALS.values())
"""A URL anywhere in a string that carries a credential: a user or password before its host,
or a query (or fragment) parameter that signs it or holds a secret. Case-insensitive and, like
`CREDENTIAL_NAME`, usable as a JSON schema `pattern` (Python's syntax). Not matched:
`git@github.com:org/repo`, `me@example.com`, `s3://bucket/key`, `https://medium.com/@alice`."""

_CREDENTIAL_NAME = re.compile(CREDENTIAL_NAME, re.IGNORECASE)
_URL_CREDENTIAL_KINDS = {
    what: re.compile(pattern, re.IGNORECASE) for what, pattern in _URL_CREDENTIALS.items()
}
_STORAGE_PREFIXES = ("AWS_", "FSSPEC_", "S3_")


def is_credential_name(name: object) -> bool:
    """Whether a configuration key or environment variable name holds a credential."""
    return bool(_CREDENTIAL_NAME.fullmatch(str(name)))


def carries_credentials(text: str) -> bool:
    """Whether a URL anywhere in `text` carries a credential (`CREDENTIAL_URL`)."""
    return _url_credential(text) is not None


def _url_credential(text: str) -> str | None:
    """What credential a URL in `text` carries ("a URL with a password"), None if none does."""
    return next((what for what, kind in _URL_CREDENTIAL_KINDS.items() if kind.search(text)), None)


def credential_paths(value: Any, path: str = "") -> list[str]:
    """Where `value` (mappings and lists, any depth) holds credentials: the dotted path of each
    key that `is_credential_name`, and of each string that `carries_credentials`, followed by
    what it carries (`storage.endpoint_url: a URL with a password`): its name does not say."""
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
    elif isinstance(value, str) and (what := _url_credential(value)):
        found.append(f"{path or 'value'}: {what}")
    return found


def without_credentials(value: Any) -> Any:
    """A deep copy of `value` without the keys that `is_credential_name` and without the
    strings that `carries_credentials` (the entry holding one is left out), at any depth."""
    if isinstance(value, Mapping):
        return {
            str(k): without_credentials(v)
            for k, v in value.items()
            if not is_credential_name(k) and not _carries_credentials(v)
        }
    if isinstance(value, list | tuple):
        return [without_credentials(v) for v in value if not _carries_credentials(v)]
    return value


def _carries_credentials(value: Any) -> bool:
    return isinstance(value, str) and carries_credentials(value)


def is_storage_setting(name: str) -> bool:
    """Whether an environment variable called `name` says where object storage is or how it
    is reached (`AWS_*`, `FSSPEC_*`, `S3_*`, anything with `ENDPOINT`): not always secret, but
    user code has no business with the run's storage."""
    upper = name.upper()
    return upper.startswith(_STORAGE_PREFIXES) or "ENDPOINT" in upper
