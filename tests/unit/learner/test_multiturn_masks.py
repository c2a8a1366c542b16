"""An environment token never counts: a batch whose multi-turn responses interleave sampled
and environment tokens trains exactly as the same batch with the environment tokens cut out
(docs/algorithms.md "Multi-turn rollouts") — the policy loss, its gradient, every denominator and
every step metric, whatever values sit at the environment tokens.

The references are the batches without environment tokens, built independently
(`tests.multi_turn_data.without_environment_tokens`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from storage.stream.records import ScoredGroup
from streamrl.algorithms import overlong_penalty, sampled_lengths
from streamrl.algorithms.config import (
    DAPOConfig,
    DrGRPOConfig,
    GPGConfig,
    GRPOConfig,
    ReinforcePPConfig,
    VAPOConfig,
)
from streamrl.learner.forward import token_scores, use_hidden_states_head
from streamrl.learner.mini_batches import MicroBatch, TrainBatch, make_mini_batches
from streamrl.learner.objective import loss_denominators
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.step_metrics import StepMetrics
from streamrl.learner.topology import Topology
from tests.multi_turn_data import multi_turn_group, without_environment_tokens
from tests.stream_data import random_group

VOCAB = 40
SETTINGS = StepSettings(temperature=1.0, max_response_len=40, grad_clip=None)
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _groups(seed: int = 0) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    multi = [multi_turn_group(rng, prompt_id=f"m{i}", vocab=VOCAB) for i in range(3)]
    single = random_group(rng, prompt_id="s", vocab=VOCAB, prompt_len=3, max_len=8)
    return [multi[0], single, multi[1], multi[2]]


def _near_the_model(group: ScoredGroup, rng: np.random.Generator) -> ScoredGroup:
    """`group` with behaviour log-probs near those of a random model over VOCAB tokens
    (≈ −log VOCAB), so that importance weights fall both sides of their cap."""
    logprobs = [
        np.minimum(-np.log(VOCAB) + rng.normal(0, 0.6, len(m)), 0).astype(np.float32) * m
        for m in group.effective_loss_masks
    ]
    return ScoredGroup(**{**group.__dict__, "behaviour_logprobs": logprobs}).validate()


def _batches(seed: int = 0) -> tuple[TrainBatch, TrainBatch]:
    """The multi-turn batch, and the same batch without its environment tokens."""
    rng = np.random.default_rng(seed)
    groups = [_near_the_model(g, rng) for g in _groups(seed)]
    cut = [without_environment_tokens(g) for g in groups]
    return TrainBatch.from_groups(groups), TrainBatch.from_groups(cut)


def _denominators(mini) -> tuple[int, int, int, int]:
    return (
        mini.num_loss_tokens,
        mini.num_responses,
        mini.num_scored_responses,
        mini.num_positive_tokens,
    )


def test_micro_batches_mark_exactly_the_sampled_tokens():
    groups = _groups()
    batch = TrainBatch.from_groups(groups)
    responses = [(g, i) for g in groups for i in range(g.group_size)]
    for mini in make_mini_batches(batch, 4, 40, overlong_filter=True):
        for micro in mini.micro_batches:
            for row, sample in enumerate(micro.sample_index.tolist()):
                group, i = responses[sample]
                P, mask = len(group.prompt_tokens), group.effective_loss_masks[i]
                sampled = torch.zeros(micro.response_mask.shape[1], dtype=torch.bool)
                sampled[P - 1 : P - 1 + len(mask)] = torch.from_numpy(mask.astype(bool))
                assert torch.equal(micro.sampled_mask[row], sampled)
                assert torch.equal(micro.loss_mask[row], sampled & ~bool(group.truncated[i]))
                env = micro.response_mask[row] & ~sampled
                assert not micro.behaviour_logprobs[row][env].any()
        sampled_tokens = sum(
            int(g.effective_loss_masks[i].sum()) for g, i in responses if not g.truncated[i]
        )
        assert mini.num_loss_tokens == sampled_tokens


def _flat(batch: TrainBatch, at_sampled: torch.Tensor, at_env: torch.Tensor) -> torch.Tensor:
    """`[ΣL]` values in the batch's token layout: `at_sampled` in order at its sampled tokens,
    `at_env` at its environment tokens."""
    sampled = torch.nonzero(batch.sampled).squeeze(1)
    env = torch.nonzero(~batch.sampled).squeeze(1)
    flat = torch.zeros(batch.sampled.numel()).index_put((sampled,), at_sampled)
    return flat.index_put((env,), at_env)


def _view(batch: TrainBatch, micro: MicroBatch, flat: torch.Tensor) -> torch.Tensor:
    """`flat` placed at the micro-batch's response targets `[n, T−1]` (0 elsewhere)."""
    rows = micro.sample_index
    j = torch.arange(micro.response_mask.shape[1])[None]
    at = batch.logprob_start[rows, None] + j - (batch.prompt_length[rows, None] - 1)
    return torch.where(micro.response_mask, flat[at.clamp(0, flat.numel() - 1)], 0.0)


def _policy_loss(
    batch: TrainBatch, algorithm, theta: torch.Tensor, garbage: dict, topology: Topology
) -> tuple:
    """The mini-batch's policy loss summed over its micro-batches (metrics reduced as the step
    reduces them: `StepMetrics`) with logp_θ = `theta` at the sampled tokens and `garbage`
    (logp, prox, advantages) at the environment tokens."""
    (mini,) = make_mini_batches(batch, 4, 40)
    assert len(mini.micro_batches) > 1
    logp = _flat(batch, theta, garbage["logp"])
    prox = _flat(batch, garbage["prox_sampled"], garbage["prox"])
    advantages = _flat(batch, garbage["adv_sampled"], garbage["adv"])
    total, metrics = torch.zeros(()), StepMetrics(torch.device("cpu"))
    for micro in mini.micro_batches:
        loss, micro_metrics = algorithm.policy_gradient_loss(
            _view(batch, micro, logp),
            _view(batch, micro, prox),
            micro.behaviour_logprobs,
            _view(batch, micro, advantages),
            micro.loss_mask,
            loss_denominators(mini, SETTINGS),
        )
        total = total + loss
        metrics.add_micro_batch(micro_metrics, micro.num_tokens)
    return total, metrics.reduce(topology, {}, 1), _denominators(mini)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", ["ppo-tis", "ppo-mask", "pg-tis"])
def test_environment_tokens_change_no_policy_loss_gradient_denominator_or_metric(
    aggregation, loss, topology
):
    multi, single = _batches()
    importance = {"mode": loss.split("-")[1], "cap": 1.5}
    if loss.startswith("ppo"):
        algorithm = GRPOConfig(
            aggregation=aggregation, importance=importance, kl=None, dual_clip=1.5
        )
    else:
        algorithm = GPGConfig(aggregation=aggregation, importance=importance)
    gen = torch.Generator().manual_seed(1)
    n_sampled = int(multi.sampled.sum())
    n_env = multi.sampled.numel() - n_sampled
    assert n_env > 0
    assert n_sampled == single.sampled.numel()
    theta = torch.randn(n_sampled, generator=gen) * 0.5 - np.log(VOCAB)
    values = {  # ratios and importance weights both sides of their clips and cap
        "prox_sampled": theta + 0.5 * torch.randn(n_sampled, generator=gen),
        "adv_sampled": torch.randn(n_sampled, generator=gen),
    }
    arbitrary = {name: torch.randn(n_env, generator=gen) * 30 for name in ("prox", "adv")}
    env_logp = (torch.randn(n_env, generator=gen) * 30).requires_grad_()
    with_env, without_env = theta.clone().requires_grad_(), theta.clone().requires_grad_()

    loss_env, metrics_env, denominators_env = _policy_loss(
        multi, algorithm, with_env, {**values, **arbitrary, "logp": env_logp}, topology
    )
    empty = {name: torch.zeros(0) for name in ("prox", "adv", "logp")}
    loss_cut, metrics_cut, denominators_cut = _policy_loss(
        single, algorithm, without_env, {**values, **empty}, topology
    )
    (loss_env + 0 * env_logp.sum()).backward()
    loss_cut.backward()

    assert denominators_env == denominators_cut
    assert denominators_env[0] == n_sampled
    assert float(loss_env.detach()) == pytest.approx(float(loss_cut.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(with_env.grad, without_env.grad, rtol=1e-5, atol=1e-7)
    assert not env_logp.grad.any()
    assert metrics_env.keys() == metrics_cut.keys()
    for name, value in metrics_env.items():
        assert value == pytest.approx(metrics_cut[name], rel=1e-5, abs=1e-7), name


class CurrentTokenLM(nn.Module):
    """A causal LM that sees only the current token (logits = head(embed(token))), so that a
    sampled token is scored alike with or without the environment tokens before it when the
    token before it is the same (`multi_turn_group` makes it so)."""

    def __init__(self, vocab: int, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.lm_head(self.embed(input_ids)))


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_environment_tokens_are_attended_to_but_never_scored(shared_prompt):
    multi, single = _batches(seed=2)
    model = CurrentTokenLM(VOCAB)
    scores = {}
    for key, batch in (("env", multi), ("cut", single)):
        (mini,) = make_mini_batches(batch, 4, 64, shared_prompt=shared_prompt)
        per_response = {}
        for micro in mini.micro_batches:
            logp, entropy = token_scores(model, micro)
            env = micro.response_mask & ~micro.sampled_mask
            assert not logp[env].any()
            assert not entropy[env].any()
            for row, sample in enumerate(micro.sample_index.tolist()):
                at = micro.sampled_mask[row]
                per_response[sample] = (logp[row][at], entropy[row][at])
        scores[key] = per_response
    assert scores["env"].keys() == scores["cut"].keys()
    for sample, (logp, entropy) in scores["env"].items():
        torch.testing.assert_close(logp, scores["cut"][sample][0])
        torch.testing.assert_close(entropy, scores["cut"][sample][1])


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


ALGORITHMS = {
    "grpo": lambda: GRPOConfig(entropy_coef=0.01, kl={"coef": 0.05}),
    "dr_grpo": lambda: DrGRPOConfig(kl={"coef": 0.05, "estimator": "k2"}),
    "dapo": lambda: DAPOConfig(entropy_coef=0.01, overlong={"filter": True}),
    "reinforce_pp": lambda: ReinforcePPConfig(kl={"coef": 0.1, "placement": "reward"}),
    "gpg": lambda: GPGConfig(importance={"mode": "mask", "cap": 1.5}),
}


def _step(batch: TrainBatch, algorithm, shared_prompt: bool, hidden_head: bool, topology):
    """A learner step (two updates) on `batch`: its metrics and the policy after it."""
    policy = CurrentTokenLM(VOCAB)
    if hidden_head:
        use_hidden_states_head(policy)
    reference = CurrentTokenLM(VOCAB, seed=1) if algorithm.needs_reference else None
    models = StepModels(
        Trainable(policy, torch.optim.SGD(policy.parameters(), lr=0.5)), reference=reference
    )
    minis = make_mini_batches(
        batch, 2, 64, overlong_filter=algorithm.overlong.filter, shared_prompt=shared_prompt
    )
    metrics = train_on_batch(models, batch, minis, algorithm, SETTINGS, topology)
    return metrics, policy


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize(("shared_prompt", "hidden_head"), [(False, False), (True, True)])
def test_a_learner_step_trains_on_a_multi_turn_batch_as_on_its_sampled_tokens_alone(
    name, shared_prompt, hidden_head, topology
):
    multi, single = _batches(seed=2)
    algorithm = ALGORITHMS[name]()
    metrics_env, policy_env = _step(multi, algorithm, shared_prompt, hidden_head, topology)
    metrics_cut, policy_cut = _step(single, algorithm, shared_prompt, hidden_head, topology)
    assert metrics_env.keys() == metrics_cut.keys()
    for metric, value in metrics_env.items():
        assert value == pytest.approx(metrics_cut[metric], rel=1e-4, abs=1e-6), metric
    for (name_env, p_env), p_cut in zip(
        policy_env.named_parameters(), policy_cut.parameters(), strict=True
    ):
        torch.testing.assert_close(p_env.grad, p_cut.grad, rtol=1e-4, atol=1e-6, msg=name_env)
        torch.testing.assert_close(p_env, p_cut, rtol=1e-4, atol=1e-6, msg=name_env)


def test_vapo_refuses_a_multi_turn_group_naming_the_fix(topology):
    multi, _ = _batches()
    policy, critic = CurrentTokenLM(VOCAB), CurrentTokenLM(VOCAB)
    models = StepModels(
        Trainable(policy, torch.optim.SGD(policy.parameters(), lr=0.1)),
        critic=Trainable(critic, torch.optim.SGD(critic.parameters(), lr=0.1)),
    )
    minis = make_mini_batches(multi, 2, 64)
    with pytest.raises(ValueError, match=r"'vapo' cannot train on multi-turn group 'm0'.*grpo"):
        train_on_batch(models, multi, minis, VAPOConfig(), SETTINGS, topology)


def test_overlong_shaping_counts_sampled_tokens_given_the_loss_masks():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, (6 − |o|) / 4 up to 10, −1 beyond.
    masks = [
        np.array([1] * 3 + [0] * 6 + [1] * 3, np.uint8),  # 12 tokens, 6 sampled
        np.array([1] * 4 + [0] * 2 + [1] * 3, np.uint8),  # 9 tokens, 7 sampled
        np.ones(11, np.uint8),  # single-turn, 11 tokens
    ]
    lengths = torch.tensor([len(m) for m in masks])
    assert sampled_lengths(masks).tolist() == [6, 7, 11]
    shaped = overlong_penalty(lengths, 10, 4, loss_masks=masks)
    assert shaped.tolist() == pytest.approx([0.0, -0.25, -1.0])
    assert overlong_penalty(lengths, 10, 4).tolist() == pytest.approx([-1.0, -0.75, -1.0])
    with pytest.raises(ValueError, match="loss masks of"):
        overlong_penalty(lengths + 1, 10, 4, loss_masks=masks)
