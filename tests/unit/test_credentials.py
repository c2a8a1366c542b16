"""Credentials never enter a run's configuration: refused wherever they appear (nested
storage_options, placement.env, overrides, URLs with a password), by one name rule
(`storage.credentials.is_credential_name`) that no typed config field matches, with a message that
names the path and the fix and never the value; and refused by the deployments' parameter
schema before a flow run stores them."""

from __future__ import annotations

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, validate

from flows.run import streamrl_run
from storage.credentials import credential_paths, is_credential_name, without_credentials
from streamrl.config_base import ConfigError
from streamrl.config_loading import load_config, parse_overrides
from streamrl.placement.config import PoolsPlacement
from tests.unit.sections import every_section

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
    "micro_batch_tokens",
    "tokenizer",
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
    }
    assert credential_paths(tree) == [
        "storage.storage_options.client_kwargs.aws_secret_access_key",
        "storage.storage_options.chain.1.token",
        "storage.endpoint_url",
    ]
    scrubbed = without_credentials(tree)
    assert SECRET not in str(scrubbed["storage"]["storage_options"])
    assert scrubbed["storage"]["storage_options"]["client_kwargs"] == {"region_name": "x"}


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
        (f"storage.endpoint_url=http://me:{SECRET}@127.0.0.1:8333", "storage.endpoint_url"),
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
    assert f"({path})" in _refused([override])
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
        "learner.micro_batch_tokens=4096",
        "model.tokenizer=./tok",
        "placement.mode=pools",
        "placement.env={STREAMRL_TEST: 'yes', TOKENIZERS_PARALLELISM: 'false'}",
        "storage.run_uri=s3://bucket/runs/secret-project",
        "storage.storage_options={anon: false, client_kwargs: {region_name: eu-west-1}}",
        "data.system_prompt=Think step by step. Final answer: a number.",
        "generator.stop=[key:, 'token:']",
    ],
)
def test_the_flow_parameter_schema_accepts_ordinary_overrides(override: str) -> None:
    assert not _schema_refuses([override])
