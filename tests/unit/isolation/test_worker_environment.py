"""`storage.control.credentials` in an environment: which variables are credentials or storage
settings, by name alone; and what a reward or environment worker's environment keeps: its allowlist
(`streamrl.isolation.worker.WORKER_ENVIRONMENT`), so a secret under a name no rule knows is gone
too."""

from __future__ import annotations

import pytest

from storage.control.credentials import is_credential_name, is_storage_setting
from streamrl.isolation.worker import keep_worker_environment

SECRETS = [
    "AWS_SECRET_ACCESS_KEY",
    "aws_access_key_id",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "OPENAI_API_KEY",
    "GITHUB_TOKEN",
    "my_token_file",
    "DB_PASSWORD",
    "CLIENT_SECRET",
    "WANDB_API_KEY",
    "HF_TOKEN",
    "PREFECT_API_KEY",
    "PREFECT_API_AUTH_STRING",
    "prefect_api_auth_string",
    "key",  # fsspec/s3fs storage options
    "secret",
    "token",
    "DB_PASS",
    "GH_PAT",
    "SSH_PASSPHRASE",
    "MY_CREDS",
    "HF_TOKENS",
]
NOT_SECRETS = [
    "PATH",
    "HOME",
    "HF_HOME",
    "WANDB_DIR",
    "PREFECT_API_URL",
    "KEYBOARD",
    "MONKEY_BUSINESS",
    "STREAMRL_TEST_MARKERS",
    "CUDA_VISIBLE_DEVICES",
    "endpoint_url",
]


@pytest.mark.parametrize("name", SECRETS)
def test_credentials_are_secret_names(name: str) -> None:
    assert is_credential_name(name)


@pytest.mark.parametrize("name", NOT_SECRETS)
def test_other_names_are_not(name: str) -> None:
    assert not is_credential_name(name)


@pytest.mark.parametrize(
    ("name", "storage"),
    [
        ("AWS_ENDPOINT_URL", True),
        ("AWS_REGION", True),
        ("FSSPEC_S3_ENDPOINT_URL", True),
        ("S3_ENDPOINT", True),
        ("MLFLOW_S3_ENDPOINT_URL", True),
        ("endpoint_url", True),
        ("HF_HOME", False),
        ("PATH", False),
    ],
)
def test_storage_settings(name: str, storage: bool) -> None:
    assert is_storage_setting(name) == storage


UNKNOWN_SECRETS = {
    "MY_DB_DSN": "postgres://rewards:hunter2@db.internal/rewards",
    "WEIRD": "hunter2",
    "SENTRY_DSN": "https://abc123@o1.ingest.sentry.io/1",
    "JUDGE_BEARER": "sk-hunter2",
    "WANDB_DIR": "/scratch/wandb",
    "PREFECT_API_URL": "http://127.0.0.1:4200/api",
    "LD_PRELOAD": "/tmp/x.so",
}
"""Variables no name rule calls a credential, and what user code has no business with."""
KEPT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/me",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HOME": "/cache/hf",
    "HF_HUB_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "0",
    "STREAMRL_TEST_MARKERS": "/tmp/markers",
}


def test_a_worker_keeps_only_its_allowlist() -> None:
    """Before, only names the rules knew were removed: MY_DB_DSN's password reached user code."""
    environ = {**dict.fromkeys([*SECRETS, "AWS_ENDPOINT_URL"], "x"), **UNKNOWN_SECRETS, **KEPT}
    removed = keep_worker_environment(environ)
    assert environ == KEPT
    assert removed == sorted([*SECRETS, "AWS_ENDPOINT_URL", *UNKNOWN_SECRETS])


def test_an_allowed_family_still_loses_its_credentials() -> None:
    environ = {
        "STREAMRL_CACHE": "/cache",
        "STREAMRL_S3_SECRET": "hunter2",
        "STREAMRL_ENDPOINT": "http://127.0.0.1:8333",
        "STREAMRL_MIRROR": "https://me:hunter2@mirror.example.com",
    }
    keep_worker_environment(environ)
    assert environ == {"STREAMRL_CACHE": "/cache"}
