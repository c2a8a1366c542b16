"""The exactness check of the algorithm options (the off-policy correction menu, the framework
guide's variants) on 2 gloo ranks, run by torchrun from test_option_exactness.py, and the helpers
that test shares with it.

    torchrun --nproc_per_node 2 options_worker.py --out DIR OPTION...

Every rank trains the FSDP2-sharded tiny model once per option, from the same weights, on a
batch whose behaviour log-probs are the model's own plus noise (so weights, bands and the veto
all act) and whose groups are half fresh; rank 0 writes `<out>/rank0.json`: per option, the
gathered parameter update (SGD at lr 1: the gradient; the critic's, at lr 1e-3, after the
policy's) and the step's metrics, for the test to `compare` (shared_prompt_worker's) with one
rank's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from streamrl.config.loading import load_config
from streamrl.learner.forward import token_scores
from streamrl.learner.lora import BaseReference, initial_adapter
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.model import load_policy, load_value_model, shard_model
from streamrl.learner.reward_history import PastRewards
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.step_inputs import ValuePrior
from streamrl.learner.topology import Topology, exit_process
from streamrl.models.lora import inject_adapters
from tests.stream_data import random_group

MAX_TOKENS = 24
VERSION = 3  # the learner's version: groups generated at it are fresh
SETTINGS = StepSettings(temperature=1.0, max_response_len=MAX_TOKENS, grad_clip=None)

OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (preset, overrides). Mini-batches of 2 groups: two updates per step, so the
    # proximal log-probs come from the scoring pass and the weight mean is per mini-batch.
    "tis-sequence-normalised": (
        "dapo",
        (
            "algorithm.correction.is_level=sequence",
            "algorithm.correction.is_cap=3.0",
            "algorithm.correction.is_normalize=true",
        ),
    ),
    "token-band-veto-normalised-one-update": (
        "grpo",
        (
            "algorithm.correction.rs_level=token",
            "algorithm.correction.rs_high=2.5",
            "algorithm.correction.veto=0.45",
            "algorithm.correction.is_normalize=true",
            "algorithm.kl=null",
            "learner.mini_batch_groups=4",
        ),
    ),
    "geometric-band": (
        "dapo",
        ("algorithm.correction.rs_level=geometric", "algorithm.correction.rs_high=1.15"),
    ),
    "sequence-band": (
        "gpg",
        ("algorithm.correction.rs_level=sequence", "algorithm.correction.rs_high=20.0"),
    ),
    "icepop": ("dapo", ("algorithm.correction.method=icepop", "algorithm.correction.low=0.7")),
    "icepop-veto": (
        "dapo",
        (
            "algorithm.correction.method=icepop",
            "algorithm.correction.low=0.7",
            "algorithm.correction.veto=0.45",
        ),
    ),
    "tis-token-normalised": ("dapo", ("algorithm.correction.is_normalize=true",)),
    "no-correction": ("dapo", ("algorithm.correction.method=none",)),
    # The policy losses beside PPO's clip (docs/algorithms.md): their presets, GSPO-token on
    # per-token (GAE) advantages, and CISPO and SAPO with a rejection band and a veto.
    "gspo": ("gspo", ()),
    "gspo_token-vapo": (
        "vapo",
        ("model.critic.init_from=policy", "algorithm.policy_loss.kind=gspo_token"),
    ),
    "cispo-band": (
        "cispo",
        ("algorithm.correction.rs_level=token", "algorithm.correction.rs_high=2.5"),
    ),
    "sapo-veto-normalised": (
        "sapo",
        ("algorithm.correction.veto=0.45", "algorithm.correction.is_normalize=true"),
    ),
    # On-policy distillation (the teacher's log-probs are the batch's own plus other noise):
    # beside DAPO's outcome advantage with a discounted return, pure, and under GSPO-token.
    "opd-dapo": (
        "dapo",
        ("algorithm.opd.lambda_opd=0.5", "algorithm.opd.gamma=0.9", "generator.teacher=teacher"),
    ),
    "opd-pure": ("opd", ()),
    "opd-gspo_token": (
        "gspo",
        (
            "algorithm.opd.lambda_rl=0.5",
            "algorithm.policy_loss.kind=gspo_token",
            "generator.teacher=teacher",
        ),
    ),
    # The framework guide's advantage variants, and their presets as they are.
    "grpo-as-is": ("grpo", ("algorithm.kl=null",)),
    "dapo-as-is": ("dapo", ()),
    "dr_grpo-as-is": ("dr_grpo", ()),
    "rank-advantage": ("grpo", ("algorithm.advantage.kind=rank", "algorithm.kl=null")),
    "confidence-baseline-length-reweight": (
        "dapo",
        ("algorithm.advantage.baseline=confidence", "algorithm.length_reweight=0.4"),
    ),
    "inv-sqrt-len-baseline": ("dr_grpo", ("algorithm.advantage.baseline=inv_sqrt_len",)),
    "hierarchical-advantage": (
        "dr_grpo",
        ("algorithm.advantage.kind=hierarchical", "algorithm.advantage.alpha=0.6"),
    ),
    "temporal-groups": ("grpo", ("algorithm.advantage.kind=temporal", "algorithm.kl=null")),
    "length-reweight": ("grpo", ("algorithm.length_reweight=0.5", "algorithm.kl=null")),
    # The critic's options: the guide's heads (eqs 21, 22) and weighted value integration.
    "vapo-as-is": ("vapo", ("model.critic.init_from=policy",)),
    "multi-head-critic": (
        "vapo",
        (
            "model.critic.init_from=policy",
            "algorithm.value_head.kind=multi_head",
            "algorithm.value_head.heads=3",
        ),
    ),
    "distributional-critic": (
        "vapo",
        (
            "model.critic.init_from=policy",
            "algorithm.value_head.kind=distributional",
            "algorithm.value_head.atoms=21",
            "algorithm.value_head.v_min=-1.5",
            "algorithm.value_head.v_max=1.5",
        ),
    ),
    "value-prior": ("vapo", ("model.critic.init_from=policy", "algorithm.value_prior.w0=0.5")),
    # The guide's PPO presets: GAE at a fixed lambda_policy (VC-PPO 0.95, ORZ 1.0).
    "vc_ppo-as-is": ("vc_ppo", ()),
    "orz-as-is": ("orz", ()),
    # LoRA (model.lora): adapters on the frozen base; with a KL, the base is the reference.
    "lora": ("dapo", ("model.lora.rank=4", "model.lora.alpha=8")),
    "lora-kl-to-base": (
        "grpo",
        ("model.lora.rank=4", "model.lora.target_modules=[q_proj,up_proj]"),
    ),
}
GROUP_SIZES = (4, 3, 4, 1)  # G differs across groups, a group of one among them
PRIOR_WEIGHT = 0.4  # w of the value prior at this step
# Earlier rewards of the batch's prompts (temporal groups pool them; other options ignore them):
# the group of one (3) gets a baseline from them.
PAST = PastRewards(torch.tensor([0.5, -1.0, 1.0, 1.0]), torch.tensor([0, 1, 3, 3]))


def config_for(option: str):
    preset, overrides = OPTIONS[option]
    return load_config(
        [preset, "tiny-cpu"],
        overrides=[
            f"generator.max_tokens={MAX_TOKENS}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",
            *overrides,
            # The teacher of the options that distil (opd-*); a served scorer nothing uses is
            # refused, so only they name it.
            *(["scorers.teacher.model=tiny-qwen2"] if option.startswith("opd-") else []),
        ],
    )


def behaviour_batch(policy: torch.nn.Module) -> TrainBatch:
    """Four groups of random tokens of `GROUP_SIZES` responses whose behaviour log-probs are
    `policy`'s own plus N(0, 0.4²) noise and whose teacher log-probs (on-policy distillation)
    are its own plus other N(0, 0.4²) noise, at most 0; groups 0 and 2 generated at `VERSION`
    (fresh); the prompts' earlier rewards `PAST`."""
    rng = np.random.default_rng(11)
    vocab = policy.config.vocab_size
    groups = [
        random_group(
            rng,
            prompt_id=f"p{i}",
            vocab=vocab,
            max_len=MAX_TOKENS,
            prompt_len=8 + i,
            group_size=GROUP_SIZES[i],
            policy_version=VERSION if i % 2 == 0 else VERSION - 2,
        )
        for i in range(4)
    ]
    for group in groups:
        group.raw_scores[:] = (group.rewards > 0).astype(np.float32)
        if group.group_size > 1:
            group.rewards[:2], group.raw_scores[:2] = [1.0, -1.0], [1.0, 0.0]
    batch = TrainBatch.from_groups(groups, VERSION, PAST)
    (whole,) = make_mini_batches(batch, batch.num_groups, 4096)
    (micro,) = whole.micro_batches
    with torch.no_grad():
        own = token_scores(policy, micro, temperature=SETTINGS.temperature)[0]
    logprobs = batch.logprobs.clone()
    rows, j = micro.response_mask.nonzero(as_tuple=True)
    sample = micro.sample_index[rows]
    at = batch.logprob_start[sample] + j - (batch.prompt_length[sample] - 1)
    noise = torch.from_numpy(np.random.default_rng(12).normal(0.0, 0.4, len(at))).float()
    logprobs[at] = own[rows, j] + noise
    teacher = torch.zeros_like(logprobs)
    noise = torch.from_numpy(np.random.default_rng(13).normal(0.0, 0.4, len(at))).float()
    teacher[at] = (own[rows, j] + noise).clamp(max=0.0)
    return replace(batch, logprobs=logprobs, teacher_logprobs=teacher)


def one_update(option: str, *, budget: int, topology: Topology) -> tuple[list, dict]:
    """Train on the option's batch once from fixed weights: (the whole parameter update,
    the step's metrics)."""
    config = config_for(option)
    torch.manual_seed(0)
    policy = load_policy("tiny-qwen2", config.model)
    batch = behaviour_batch(policy)
    if config.model.lora is not None:
        _with_adapters(policy, config.model.lora)
    if topology.world_size > 1:
        policy = shard_model(policy, topology)
    learned = [p for p in policy.parameters() if p.requires_grad]
    models = StepModels(Trainable(policy, torch.optim.SGD(learned, lr=1.0)))
    if config.model.lora is not None and config.algorithm.reference_kl is not None:
        models.reference = BaseReference(policy)
    trained = [policy]
    algorithm = config.algorithm
    if algorithm.uses_value_model:
        critic = _critic(config, topology, seed=0)
        # lr 1e-3: after the first update V − V_old stays far inside the value clip, whose
        # fraction would otherwise flip on rounding
        models.critic = Trainable(critic, torch.optim.SGD(critic.parameters(), lr=1e-3))
        trained.append(critic)
        if algorithm.critic_prior is not None:  # V_pre: another draw of the head, frozen
            prior = _critic(config, topology, seed=1).requires_grad_(False).eval()
            models.value_prior = ValuePrior(prior, weight=PRIOR_WEIGHT)
    minis = make_mini_batches(batch, config.learner.mini_batch_groups, budget)
    before = [t for model in trained for t in _parameters(model, topology)]
    metrics = train_on_batch(models, batch, minis, algorithm, SETTINGS, topology)
    after = [t for model in trained for t in _parameters(model, topology)]
    return [a - b for a, b in zip(after, before, strict=True)], metrics


def _with_adapters(policy: torch.nn.Module, lora) -> None:
    """LoRA adapters on `policy`: A as the learner draws it, B small but not zero (so that A
    has a gradient and the adapted policy differs from the base)."""
    inject_adapters(policy, lora)
    start = initial_adapter(policy, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_A." in name:
                param.copy_(start[name])
            elif ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def _critic(config, topology: Topology, *, seed: int) -> torch.nn.Module:
    """The option's critic (its head drawn from `seed`), sharded when there are ranks."""
    critic = load_value_model(
        "tiny-qwen2", config.model, seed=seed, head=config.algorithm.value_head
    )
    return shard_model(critic, topology) if topology.world_size > 1 else critic


def _parameters(model: torch.nn.Module, topology: Topology) -> list[torch.Tensor]:
    """Every state-dict tensor, whole (gathered from every rank when sharded)."""
    if topology.world_size == 1:
        return [t.detach().clone() for t in model.state_dict().values()]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return [t.clone() for t in get_model_state_dict(model, options=options).values()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("options", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with Topology.from_env("cpu") as topology:
        results = {}
        for option in args.options:  # every rank trains; rank 0 holds the gathered update
            updates, metrics = one_update(option, budget=80, topology=topology)
            results[option] = {"updates": [u.tolist() for u in updates], "metrics": metrics}
        if topology.is_main:
            Path(args.out, "rank0.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
