"""Every configuration section class, for tests that check a rule holds for all of them."""

from __future__ import annotations

from pydantic import BaseModel

import streamrl.config.run  # noqa: F401  (imports every section's module)
from streamrl.config.base import Section


def every_section() -> list[type[BaseModel]]:
    """The subclasses of `Section`, wherever they are defined, nested sub-configs included."""
    found, todo = [], list(Section.__subclasses__())
    while todo:
        model = todo.pop()
        found.append(model)
        todo.extend(model.__subclasses__())
    assert {m.__name__ for m in found} >= {"RunConfig", "LearnerConfig", "PoolsPlacement"}
    return found
