"""Importing a user's object by import path ('package.module:attribute'), for the registries
of rewards (`streamrl.rewards.registry`) and environments (`streamrl.envs.registry`).

Every way it can fail raises the caller's error class with a message that names the path and
what to change: a module that is not there (or imports one that is not installed), a module
that raises on import, an attribute it does not have (with the closest public name).
"""

from __future__ import annotations

import difflib
import importlib

__all__ = ["import_object"]


def import_object(path: str, what: str, error: type[Exception]) -> object:
    """The object at `path` ('package.module:attribute', the attribute possibly dotted).
    `what` names it in messages ("reward", "environment"); failures raise `error`."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(f"{missing}."):
            raise error(
                f"{what} {path!r}: no module named '{missing}'; check the spelling and that "
                f"its package is installed or on PYTHONPATH ({what} workers import it in a "
                "fresh process)"
            ) from e
        raise error(
            f"{what} {path!r}: importing '{module_name}' failed because it imports "
            f"'{missing}', which is not installed"
        ) from e
    except Exception as e:
        raise error(
            f"{what} {path!r}: importing '{module_name}' raised {type(e).__name__}: {e}"
        ) from e
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            close = difflib.get_close_matches(attribute, public, n=1)
            hint = f"; did you mean '{module_name}:{close[0]}'?" if close else ""
            raise error(
                f"{what} {path!r}: module '{module_name}' has no attribute '{attribute}'{hint}"
            )
        target = getattr(target, part)
    return target
