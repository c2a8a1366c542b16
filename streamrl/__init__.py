"""streamrl: asynchronous streaming RL from verifiable rewards."""

__version__ = "0.1.0"
