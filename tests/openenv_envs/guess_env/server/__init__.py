"""The guess_env server: its `Environment` (`environment.py`) and ASGI app (`app.py`)."""
