"""On-policy distillation in the learner's scoring pass, tiny model, one process: the token
advantages are λ_rl × the algorithm's own (normalised as it normalises them) plus λ_opd × the
teacher's discounted log-prob gaps, computed here token by token; the opd/* metrics are their
means over loss tokens; a batch or a stream group without teacher log-probs is refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from storage.stream.records import Cursor
from streamrl.config.loading import load_config
from streamrl.learner.batching import BatchCollector, IncompatibleGroupError
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches, shard_for_rank
from streamrl.learner.model import load_policy
from streamrl.learner.optim import build_optimizer
from streamrl.learner.scoring import score_batch
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.topology import Topology
from tests.stream_data import random_group

MAX_TOKENS = 24
TEACHER = ("scorers.teacher.model=tiny-qwen2",)  # the opd preset names it generator.teacher
SETTINGS = StepSettings(temperature=1.0, max_response_len=MAX_TOKENS, grad_clip=None)


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    policy = load_policy("tiny-qwen2", load_config(["dapo", "tiny-cpu"]).model)
    return StepModels(
        Trainable(policy, build_optimizer(policy.parameters(), lr=1e-3, weight_decay=0.0))
    )


def groups(vocab: int, *, teacher: bool = True, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    made = []
    for i in range(4):
        group = random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS, prompt_len=9)
        group.raw_scores[:] = (group.rewards > 0).astype(np.float32)
        if teacher:
            taught = [
                -rng.exponential(1.0, size=len(t)).astype(np.float32) for t in group.response_tokens
            ]
            group = replace(group, teacher_logprobs=taught)
        made.append(group)
    return made


def scored(models, topology, config, batch):
    (mini,) = make_mini_batches(batch, batch.num_groups, 64)  # several micro-batches
    micros = shard_for_rank(mini, 0, 1)
    assert len(micros) > 1
    targets, metrics = score_batch(
        models, batch.responses([mini]), [micros], config.algorithm, SETTINGS, topology,
        proximal=False,
    )  # fmt: skip
    return micros, targets[0], metrics


def test_the_advantages_add_the_teachers_discounted_gaps_to_the_outcome_advantages(
    models, topology
):
    vocab = models.policy.model.config.vocab_size
    batch = TrainBatch.from_groups(groups(vocab))
    plain = load_config(["dapo", "tiny-cpu"], overrides=[f"generator.max_tokens={MAX_TOKENS}"])
    opd = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"generator.max_tokens={MAX_TOKENS}",
            "algorithm.opd.lambda_rl=0.5",
            "algorithm.opd.lambda_opd=2.0",
            "algorithm.opd.gamma=0.9",
            "generator.teacher=teacher",
            *TEACHER,
        ],
    )
    micros, outcome_targets, _ = scored(models, topology, plain, batch)
    _, opd_targets, metrics = scored(models, topology, opd, batch)
    gaps, tokens = [], 0
    for micro, outcome, got in zip(micros, outcome_targets, opd_targets, strict=True):
        mask = micro.loss_mask
        for row in range(mask.shape[0]):
            i = int(micro.sample_index[row])
            teacher = torch.from_numpy(
                np.asarray(
                    batch.teacher_logprobs[batch.logprob_start[i] :][: batch.response_length[i]]
                )
            )
            behaviour = batch.logprobs[batch.logprob_start[i] :][: batch.response_length[i]]
            gap = (teacher - behaviour).double()
            positions = mask[row].nonzero().flatten().tolist()
            for t, pos in enumerate(positions):
                ret = sum(0.9**k * float(gap[t + k]) for k in range(len(positions) - t))
                want = 0.5 * float(outcome.advantages[row, pos]) + 2.0 * ret
                assert float(got.advantages[row, pos]) == pytest.approx(want, abs=1e-4)
            gaps += (-gap[: len(positions)]).tolist()
            tokens += len(positions)
            assert (got.advantages[row][~mask[row]] == 0).all()
    assert metrics["opd/reverse_kl"] == pytest.approx(sum(gaps) / tokens, abs=1e-6)
    assert metrics["opd/teacher_logp_mean"] < 0


def test_a_batch_or_a_group_without_teacher_log_probs_is_refused(models, topology):
    config = load_config(
        ["opd", "tiny-cpu"], overrides=[f"generator.max_tokens={MAX_TOKENS}", *TEACHER]
    )
    vocab = models.policy.model.config.vocab_size
    untaught = groups(vocab, teacher=False)
    batch = TrainBatch.from_groups(untaught)
    minis = make_mini_batches(batch, batch.num_groups, 4096)
    with pytest.raises(ValueError, match=r"generator\.teacher"):
        train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology)
    with pytest.raises(ValueError, match="mixes groups"):
        TrainBatch.from_groups([*groups(vocab)[:2], *untaught[:2]])
    collector = BatchCollector(
        batch_groups=4, max_staleness=4, dynamic_sampling=False, vocab_size=vocab,
        max_seq_len=256, needs_teacher=True,
    )  # fmt: skip
    with pytest.raises(IncompatibleGroupError, match="no teacher log-probs"):
        collector.collect(iter(untaught), lambda: Cursor(0, 0), current_version=0)
    taught = collector.collect(iter(groups(vocab)), lambda: Cursor(0, 0), current_version=0)
    assert len(taught.groups) == 4


def test_pure_distillation_moves_the_policy_towards_the_teacher(models, topology):
    """λ_rl = 0: the update raises the log-prob of tokens the teacher prefers to the student
    (positive gap) and lowers the others, whatever the rewards."""
    config = load_config(
        ["opd", "tiny-cpu"], overrides=[f"generator.max_tokens={MAX_TOKENS}", *TEACHER]
    )
    vocab = models.policy.model.config.vocab_size
    made = groups(vocab, seed=5)
    for k, group in enumerate(made):  # the teacher likes the first half of each response only
        made[k] = replace(
            group,
            teacher_logprobs=[
                np.where(np.arange(len(b)) < len(b) // 2, b + 1.0, b - 1.0)
                .clip(max=0)
                .astype(np.float32)
                for b in group.behaviour_logprobs
            ],
        )
    batch = TrainBatch.from_groups(made)
    minis = make_mini_batches(batch, batch.num_groups, 4096)
    before = _gap_alignment(models, batch)
    metrics = train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology)
    after = _gap_alignment(models, batch)
    assert metrics["opd/reverse_kl"] != 0
    assert after > before


def _gap_alignment(models, batch) -> float:
    """Σ over loss tokens of (teacher − behaviour gap) × the policy's log-prob now."""
    from streamrl.learner.forward import token_scores

    (mini,) = make_mini_batches(batch, batch.num_groups, 4096)
    total = 0.0
    with torch.no_grad():
        for micro in mini.micro_batches:
            logp = token_scores(models.policy.model, micro, temperature=1.0)[0]
            gap = (micro.teacher_logprobs - micro.behaviour_logprobs) * micro.loss_mask
            total += float((gap * logp).sum())
    return total
