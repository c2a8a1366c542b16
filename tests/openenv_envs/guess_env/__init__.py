"""guess_env: TextArena's GuessTheNumber-v0 served as an OpenEnv environment.

Written the way OpenEnv's documentation lays out an environment package (`models.py` with the
Action / Observation / State models, `server/` with the `Environment` subclass and the app that
openenv-core's `create_app` makes, runnable as `uvicorn guess_env.server.app:app`), around the
game as the PyPI `textarena` package defines it. streamrl's OpenEnv tests put this directory on
the OpenEnv virtualenv's path (a `.pth` file), so the virtualenv needs only PyPI packages.
"""

from guess_env.models import GuessAction, GuessObservation, GuessState

__all__ = ["GuessAction", "GuessObservation", "GuessState"]
