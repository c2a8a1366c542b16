"""RunConfig: presets, layering, overrides, paper defaults and user-facing errors."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from pydantic.fields import FieldInfo

from streamrl.algorithms.config import (
    ALGORITHM_NAMES,
    DAPOConfig,
    GPGConfig,
    GRPOConfig,
    ReinforcePPConfig,
    VAPOConfig,
)
from streamrl.algorithms.policy_losses import GSPOLoss, PPOClipLoss
from streamrl.config.base import ConfigError
from streamrl.config.loading import (
    UNIONS,
    available_presets,
    load_config,
    parse_overrides,
    validate_config,
)
from streamrl.config.run import RunConfig
from streamrl.config.stored import as_this_version_reads
from tests.unit.config.sections import every_section

ALGORITHM_PRESETS = ["grpo", "dr_grpo", "dapo", "vapo", "rloo", "reinforce_pp", "gpg"]
SIZE_PRESETS = ["tiny-cpu", "smollm2-cpu", "qwen2.5-7b-dapo", "qwen2.5-32b-dapo"]


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(excinfo.value.problems)


# --- presets -------------------------------------------------------------------------------


def test_every_documented_preset_ships() -> None:
    assert set(ALGORITHM_PRESETS + SIZE_PRESETS) <= set(available_presets())


@pytest.mark.parametrize("algorithm", ALGORITHM_PRESETS)
@pytest.mark.parametrize("size", ["tiny-cpu", "smollm2-cpu"])
def test_algorithm_and_size_presets_combine(algorithm: str, size: str) -> None:
    """Every algorithm preset composes with every CPU size preset into a valid config."""
    config = load_config([algorithm, size])
    assert config.algorithm.name == algorithm
    assert config.model.path in {"tiny-qwen2", "smollm2-135m-instruct"}
    assert (config.model.critic is not None) == (algorithm == "vapo")


@pytest.mark.parametrize("size", ["tiny-cpu", "smollm2-cpu"])
def test_cpu_size_presets_scale_the_critic_rate_with_the_actor_rate(size: str) -> None:
    """A size preset sets the actor's learning rate for its model, so it sets the critic's too,
    at VAPO's ratio (critic = 2 × actor): the algorithm preset's 2e-6 is for 7B+ models."""
    config = load_config(["vapo", size])
    assert config.learner.critic_lr == pytest.approx(2 * config.learner.lr)
    assert config.learner.lr > load_config(["vapo"]).learner.lr


def test_paper_defaults_of_each_algorithm() -> None:
    """The preset table: clip ranges, dual clip, aggregation and extras per algorithm."""
    grpo = load_config(["grpo"]).algorithm
    assert (grpo.policy_loss.clip_low, grpo.policy_loss.clip_high, grpo.policy_loss.dual_clip) == (
        0.2,
        0.2,
        None,
    )
    assert grpo.aggregation == "seq-mean-token-mean"
    assert grpo.kl is not None
    assert (grpo.kl.estimator, grpo.kl.coef, grpo.kl.reference) == ("k3", 0.001, "frozen")

    dr = load_config(["dr_grpo"]).algorithm
    assert (dr.policy_loss.clip_low, dr.policy_loss.clip_high, dr.kl) == (0.2, 0.2, None)
    assert dr.aggregation == "seq-mean-token-sum-norm"

    dapo = load_config(["dapo"])
    alg = dapo.algorithm
    assert (alg.policy_loss.clip_low, alg.policy_loss.clip_high, alg.policy_loss.dual_clip) == (
        0.2,
        0.28,
        10.0,
    )
    assert alg.aggregation == "token-mean"
    assert alg.dynamic_sampling
    assert alg.overlong.shaping
    assert alg.kl is None
    assert dapo.overlong_cache_len == dapo.generator.max_tokens // 5
    assert dapo.learner.max_staleness == 4

    vapo = load_config(["vapo"])
    v = vapo.algorithm
    assert isinstance(v, VAPOConfig)
    assert (
        v.policy_loss.clip_low,
        v.policy_loss.clip_high,
        v.policy_loss.dual_clip,
        v.aggregation,
    ) == (0.2, 0.28, 10.0, "token-mean")
    assert (v.gamma, v.lam_critic, v.length_alpha, v.nll_coef, v.value_clip) == (
        1.0,
        1.0,
        0.05,
        0.1,
        0.5,
    )
    assert v.value_pretrain_steps == 50
    assert v.kl is None
    assert (vapo.learner.lr, vapo.learner.critic_lr) == (1e-6, 2e-6)
    assert vapo.generator.group_size == 16
    assert vapo.learner.max_staleness == 4

    for name in ("rloo", "reinforce_pp", "gpg"):
        assert load_config([name]).algorithm.aggregation == "token-mean"
    rpp = load_config(["reinforce_pp"]).algorithm
    assert isinstance(rpp, ReinforcePPConfig)
    assert rpp.kl is not None
    assert rpp.kl.placement == "reward"
    assert isinstance(load_config(["gpg"]).algorithm, GPGConfig)


@pytest.mark.parametrize("name", ["qwen2.5-7b-dapo", "qwen2.5-32b-dapo"])
def test_large_scale_examples_carry_the_dapo_recipe(name: str) -> None:
    config = load_config([name])
    assert config.algorithm.name == "dapo"
    assert config.learner.batch_groups == 512
    assert config.generator.group_size == 16
    assert config.learner.mini_batch_groups == 32
    assert config.learner.updates_per_batch == 16
    assert config.learner.lr == 1e-6
    assert config.learner.warmup_steps == 10
    assert config.learner.weight_decay == 0.1
    assert config.learner.grad_clip == 1.0
    assert config.generator.temperature == 1.0
    assert config.generator.top_p == 1.0
    assert config.generator.max_tokens == 20480
    assert config.overlong_cache_len == 4096
    assert config.storage.run_uri.startswith("s3://")


def test_class_defaults_equal_preset_defaults() -> None:
    """Building a variant in code gives the same paper defaults as its preset."""
    assert DAPOConfig() == load_config(["dapo"]).algorithm
    assert GRPOConfig() == load_config(["grpo"]).algorithm
    assert RunConfig().algorithm == DAPOConfig()


# --- layering and overrides ------------------------------------------------------------------


def test_layers_apply_in_order(tmp_path: Path) -> None:
    """defaults ← presets ← file ← overrides, key by key."""
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {"extends": ["tiny-cpu"], "learner": {"lr": 3e-5, "total_steps": 7}, "data": {}}
        )
    )
    config = load_config(["grpo"], path, ["learner.lr=1e-6", "generator.stop=[END, STOP]"])
    assert config.algorithm.name == "grpo"
    assert config.model.path == "tiny-qwen2"  # from the preset the file extends
    assert config.learner.total_steps == 7  # file
    assert config.learner.lr == 1e-6  # override beats file
    assert config.generator.stop == ["END", "STOP"]


def test_nested_override_keeps_paper_defaults() -> None:
    """Overriding one nested field keeps the algorithm's other paper defaults."""
    alg = load_config(["dapo"], overrides=["algorithm.overlong.filter=true"]).algorithm
    assert alg.overlong.filter
    assert alg.overlong.shaping
    grpo = load_config(["grpo"], overrides=["algorithm.kl.coef=0.01"]).algorithm
    assert grpo.kl is not None
    assert (grpo.kl.coef, grpo.kl.estimator) == (0.01, "k3")
    assert load_config(["grpo"], overrides=["algorithm.kl=null"]).algorithm.kl is None


def test_algorithm_fields_without_name_refine_the_default() -> None:
    config = load_config(overrides=["algorithm.clip_high=0.3"])
    assert config.algorithm.name == "dapo"
    assert config.algorithm.policy_loss.clip_high == 0.3


def test_switching_algorithm_by_override() -> None:
    config = load_config(["dapo"], overrides=["algorithm.name=rloo"])
    assert config.algorithm.name == "rloo"
    assert config.algorithm.policy_loss.clip_high == 0.2  # RLOO's own default, not DAPO's


def test_parse_overrides_types() -> None:
    parsed = parse_overrides(["a.b=1", "a.c=1e-6", "a.d=true", "e=null", "f.g=text", "f.h="])
    assert parsed == {"a": {"b": 1, "c": "1e-6", "d": True}, "e": None, "f": {"g": "text", "h": ""}}
    # "1e-6" stays a string in YAML 1.1 and is coerced by the float field:
    assert load_config(overrides=["learner.lr=1e-6"]).learner.lr == 1e-6


def test_yaml_round_trip() -> None:
    config = load_config(["vapo", "tiny-cpu"], overrides=["learner.lr=5e-5"])
    again = validate_config(yaml.safe_load(config.to_yaml()))
    assert again == config


# --- errors ----------------------------------------------------------------------------------


def test_unknown_key_suggests_the_field() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=["learner.learning_rate=1e-6", "modle.path=x"])
    text = problems(excinfo)
    assert "learner.learning_rate: unknown field" in text
    assert "Valid fields:" in text
    assert "lr" in text
    assert "modle: unknown field" in text
    assert "Did you mean 'model'?" in text


def test_unknown_algorithm_field_names_the_algorithm() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["gpg"], overrides=["algorithm.clip_high=0.3"])
    assert "algorithm.clip_high: unknown field (algorithm 'gpg')" in problems(excinfo)
    with pytest.raises(ConfigError) as excinfo:
        load_config(["dapo"], overrides=["algorithm.correction.is_cpa=3"])
    assert "algorithm.correction.is_cpa" in problems(excinfo)
    assert "Did you mean 'is_cap'?" in problems(excinfo)
    with pytest.raises(ConfigError) as excinfo:  # the older spelling names its own fields
        load_config(["dapo"], overrides=["algorithm.importance.cpa=3"])
    assert "algorithm.importance has no field cpa: it takes mode and cap" in problems(excinfo)


def test_unknown_algorithm_name() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=["algorithm.name=dapoo"])
    text = problems(excinfo)
    assert "unknown algorithm 'dapoo'" in text
    assert "Did you mean 'dapo'?" in text
    for name in ALGORITHM_NAMES:
        assert name in text


def test_wrong_type_and_out_of_range_are_all_reported() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(
            overrides=[
                "learner.lr=-1",
                "generator.group_size=many",
                "generator.top_p=1.5",
                "algorithm.importance.cap=0.5",
            ]
        )
    text = problems(excinfo)
    assert len(excinfo.value.problems) == 4
    assert "learner.lr: Input should be greater than 0 (got -1)" in text
    assert "generator.group_size: Input should be a valid integer" in text
    assert "generator.top_p: Input should be less than or equal to 1" in text
    assert "algorithm.importance.cap" in text


@pytest.mark.parametrize("override", ["generator.top_p=0.9", "generator.top_k=50"])
def test_truncated_sampling_is_refused_because_the_learner_scores_the_full_softmax(override):
    """vLLM renormalises its log-probs over the top-k / nucleus set; the learner scores
    softmax(z / T) over the whole vocabulary, so every importance weight would be biased."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=[override])
    text = problems(excinfo)
    assert "importance weight would be biased" in text
    assert "generator.top_p=1.0 and generator.top_k=0" in text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algorithm.name=vapo"], "set model.critic.init_from=policy"),
        (["model.critic.init_from=policy"], "remove model.critic or use algorithm.name=vapo"),
        (["algorithm.name=grpo", "generator.group_size=1"], "generator.group_size must be ≥ 2"),
        (["generator.group_size=1"], "generator.group_size must be ≥ 2"),  # dynamic sampling
        (["generator.max_tokens=4000"], "exceeds model.max_model_len"),
        (["learner.micro_batch_tokens=100"], "learner.micro_batch_tokens (100) must hold"),
        (["learner.batch_groups=10", "learner.mini_batch_groups=3"], "multiple of"),
        (["algorithm.overlong.cache_len=5000"], "cache_len (5000) must be ≤ generator.max_tokens"),
        (["algorithm.name=grpo", "algorithm.kl.placement=reward"], "only defined for reinforce_pp"),
        (["storage.storage_options={secret: x}"], "AWS_SECRET_ACCESS_KEY"),
        (["generator.reward.fn=not a name"], "neither the name of a reward"),
        (["generator.reward.fn=mathh"], "unknown reward 'mathh'; did you mean 'math'?"),
        (["generator.env.fn=calculater"], "did you mean 'calculator'?"),
        (["generator.env.fn=my_pkg.envs.DictionaryEnv"], "write it as 'my_pkg.envs:DictionaryEnv'"),
        (["generator.reward.fn=my_pkg.rewards.score"], "write it as 'my_pkg.rewards:score'"),
        (["generator.reward.fn=my_pkg.rewards:a.b"], "must look like 'package.module:function'"),
        (["generator.env.agent=my_pkg.agents.solve"], "write it as 'my_pkg.agents:solve'"),
        (["generator.env.agent=solve"], "must look like 'package.module:function'"),
        (["learner.warmup_steps=30", "learner.total_steps=20"], "warmup_steps (30) exceeds"),
    ],
)
def test_incompatible_combinations(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=overrides)
    assert expected in problems(excinfo)


@pytest.mark.parametrize(
    ("warmup", "total", "batch", "mini"),
    [(20, 20, 16, 16), (21, 20, 16, 16), (40, 20, 16, 8), (41, 20, 16, 8), (1, 1, 2, 2)],
)
def test_a_warmup_is_refused_at_load_exactly_when_the_learners_schedule_would_refuse_it(
    warmup: int, total: int, batch: int, mini: int
) -> None:
    """The learner's schedule runs over total_steps × batch/mini optimiser updates
    (`streamrl.learner.loading`); a warm-up it refuses must never get past loading."""
    import torch

    from streamrl.learner.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        build_scheduler(optimizer, warmup, total * batch // mini)
        refused = None
    except ValueError as error:
        refused = error
    overrides = [f"learner.warmup_steps={warmup}", f"learner.total_steps={total}",
                 f"learner.batch_groups={batch}", f"learner.mini_batch_groups={mini}"]  # fmt: skip
    if refused is None:
        assert load_config(overrides=overrides).learner.warmup_steps == warmup
        return
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=overrides)
    text = problems(excinfo)
    assert f"warmup_steps ({warmup}) exceeds" in text
    assert f"total_steps ({total})" in text
    assert f"set learner.warmup_steps ≤ {total * batch // mini} or raise" in text


def test_valid_single_response_algorithms() -> None:
    """G = 1 is fine where no group baseline is needed (VAPO, REINFORCE++ without baseline)."""
    assert load_config(["vapo"], overrides=["generator.group_size=1"]).generator.group_size == 1
    config = load_config(["reinforce_pp"], overrides=["generator.group_size=1"])
    assert config.generator.group_size == 1
    with pytest.raises(ConfigError, match="group_size must be ≥ 2"):
        load_config(
            ["reinforce_pp"], overrides=["generator.group_size=1", "algorithm.baseline=true"]
        )


def test_bad_files_and_presets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(path=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path=bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(path=listing)
    with pytest.raises(ConfigError, match="did you mean 'tiny-cpu'"):
        load_config(["tiny-cpus"])
    cyc_a, cyc_b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    cyc_a.write_text(f"extends: [{cyc_b}]\n")
    cyc_b.write_text(f"extends: [{cyc_a}]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(path=cyc_a)
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(overrides=["learner.lr"])


# --- command line ----------------------------------------------------------------------------


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )


def test_cli_show_prints_loadable_yaml() -> None:
    result = run_cli(
        "config", "show", "--preset", "vapo", "--preset", "tiny-cpu", "learner.lr=7e-6"
    )
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["algorithm"]["name"] == "vapo"
    assert shown["learner"]["lr"] == 7e-6
    assert validate_config(shown).model.critic is not None


def test_cli_validate_reports_problems_with_exit_2() -> None:
    result = run_cli("config", "validate", "--preset", "dapo", "learner.lr=-1")
    assert result.returncode == 2
    assert "learner.lr" in result.stderr
    assert "Traceback" not in result.stderr
    ok = run_cli("config", "validate", "--preset", "qwen2.5-32b-dapo")
    assert ok.returncode == 0
    assert ok.stdout.startswith("ok: algorithm dapo")


def test_cli_validate_refuses_an_import_path_without_its_colon_and_a_misspelt_module(
    tmp_path: Path,
) -> None:
    """Without importing the user's code: the path's shape, and that its top-level module is
    found where `streamrl run`'s processes look (Python's path and the working directory)."""
    colonless = run_cli("config", "validate", "generator.env.fn=my_pkg.envs.DictionaryEnv")
    assert colonless.returncode == 2
    assert "generator.env.fn" in colonless.stderr
    assert "write it as 'my_pkg.envs:DictionaryEnv'" in colonless.stderr

    misspelt = run_cli("config", "validate", "generator.reward.fn=tsets.reward_fns:scripted")
    assert misspelt.returncode == 2
    assert "generator.reward.fn: no module named 'tsets'" in misspelt.stderr
    assert "check the spelling and that its package is installed" in misspelt.stderr
    assert "Traceback" not in misspelt.stderr

    root = Path(__file__).resolve().parents[3]
    found = run_cli("config", "validate", "generator.reward.fn=tests.reward_fns:scripted", cwd=root)
    assert found.returncode == 0, found.stderr
    elsewhere = run_cli("config", "validate", "generator.reward.fn=tests.reward_fns:scripted",
                        cwd=tmp_path)  # fmt: skip
    assert elsewhere.returncode == 2
    # On work pools the workers' image imports it: this machine may lack it.
    pools = run_cli("config", "validate", "placement.mode=pools",
                    "generator.reward.fn=tsets.reward_fns:scripted")  # fmt: skip
    assert pools.returncode == 0
    assert "note: on this machine, generator.reward.fn: no module named 'tsets'" in pools.stderr


def test_cli_documents_every_field() -> None:
    result = run_cli("config", "fields")
    assert result.returncode == 0
    for name, field in RunConfig.model_fields.items():
        if name in UNIONS:  # one section per member: [algorithm.dapo], [placement.pools]
            for tag, member in UNIONS[name][1].items():
                assert f"[{name}.{tag}]" in result.stdout
                for sub in member.model_fields:
                    assert f"{name}.{tag}.{sub} = " in result.stdout
        elif name == "scorers":  # sections by name
            assert "[scorers.<name>]" in result.stdout
            assert "scorers.<name>.model = (required)" in result.stdout
            assert "scorers.<name>.unavailable_s = 900.0" in result.stdout
        elif name == "sft":  # optional: documented as the section it is when set
            assert "sft.messages_field = 'messages'" in result.stdout
            assert "sft.eval_every = 10" in result.stdout
        elif name == "preference":
            assert "preference.loss = 'dpo'" in result.stdout
            assert "preference.label_smoothing = 0.0" in result.stdout
        else:
            for sub in field.annotation.model_fields:  # type: ignore[union-attr]
                assert f"{name}.{sub} = " in result.stdout
    for alg in ALGORITHM_NAMES:
        assert f"[algorithm.{alg}]" in result.stdout
    for nested in ("generator.reward", "generator.env", "model.critic"):  # sections in sections
        assert run_cli("config", "fields", nested).stdout.startswith(f"[{nested}]")
    losses = run_cli("config", "fields", "algorithm.policy_loss").stdout
    for kind in ("ppo_clip", "gspo", "gspo_token", "cispo", "sapo"):
        assert f"[algorithm.policy_loss.{kind}]" in losses
    assert "algorithm.policy_loss.sapo.tau_neg = 1.05" in losses
    terms = run_cli("config", "fields", "generator.reward.models").stdout
    assert "generator.reward.models.<name>.judge.score_pattern = " in terms
    assert "generator.reward.models.<name>.reward_model.shift = 0.0" in terms


def test_every_field_is_documented() -> None:
    """Each field of every config model carries a description."""
    models = every_section()
    undocumented = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not field.description and name != "name"
    ]
    assert undocumented == []


# --- bounds ----------------------------------------------------------------------------------


def _upper_bound(field: FieldInfo) -> float | None:
    bounds = [getattr(m, name) for m in field.metadata for name in ("le", "lt") if hasattr(m, name)]
    return min(bounds) if bounds else None


@pytest.mark.parametrize(
    "override",
    [
        "learner.lr=.inf",
        "learner.lr=inf",
        "learner.eps=nan",
        "learner.weight_decay=.nan",
        "generator.temperature=1e400",  # overflows to inf
        "health.kl_max=inf",
        "placement.mode=pools placement.retry_window_s=inf",
        "algorithm.clip_high=inf",
        "algorithm.kl.coef=nan",
    ],
)
def test_non_finite_floats_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=r"finite number|less than or equal"):
        load_config(overrides=override.split())


def test_every_float_field_must_be_finite() -> None:
    """One mechanism, on the sections' shared base: `allow_inf_nan=False`."""
    assert all(model.model_config.get("allow_inf_nan") is False for model in every_section())


@pytest.mark.parametrize("betas", ["[0.9, 1.0]", "[1.0, 0.999]", "[-0.1, 0.999]", "[0.9, 1.5]"])
def test_adam_betas_lie_in_zero_one(betas: str) -> None:
    with pytest.raises(ConfigError, match=r"learner\.betas\.[01]"):
        load_config(overrides=[f"learner.betas={betas}"])
    assert load_config(overrides=["learner.betas=[0.0, 0.95]"]).learner.betas == (0.0, 0.95)


@pytest.mark.parametrize(
    "field",
    [
        "learner.stream_timeout_s",
        "learner.rendezvous_timeout_s",
        "weights.publish_timeout_s",
        "generator.reward.timeout_s",
        "generator.weight_poll_s",
    ],
)
def test_a_timeout_of_1e12_seconds_is_refused(field: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=[f"{field}=1e12"])
    assert f"{field}: Input should be less than or equal to" in problems(excinfo)


def test_every_duration_is_bounded_below_what_threading_accepts() -> None:
    """A wait on a lock, event or queue refuses a timeout above threading.TIMEOUT_MAX."""
    durations = {
        f"{model.__name__}.{name}": _upper_bound(field)
        for model in every_section()
        for name, field in model.model_fields.items()
        if name.endswith("_s") or name.endswith("_seconds")
    }
    assert "LearnerConfig.stream_timeout_s" in durations
    unbounded = [name for name, bound in durations.items() if bound is None]
    assert unbounded == []
    assert all(bound < threading.TIMEOUT_MAX for bound in durations.values())


def test_every_count_is_bounded() -> None:
    unbounded = [
        f"{model.__name__}.{name}"
        for model in every_section()
        for name, field in model.model_fields.items()
        if field.annotation is int and _upper_bound(field) is None
    ]
    assert unbounded == []
    with pytest.raises(ConfigError, match=r"learner\.total_steps"):
        load_config(overrides=["learner.total_steps=1e30"])
    with pytest.raises(ConfigError, match="a core count must be"):
        load_config(overrides=["learner.cpu_cores=100000000"])


# --- YAML errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ("learner:\n  lr: 1e-6\n  stop: [hunter2, \n", 4, 1),
        ("storage:\n  storage_options: {key: hunter2}\n  x: : hunter2\n", 3, 6),
        ('learner:\n  name: "hunter2\\q"\n', 2, 18),
        ("learner:\n\thunter2: 1\n", 2, 1),
    ],
)
def test_a_yaml_error_names_file_line_and_column_not_the_text(
    tmp_path: Path, text: str, line: int, column: int
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path=path)
    message = str(excinfo.value)
    assert f"{path}:{line}:{column}: not valid YAML" in message
    assert "hunter2" not in message
    assert excinfo.value.__cause__ is None  # nor in a chained exception's traceback


def test_episodes_must_fit_the_model_the_micro_batch_and_the_algorithm() -> None:
    config = load_config(["dapo", "smollm2-cpu", "calculator"])
    assert config.generator.env.fn == "calculator"
    assert config.learner.micro_batch_tokens >= config.model.max_model_len
    with pytest.raises(ConfigError) as error:
        load_config(
            ["dapo", "smollm2-cpu", "calculator"], overrides=["learner.micro_batch_tokens=600"]
        )
    assert "must hold the longest episode" in problems(error)
    with pytest.raises(ConfigError) as error:
        load_config(
            ["grpo", "tiny-cpu"],
            overrides=["generator.env.fn=guess", "generator.env.max_episode_tokens=512"],
        )
    assert "exceeds model.max_model_len (256)" in problems(error)
    with pytest.raises(ConfigError) as error:
        load_config(["vapo", "smollm2-cpu", "calculator"])
    assert "multi-turn episodes" in problems(error)


def test_each_union_tag_names_the_class_whose_field_holds_it():
    """`tagged_classes` reads a union's classes by their tag field; the union's own tags (its
    Tag(...) labels) must route to the same classes, or a block would validate as another."""
    from typing import get_args

    from pydantic import TypeAdapter

    from streamrl.algorithms.config import AlgorithmConfig
    from streamrl.algorithms.correction_config import CorrectionConfig
    from streamrl.algorithms.outcome import OutcomeAdvantage
    from streamrl.algorithms.value_heads import ValueHead
    from streamrl.config.base import tagged_classes
    from streamrl.config.loading import UNIONS
    from streamrl.placement.config import PlacementConfig

    unions = {
        "algorithm": AlgorithmConfig,
        "placement": PlacementConfig,
        "algorithm.correction": CorrectionConfig,
        "algorithm.advantage": OutcomeAdvantage,
        "algorithm.value_head": ValueHead,
    }
    assert unions.keys() == UNIONS.keys()
    for path, union in unions.items():
        field, classes = UNIONS[path]
        assert classes == tagged_classes(union, field)
        assert len(classes) == len(get_args(get_args(union)[0])) >= 2
        for tag, cls in classes.items():
            chosen = TypeAdapter(union).validate_python({field: tag})
            assert type(chosen) is cls, (path, tag)


# --- policy losses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "kind", "aggregation"),
    [("gspo", "gspo", "seq-mean-token-mean"), ("cispo", "cispo", "token-mean"),
     ("sapo", "sapo", "seq-mean-token-mean")],
)  # fmt: skip
def test_the_policy_loss_presets(preset: str, kind: str, aggregation: str) -> None:
    """docs/algorithms.md's presets: GRPO advantages, the loss with its paper's parameters,
    its aggregation, no KL; each composes with the CPU size presets."""
    algorithm = load_config([preset, "tiny-cpu"]).algorithm
    assert (algorithm.name, algorithm.policy_loss.kind) == ("grpo", kind)
    assert (algorithm.aggregation, algorithm.kl) == (aggregation, None)
    expected = {
        "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
        "cispo": {"clip_low": 1.0, "clip_high": 0.28},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    }[kind]
    assert algorithm.policy_loss.model_dump(exclude={"kind"}) == expected


def test_the_older_clip_fields_read_as_ppo_clips_and_a_papers_defaults_stay_with_it() -> None:
    dapo = load_config(["dapo"], overrides=["algorithm.clip_high=0.3"]).algorithm
    assert dapo.policy_loss == PPOClipLoss(clip_low=0.2, clip_high=0.3, dual_clip=10.0)
    gspo = load_config(["dapo"], overrides=["algorithm.policy_loss.kind=gspo"]).algorithm
    assert gspo.policy_loss == GSPOLoss()  # DAPO's clip_high 0.28 and dual clip are ppo_clip's
    with pytest.raises(ConfigError) as excinfo:
        load_config(
            ["dapo"], overrides=["algorithm.policy_loss.kind=gspo", "algorithm.clip_high=0.3"]
        )
    assert "algorithm.clip_high: the clipped token ratio's parameters" in problems(excinfo)
    assert "set that loss's own parameters under algorithm.policy_loss" in problems(excinfo)


def test_a_field_of_another_policy_loss_names_where_it_belongs() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["gspo"], overrides=["algorithm.policy_loss.tau_neg=2"])
    assert "policy_loss.tau_neg is a parameter of policy_loss kind sapo, not of gspo" in problems(
        excinfo
    )
    with pytest.raises(ConfigError) as excinfo:
        load_config(["dapo"], overrides=["algorithm.policy_loss.kind=spo"])
    assert "policy_loss" in problems(excinfo)


def test_gspo_refuses_per_token_advantages_naming_why() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["vapo"], overrides=["algorithm.policy_loss.kind=gspo"])
    text = problems(excinfo)
    assert "policy_loss 'gspo' is defined for one advantage per response" in text
    assert "GAE over its value model" in text
    assert "use policy_loss.kind=gspo_token" in text
    vapo = load_config(["vapo"], overrides=["algorithm.policy_loss.kind=gspo_token"]).algorithm
    assert vapo.policy_loss.kind == "gspo_token"
    with pytest.raises(ConfigError, match=r"kl\.placement=reward"):
        load_config(["reinforce_pp"], overrides=["algorithm.policy_loss.kind=gspo"])
    assert (
        load_config(
            ["reinforce_pp"], overrides=["algorithm.policy_loss.kind=gspo", "algorithm.kl=null"]
        ).algorithm.policy_loss
        == GSPOLoss()
    )


def test_a_run_stored_with_the_older_clip_fields_resumes_unchanged() -> None:
    """run.json of a run created before policy_loss: its clip fields mean ppo_clip's."""
    stored = load_config(["dapo"]).model_dump(mode="json")
    loss = stored["algorithm"].pop("policy_loss")
    stored["algorithm"].update({k: loss[k] for k in ("clip_low", "clip_high", "dual_clip")})
    assert as_this_version_reads(stored) == load_config(["dapo"]).model_dump(mode="json")
