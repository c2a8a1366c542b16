"""User reward functions for the reward tests, resolved by import path ('tests.reward_fns:...')
in the test process and again in the scorer's spawned workers."""

from __future__ import annotations

import os
import resource
import time

from storage.control.credentials import is_credential_name, is_storage_setting

NOT_CALLABLE = 42


def scripted(response: str, ground_truth: str, *, prompt: str | None = None) -> object:
    """Does what the response says, else exact match of response and ground truth:

    'hang' sleeps 100 s; 'sleep:S' sleeps S seconds first; 'raise' raises ValueError('boom');
    'crash' ends its process at once; 'return:X' returns X (1.5, -1, nan, inf, text, none,
    true); 'prompt' scores 1.0 when the prompt equals the ground truth; 'hog' allocates 2 GiB
    and scores 1.0 if it could; 'secret' scores $AWS_SECRET_ACCESS_KEY == ground truth.
    """
    if response == "hog":
        return len(bytearray(2 * 1024**3)) > 0
    if response == "secret":
        return os.environ["AWS_SECRET_ACCESS_KEY"] == ground_truth
    if response == "hang":
        time.sleep(100)
    if response.startswith("sleep:"):
        time.sleep(float(response.removeprefix("sleep:")))
    if response == "raise":
        raise ValueError("boom")
    if response == "crash":
        os._exit(3)
    if response.startswith("return:"):
        values = {"1.5": 1.5, "-1": -1, "nan": float("nan"), "inf": float("inf")}
        values |= {"text": "yes", "none": None}
        return values.get(response.removeprefix("return:"), True)
    if response == "prompt":
        return prompt == ground_truth
    return response == ground_truth


HOLD_FILE = "STREAMRL_TEST_HOLD"  # a STREAMRL_ name: reward workers keep it


def held(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """Returns 0.0 once the file named by $STREAMRL_TEST_HOLD is gone (at most 60 s)."""
    deadline = time.monotonic() + 60
    while os.path.exists(os.environ.get(HOLD_FILE, "")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return 0.0


def without_prompt(response: str, ground_truth: str) -> float:
    """A reward that does not take the `prompt` keyword."""
    return float(response.strip() == ground_truth.strip())


def one_argument(response: str) -> float:
    """Not a reward: it cannot take a ground truth."""
    return 1.0


def hang_once_raise_once(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """Hangs on its first call and raises on its second, across all worker processes (marker
    files under $STREAMRL_TEST_MARKERS); afterwards scores 0."""
    folder = os.environ["STREAMRL_TEST_MARKERS"]
    for name, action in (("hung", "hang"), ("raised", "raise")):
        try:
            with open(os.path.join(folder, name), "x"):
                pass
        except FileExistsError:
            continue
        if action == "hang":
            time.sleep(100)
        raise ValueError("boom")
    return 0.0


def contains_seven(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """A task a random-init tiny model can learn in a few CPU minutes: 1 when the response
    contains the digit 7 (under a tenth of its random responses do at first)."""
    return float("7" in response)


def raises_on_odd_answer(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """Raises for an odd integer ground truth (about half the arithmetic prompts, every response
    of their groups), else 1 for an exact answer: groups whose reward calls fail are told apart
    from their ground truth alone."""
    if int(ground_truth) % 2:
        raise ValueError(f"no verifier for odd answers ({ground_truth})")
    return float(response.strip() == ground_truth.strip())


def always_raises(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """A broken reward: raises on every call."""
    raise ValueError("this reward function is broken")


def describes_its_box(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """1.0 when what the response names, measured in this worker, equals the ground truth;
    else raises ValueError saying what it measured. 'oom_score_adj': the worker's OOM score
    adjustment; 'memory_mb': its address-space limit, soft/hard in MiB; 'credentials': the
    credential and storage variables it can see, comma-separated."""
    if response == "oom_score_adj":
        with open("/proc/self/oom_score_adj") as f:
            measured = f.read().strip()
    elif response == "memory_mb":
        measured = "/".join(str(v // 1024**2) for v in resource.getrlimit(resource.RLIMIT_AS))
    else:
        visible = (n for n in os.environ if is_credential_name(n) or is_storage_setting(n))
        measured = ",".join(sorted(visible))
    if measured != ground_truth:
        raise ValueError(f"{response} is {measured!r}, expected {ground_truth!r}")
    return 1.0


def misbehaves_on_odd_answer(
    response: str, ground_truth: str, *, prompt: str | None = None
) -> float:
    """For an odd integer ground truth, by the response's length mod 3: returns inf, allocates
    2 GiB (scoring 1 if it could) or reads $AWS_SECRET_ACCESS_KEY (scoring 1 if it is there);
    else 1 for an exact answer. In a boxed worker each of the three is a failed call."""
    if int(ground_truth) % 2:
        kind = ("return:inf", "hog", "secret")[len(response) % 3]
        return float(scripted(kind, "planted"))  # type: ignore[arg-type]
    return float(response.strip() == ground_truth.strip())
