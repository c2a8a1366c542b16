"""What crosses the wire of the guess_env server: the player's move, what the player is shown
after it, and the episode's state (`GET /state`, a WebSocket `state` message)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

__all__ = ["GuessAction", "GuessObservation", "GuessState"]


class GuessAction(Action):
    """One turn of the player: free text; TextArena takes the first `[number]` in it as the
    guess, and anything else as an invalid move."""

    message: str = Field(..., description="The player's turn, e.g. 'I guess [10]'.")


class GuessObservation(Observation):
    """The game as the player sees it: TextArena's rules and every move and answer so far, in
    the text TextArena renders for a language model. `reward` is 0 until the game is over,
    then TextArena's outcome (1 for a win; the last guess's closeness when it is lost)."""

    prompt: str = Field(..., description="The player's whole view of the game so far.")


class GuessState(State):
    """The episode's progress (`episode_id`, `step_count` from OpenEnv's `State`)."""

    game_id: str = Field(..., description="The TextArena game being played.")
    seed: int | None = Field(None, description="The reset's seed (None: not reproducible).")
    done: bool = Field(False, description="Whether the game is over.")
