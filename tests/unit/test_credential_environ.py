"""`storage.credentials` in an environment: which variables are credentials or storage settings,
by name alone, and what a reward worker's environment loses."""

from __future__ import annotations

import pytest

from storage.credentials import is_credential_name, is_storage_setting, remove_credentials

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


def test_remove_credentials_leaves_everything_else() -> None:
    environ = dict.fromkeys([*SECRETS, *NOT_SECRETS, "AWS_ENDPOINT_URL"], "x")
    removed = remove_credentials(environ)
    assert removed == sorted([*SECRETS, "AWS_ENDPOINT_URL", "endpoint_url"])
    assert sorted(environ) == sorted(n for n in NOT_SECRETS if n != "endpoint_url")
