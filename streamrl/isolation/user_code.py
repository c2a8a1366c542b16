"""A user's object by import path ('package.module:attribute'), for the registries of rewards
(`streamrl.rewards.registry`) and environments (`streamrl.envs.registry`): its shape checked
(`split_import_path`), its top-level module looked for without running anything
(`modules_not_found`; `check_user_code` before a run on this machine starts), and the object
imported (`import_object`).

Every way it can fail raises the caller's error class with a message that names the path and
what to change: a module that is not there (or imports one that is not installed), a module
that raises on import, an attribute it does not have (with the closest public name).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from typing import NoReturn

from streamrl.config.base import ConfigError

__all__ = [
    "check_user_code",
    "import_object",
    "modules_not_found",
    "refuse_unknown_name",
    "split_import_path",
]

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"


def split_import_path(path: str, *, dotted_attribute: bool = True) -> tuple[str, str] | None:
    """`(module, attribute)` of `path` when it looks like 'package.module:attribute' (the
    attribute dotted only with `dotted_attribute`); None when it does not."""
    attribute = _DOTTED if dotted_attribute else r"[A-Za-z_]\w*"
    match = re.fullmatch(rf"({_DOTTED}):({attribute})", path)
    return (match[1], match[2]) if match else None


_INSTALLED = "check the spelling and that its package is installed or on PYTHONPATH"


def modules_not_found(paths: Mapping[str, str]) -> list[str]:
    """One problem per import path of `paths` (a field's dotted name → 'package.module:attr')
    whose top-level package or module cannot be found, as a process `streamrl run` starts would
    look for it: on this interpreter's path and in the working directory (`python -m` puts it
    first). Runs no user code: finding a submodule would import its package, so only the
    top-level name is looked for; the rest is found out where the object is imported."""
    problems = []
    for field, path in paths.items():
        top = path.partition(":")[0].partition(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except ValueError:  # in sys.modules without a spec (__main__): it is there
            found = True
        if not found:
            found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None
        if not found:
            problems.append(f"{field}: no module named '{top}' (got {path!r}); {_INSTALLED}")
    return problems


def refuse_unknown_name(
    name: str,
    *,
    what: str,
    example: str,
    registered: Sequence[str],
    user_form: str,
    error: type[Exception],
) -> NoReturn:
    """Raise `error` for `name`, neither a registered `what` nor an import path, saying what
    it looks like: an import path without its colon ('pkg.module.Thing' → 'pkg.module:Thing'),
    something else, or a misspelt name (the closest registered one). `example`: a registered
    name to show; `user_form`: how a user's object is named ("a user function as
    'package.module:function'")."""
    module, _, attribute = name.rpartition(".")
    if split_import_path(f"{module}:{attribute}", dotted_attribute=False):
        raise error(
            f"{name!r} is not a registered {what}, and an import path separates the module "
            f"from the object with a colon: write it as '{module}:{attribute}'"
        )
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise error(
            f"{name!r} is neither the name of {_a(what)} (e.g. {example!r}) nor an import path "
            f"({user_form})"
        )
    close = difflib.get_close_matches(name, registered, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise error(
        f"unknown {what} {name!r}; {hint}registered {what}s: {', '.join(registered)}, or "
        f"{user_form}"
    )


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def check_user_code(paths: Mapping[str, str]) -> None:
    """Before a run's processes start on this machine: the top-level module of each import
    path of its configuration (`paths`: `RunConfig.user_code`) is found, as they will look for
    it.

    Raises:
        ConfigError: one line per module that is not there, with the fix.
    """
    if problems := modules_not_found(paths):
        raise ConfigError(problems)


def import_object(
    path: str, what: str, error: type[Exception], raised: type[Exception] | None = None
) -> object:
    """The object at `path` ('package.module:attribute', the attribute possibly dotted).
    `what` names it in messages ("reward", "environment"); failures raise `error`, but a module
    whose import raised, which may fail only this time (a file or host it reads), raises
    `raised` (default `error`)."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(f"{missing}."):
            raise error(
                f"{what} {path!r}: no module named '{missing}'; {_INSTALLED} ({what} workers "
                "import it in a fresh process)"
            ) from e
        raise error(
            f"{what} {path!r}: importing '{module_name}' failed because it imports "
            f"'{missing}', which is not installed"
        ) from e
    except Exception as e:
        raise (raised or error)(
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
