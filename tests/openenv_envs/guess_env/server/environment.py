"""`GuessEnvironment`: one episode of TextArena's GuessTheNumber-v0 per OpenEnv session.

    reset(seed)   -> a new game (TextArena's registered variant: a number in 1..20, 10 turns);
                     the observation shows the rules; reward 0, not done
    step(action)  -> the action's text played as the player's move; the observation shows the
                     game so far; reward 0 until the game ends, then TextArena's outcome
    state         -> GuessState (episode id, steps, seed, done)

The hidden number is drawn by TextArena from Python's `random`, which its reset seeds with
`seed`: one seed, one number. The draw runs under a process-wide lock, since the server runs
each session's calls on a thread of its own and the generator is global. A step before a reset
or after the game's end is refused (the server answers the session an error).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import textarena
from openenv.core.env_server.interfaces import Environment

from guess_env.models import GuessAction, GuessObservation, GuessState

__all__ = ["GAME_ID", "GuessEnvironment"]

GAME_ID = "GuessTheNumber-v0"
_SEEDED_DRAW = threading.Lock()  # TextArena's reset seeds the process's global `random`


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    """GuessTheNumber-v0 behind OpenEnv's `Environment` interface (module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session builds its own instance and game

    def __init__(self) -> None:
        super().__init__()
        self._game: Any = None
        self._state = GuessState(game_id=GAME_ID)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or null, not {seed!r:.40}")
        game = textarena.make(env_id=GAME_ID)
        with _SEEDED_DRAW:
            game.reset(num_players=1, seed=seed)
        self._game = game
        self._state = GuessState(
            game_id=GAME_ID, seed=seed, episode_id=episode_id or uuid.uuid4().hex, step_count=0
        )
        return GuessObservation(prompt=self._view(), reward=0.0, done=False)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        if self._game is None or self._state.done:
            raise RuntimeError("no game in progress: reset the session to start one")
        done, _ = self._game.step(action.message)
        self._state.step_count += 1
        self._state.done = bool(done)
        rewards = self._game.state.rewards if done else None
        reward = float(rewards[0]) if rewards else 0.0
        return GuessObservation(prompt=self._view(), reward=reward, done=bool(done))

    @property
    def state(self) -> GuessState:
        return self._state

    def _view(self) -> str:
        _, text = self._game.get_observation()
        return str(text)
