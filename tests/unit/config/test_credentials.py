"""Credentials never enter a run's configuration: refused wherever they appear (nested
storage_options, placement.env, overrides), by one name rule
(`storage.control.credentials.is_credential_name`) that no typed config field matches and by one
value rule (`carries_credentials`: a URL anywhere in any string with a user, a password, a signature
or a secret query parameter), with a message that names the path, what is wrong and the fix and
never the value; and refused by the deployments' parameter schema before a flow run stores them."""

from __future__ import annotations

import re

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, validate

from flows.run import streamrl_run
from storage.control.credentials import (
    CREDENTIAL_URL,
    carries_credentials,
    credential_paths,
    is_credential_name,
    without_credentials,
)
from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config, parse_overrides
from streamrl.placement.config import PoolsPlacement
from tests.unit.config.sections import every_section

SECRET = "hunter2-s3cr3t"

CREDENTIAL_NAMES = [
    # s3fs / fsspec options
    "key",
    "secret",
    "token",
    "password",
    "session_token",
    "aws_access_key_id",
    "aws_secret_access_key",
    "account_key",
    "sas_token",
    "connection_string",
    "credential",
    # environment variables: AWS_*, *_KEY, *TOKEN*, *SECRET*, *PASSWORD*
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "WANDB_API_KEY",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "PREFECT_API_KEY",
    "PREFECT_API_AUTH_STRING",
    "OPENAI_API_KEY",
    "SSH_PRIVATE_KEY",
    "GITHUB_TOKEN",
    "MY_TOKEN_FILE",
    "ACCESSTOKEN",
    "CLIENT_SECRET",
    "DB_PASSWORD",
    "PGPASSWORD",
    "MYSQL_PASSWD",
    # names the first rules missed (issue 42)
    "DB_PASS",
    "PASS",
    "SSH_PASSPHRASE",
    "GH_PAT",
    "GITHUB_PAT",
    "AZURE_DEVOPS_PAT_2",
    "MY_CREDS",
    "GCP_CRED",
    "HF_TOKENS",
    "GITHUB_API_TOKENS",
    "Authorization",
    "PROXY_AUTHORIZATION",
]

ORDINARY_NAMES = [
    "anon",
    "client_kwargs",
    "region_name",
    "endpoint_url",
    "use_ssl",
    "SSEKMSKeyId",
    "monkey",
    "keys",
    "TOKENIZERS_PARALLELISM",
    "max_tokens",
    "max_new_tokens",
    "turn_max_tokens",
    "max_episode_tokens",
    "observation_max_tokens",
    "micro_batch_tokens",
    "logprob_chunk_tokens",
    "stop_tokens",
    "tokens",
    "tokenizer",
    "path",
    "val_path",
    "PYTHONPATH",
    "patience",
    "pattern",
    "spatial_dims",
    "bypass",
    "passes",
    "passthrough",
    "compass",
    "credit",
    "author",
    "PWD",
    "CUDA_VISIBLE_DEVICES",
    "STREAMRL_TEST",
    "OMP_NUM_THREADS",
]


@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
def test_credential_names(name: str) -> None:
    assert is_credential_name(name)
    assert is_credential_name(name.lower())


@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_ordinary_names(name: str) -> None:
    assert not is_credential_name(name)


def test_no_config_field_looks_like_a_credential() -> None:
    """Why the rule may run on every key of a configuration, at any depth."""
    fields = {name for model in every_section() for name in model.model_fields}
    assert not [name for name in sorted(fields) if is_credential_name(name)]


def test_credential_paths_reach_any_depth() -> None:
    tree = {
        "storage": {
            "storage_options": {
                "anon": False,
                "client_kwargs": {"region_name": "x", "aws_secret_access_key": SECRET},
                "chain": [{"fs": "s3"}, {"fs": "gcs", "token": SECRET}],
            },
            "endpoint_url": f"https://admin:{SECRET}@s3.example.com",
            "run_uri": "s3://bucket/runs/secret-run",  # a value naming a secret is no secret
        },
        "data": {"paths": ["s3://bucket/a.jsonl", f"https://b.example.com/x?sig={SECRET}"]},
    }
    assert credential_paths(tree) == [
        "storage.storage_options.client_kwargs.aws_secret_access_key",
        "storage.storage_options.chain.1.token",
        "storage.endpoint_url: a URL with a password",
        "data.paths.1: a URL with a signature or a secret in its query",
    ]
    scrubbed = without_credentials(tree)
    assert SECRET not in str(scrubbed)
    assert scrubbed["storage"]["storage_options"]["client_kwargs"] == {"region_name": "x"}
    assert scrubbed["storage"]["run_uri"] == "s3://bucket/runs/secret-run"
    assert scrubbed["data"] == {"paths": ["s3://bucket/a.jsonl"]}


# --- values: a URL anywhere in any string ------------------------------------------------


CREDENTIAL_VALUES = [
    # a password before the host, even one with a '/' in it, anywhere in the string
    (f"https://AKIAKEY:{SECRET}/with/slash@s3.example.com", "a password"),
    (f"clone it from https://AKIAKEY:{SECRET}/x@host/repo.git first", "a password"),
    (f"postgres://app:{SECRET}@db.internal:5432/rewards", "a password"),
    (f"redis://:{SECRET}@cache:6379/0", "a password"),
    (f"https://user:{SECRET}@host", "a password"),
    (f"ssh://git:{SECRET}@host/repo", "a password"),
    (f"https://u:{SECRET}@ss@host", "a password"),
    # a user-only token before the host
    (f"https://{SECRET}@github.com/org/repo", "a user name or token"),
    (f"pip install git+https://{SECRET}@github.com/org/repo.git", "a user name or token"),
    (f"(see HTTPS://{SECRET}@host)", "a user name or token"),
    # presigned URLs and secret query or fragment parameters, any case
    (
        "https://bucket.s3.amazonaws.com/data.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential=AKIA%2F20250101&X-Amz-Date=20250101T000000Z&X-Amz-Signature={SECRET}",
        "a signature",
    ),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Security-Token={SECRET}", "a signature"),
    (f"https://storage.googleapis.com/b/o?X-Goog-Signature={SECRET}", "a signature"),
    (f"https://s.com/o?GoogleAccessId=a&Expires=1&Signature={SECRET}", "a signature"),
    (f"https://acct.blob.core.windows.net/c/blob?sv=2022-11-02&sp=r&sig={SECRET}", "a signature"),
    (f"https://api.example.com/v1?token={SECRET}", "a signature"),
    (f"https://api.example.com/v1?a=1;access_token={SECRET}", "a signature"),
    (f"https://maps.example.com/x?KEY={SECRET}", "a signature"),
    (f"https://api.example.com/x?api_key={SECRET}&q=1", "a signature"),
    (f"https://app.example.com/cb#access_token={SECRET}", "a signature"),
]

HARMLESS_VALUES = [
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "/models/qwen2.5-0.5b",
    "builtin:arithmetic",
    "s3://bucket/runs/secret-run",
    "s3://bucket/data/train@v2.jsonl",
    "hf://datasets/org/name@main/train.json",
    "hf://gpt2@main/config.json",
    "gs://bucket/path",
    "abfs://container@account.dfs.core.windows.net/data",
    "file:///home/me/data.jsonl",
    "http://127.0.0.1:8333",
    "https://s3.eu-west-1.amazonaws.com",
    "ssh://git@github.com/org/repo.git",
    "git@github.com:org/repo.git",
    "mail the answer to me@example.com",
    "Think step by step. @user: the final answer goes after ####",
    "https://medium.com/@alice/a-post",
    "http://host:8080/users/@bob",
    "http://[::1]:8080/p/@x",
    "https://example.com/search?q=me@example.com&page=2",
    "https://example.com/generate?max_tokens=5&tokens=2&path=/x",
    "https://example.com/v1?token=",
    "https://bucket.s3.amazonaws.com/k?versionId=3&X-Amz-Date=20250101",
    "https://github.com/org/repo/blob/main/reward.py?plain=1#L10",
    "key: value, token: none, password: see the environment",
]


@pytest.mark.parametrize(("value", "what"), CREDENTIAL_VALUES)
def test_a_url_with_a_credential_is_found_in_any_string(value: str, what: str) -> None:
    (found,) = credential_paths({"placement": {"env": {"ANY_NAME": value}}})
    assert found.startswith("placement.env.ANY_NAME: a URL with ")
    assert what in found
    assert SECRET not in found
    assert without_credentials({"kept": 1, "n": value, "l": [value, "x"]}) == {
        "kept": 1,
        "l": ["x"],
    }
    assert re.search(CREDENTIAL_URL, value, re.IGNORECASE)  # the same rule for JSON schemas


@pytest.mark.parametrize("value", HARMLESS_VALUES)
def test_harmless_values_pass(value: str) -> None:
    assert not carries_credentials(value)
    assert credential_paths({"data": {"path": value}, "stop": [value]}) == []
    assert not re.search(CREDENTIAL_URL, value, re.IGNORECASE)


def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=overrides)
    text = str(excinfo.value)
    assert SECRET not in text
    assert "environment variables" in text  # the fix
    return text


@pytest.mark.parametrize(
    ("override", "path"),
    [
        (f"storage.storage_options={{secret: {SECRET}}}", "storage.storage_options.secret"),
        (
            f"storage.storage_options={{client_kwargs: {{aws_access_key_id: {SECRET}}}}}",
            "storage.storage_options.client_kwargs.aws_access_key_id",
        ),
        (
            f"storage.storage_options.config_kwargs.extra=[{{password: {SECRET}}}]",
            "storage.storage_options.config_kwargs.extra.0.password",
        ),
        (
            f"storage.endpoint_url=http://me:{SECRET}@127.0.0.1:8333",
            "storage.endpoint_url: a URL with a password",
        ),
        (
            f"data.path=https://b.s3.amazonaws.com/train.jsonl?X-Amz-Signature={SECRET}",
            "data.path: a URL with a signature or a secret in its query",
        ),
        (
            f"placement.env={{DB_URL: 'postgres://app:{SECRET}@db/rewards'}}",
            "placement.env.DB_URL: a URL with a password",
        ),
        (f"model.path=https://{SECRET}@hf.example.com/m", "model.path: a URL with a user name"),
        (f"placement.env={{DB_PASS: {SECRET}}}", "placement.env.DB_PASS"),
        (f"placement.env.GH_PAT={SECRET}", "placement.env.GH_PAT"),
        (f"placement.env.SSH_PASSPHRASE={SECRET}", "placement.env.SSH_PASSPHRASE"),
        (f"placement.env.MY_CREDS={SECRET}", "placement.env.MY_CREDS"),
        (f"placement.env.HF_TOKENS={SECRET}", "placement.env.HF_TOKENS"),
        (f"placement.env={{AWS_ACCESS_KEY_ID: {SECRET}}}", "placement.env.AWS_ACCESS_KEY_ID"),
        (f"placement.env={{OPENAI_API_KEY: {SECRET}}}", "placement.env.OPENAI_API_KEY"),
        (f"placement.env={{GITHUB_TOKEN: {SECRET}}}", "placement.env.GITHUB_TOKEN"),
        (f"placement.env={{CLIENT_SECRET: {SECRET}}}", "placement.env.CLIENT_SECRET"),
        (f"placement.env={{DB_PASSWORD: {SECRET}}}", "placement.env.DB_PASSWORD"),
        (f"placement.env.WANDB_API_KEY={SECRET}", "placement.env.WANDB_API_KEY"),
        (f"placement.env.HF_TOKEN={SECRET}", "placement.env.HF_TOKEN"),
        (f"placement.env.PREFECT_API_KEY={SECRET}", "placement.env.PREFECT_API_KEY"),
    ],
)
def test_an_override_with_a_credential_is_refused_naming_its_path(override, path) -> None:
    assert f"({path}" in _refused([override])
    with pytest.raises(ConfigError, match="credentials do not belong"):
        parse_overrides([override])


def test_credentials_in_a_config_file_are_refused_naming_each_path(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "storage:\n"
        "  storage_options:\n"
        "    client_kwargs:\n"
        f"      aws_secret_access_key: {SECRET}\n"
        "placement:\n"
        f"  env: {{STREAMRL_TEST: 'yes', HF_TOKEN: {SECRET}}}\n"
    )
    with pytest.raises(ConfigError) as excinfo:
        load_config(path=path)
    text = str(excinfo.value)
    assert SECRET not in text
    assert "storage.storage_options.client_kwargs.aws_secret_access_key" in text
    assert "placement.env.HF_TOKEN" in text


def test_ordinary_env_and_options_are_kept() -> None:
    config = load_config(
        overrides=[
            "placement.mode=pools",
            "placement.env={STREAMRL_TEST: 'yes', TOKENIZERS_PARALLELISM: 'false'}",
            "storage.storage_options={anon: false, client_kwargs: {region_name: eu-west-1}}",
        ]
    )
    assert config.placement.env["TOKENIZERS_PARALLELISM"] == "false"
    assert config.storage.storage_options["client_kwargs"] == {"region_name": "eu-west-1"}


def test_a_credential_set_in_code_is_refused_too() -> None:
    placement = PoolsPlacement()
    with pytest.raises(ValueError, match=r"env\.HF_TOKEN"):
        placement.env = {"HF_TOKEN": SECRET}
    with pytest.raises(ValueError, match=r"env\.AWS_SECRET_ACCESS_KEY"):
        PoolsPlacement(env={"AWS_SECRET_ACCESS_KEY": SECRET})


# --- the streamrl flow's parameter schema: refused by the Prefect server -------------------


def _schema_refuses(overrides: list[str]) -> bool:
    schema = parameter_schema(streamrl_run).model_dump_for_openapi()
    try:
        validate({"overrides": overrides}, schema, raise_on_error=True)
    except ValidationError:
        return True
    return False


@pytest.mark.parametrize(
    "override",
    [
        f"placement.env.HF_TOKEN={SECRET}",
        f"placement.env={{WANDB_API_KEY: {SECRET}}}",
        f'placement.env={{"AWS_SECRET_ACCESS_KEY": "{SECRET}"}}',
        f"placement={{env: {{MY_PASSWORD: {SECRET}}}}}",
        f"storage.storage_options.key={SECRET}",
        f"storage.storage_options={{key: a, secret: {SECRET}}}",
        f"storage.storage_options={{client_kwargs: {{aws_session_token: {SECRET}}}}}",
        f"storage={{storage_options: {{token: {SECRET}}}}}",
        f"learner.api_key={SECRET}",
        f"placement.env.GH_PAT={SECRET}",
        f"placement.env={{DB_PASS: {SECRET}, SSH_PASSPHRASE: {SECRET}}}",
        f"placement.env={{MY_CREDS: {SECRET}}}",
        f"placement.env.HF_TOKENS={SECRET}",
        # Values: refused by the Prefect server, before it stores the flow run's parameters.
        f"storage.endpoint_url=https://user:{SECRET}@s3.example.com",
        f"data.path=https://bucket.s3.amazonaws.com/d.jsonl?X-Amz-Signature={SECRET}",
        f"placement.env={{DSN: 'postgres://u:{SECRET}@db/x'}}",
        f"model.path=https://{SECRET}@huggingface.co/org/model",
    ],
)
def test_the_flow_parameter_schema_refuses_a_credential_override(override: str) -> None:
    assert _schema_refuses([override])
    assert _schema_refuses(["learner.lr=1e-6", override])


@pytest.mark.parametrize(
    "override",
    [
        "model.critic.init_from=policy",
        "learner.total_steps=500",
        "generator.max_tokens=256",
        "generator.env.turn_max_tokens=64",
        "model.path=/models/patience-7b",
        "data.path=s3://bucket/data/train.jsonl",
        "learner.micro_batch_tokens=4096",
        "model.tokenizer=./tok",
        "placement.mode=pools",
        "placement.env={STREAMRL_TEST: 'yes', TOKENIZERS_PARALLELISM: 'false'}",
        "storage.run_uri=s3://bucket/runs/secret-project",
        "storage.storage_options={anon: false, client_kwargs: {region_name: eu-west-1}}",
        "data.system_prompt=Think step by step. Final answer: a number.",
        "generator.stop=[key:, 'token:']",
        "storage.endpoint_url=http://127.0.0.1:8333",
        "model.path=hf://gpt2@main",
        "data.system_prompt=Mail answers to help@example.com",
    ],
)
def test_the_flow_parameter_schema_accepts_ordinary_overrides(override: str) -> None:
    assert not _schema_refuses([override])
