"""Generator and request seeds: no two sampled responses share a random stream.

vLLM seeds sample i of a request seeded s with s + i (vllm/v1/engine/parallel_sampling.py),
written out independently here.
"""

from __future__ import annotations

import itertools

from streamrl.generator.engine import SEED_MODULUS, generator_seed, request_seed


def _sample_seeds(engine_seed: int, requests: int, group_size: int) -> list[int]:
    return [
        request_seed(engine_seed, k, group_size) + i
        for k in range(requests)
        for i in range(group_size)
    ]


def test_every_sample_seed_is_distinct_across_generators_and_restarts():
    G = 8
    seeds = [
        generator_seed(base, index, start)
        for base, index, start in itertools.product((0, 1), range(6), range(1, 5))
    ]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < SEED_MODULUS for s in seeds)
    samples = [seed for s in seeds for seed in _sample_seeds(s, 500, G)]
    assert len(set(samples)) == len(samples) == len(seeds) * 500 * G


def test_requests_of_one_engine_are_spaced_by_the_group_size():
    # Spacing by 1 (the old rule) gives sample i + 1 of request k the seed of sample i of k + 1.
    for engine_seed, G in ((0, 1), (0, 4), (123, 16), (SEED_MODULUS - 5, 4)):
        samples = _sample_seeds(engine_seed, 300, G)
        assert len(set(samples)) == len(samples)
        assert request_seed(engine_seed, 1, G) - request_seed(engine_seed, 0, G) in (
            G,
            G - SEED_MODULUS,  # wrapped
        )


def test_a_restart_changes_the_seed_and_the_same_start_reproduces_it():
    assert generator_seed(0, 3, 1) != generator_seed(0, 3, 2)
    assert generator_seed(0, 3, 2) == generator_seed(0, 3, 2)
    assert generator_seed(0, 3, 1) != generator_seed(1, 3, 1)
