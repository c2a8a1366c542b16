"""The guess_env server's ASGI app, made by openenv-core's `create_app` (the HTTP routes, the
`/ws` session endpoint, `/health`, `/schema`):

    uvicorn guess_env.server.app:app --port 8000

`MAX_CONCURRENT_ENVS` (default 8) is the most sessions (games) open at once.
"""

from __future__ import annotations

import os

from openenv.core.env_server.http_server import create_app

from guess_env.models import GuessAction, GuessObservation
from guess_env.server.environment import GuessEnvironment

__all__ = ["app"]

app = create_app(
    GuessEnvironment,
    GuessAction,
    GuessObservation,
    env_name="guess_env",
    max_concurrent_envs=int(os.environ.get("MAX_CONCURRENT_ENVS", "8")),
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
