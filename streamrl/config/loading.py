"""Building a `RunConfig` in layers, later layers winning key by key (`deep_merge`):

1. the field defaults (a DAPO run of the bundled SmolLM2 model on CPU);
2. presets, by name (`streamrl/presets/<name>.yaml`) or path, in the order given; a preset may
   itself `extends:` others;
3. a user YAML file (which may also say `extends: [dapo, tiny-cpu]`);
4. dotted command-line overrides: `learner.lr=1e-6 algorithm.name=grpo`.

Validation runs once on the merged result. Every problem is reported together, each naming the
field (`learner.lr`) and what to do about it; see `ConfigError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from storage.control.credentials import CREDENTIAL_NAME, CREDENTIAL_URL, credential_paths
from streamrl.algorithms.config import ALGORITHM_CLASSES
from streamrl.algorithms.correction_config import CORRECTION_CLASSES
from streamrl.algorithms.outcome import ADVANTAGE_CLASSES
from streamrl.algorithms.value_heads import VALUE_HEAD_CLASSES
from streamrl.config.base import ConfigError, credentials_problem
from streamrl.config.merge import deep_merge
from streamrl.config.run import RunConfig
from streamrl.placement.config import PLACEMENT_CLASSES

__all__ = [
    "CREDENTIAL_OVERRIDE",
    "UNIONS",
    "Override",
    "available_presets",
    "load_config",
    "parse_overrides",
    "validate_config",
]

UNIONS: dict[str, tuple[str, Mapping[str, type[BaseModel]]]] = {
    "algorithm": ("name", ALGORITHM_CLASSES),
    "placement": ("mode", PLACEMENT_CLASSES),
    "algorithm.correction": ("method", CORRECTION_CLASSES),
    "algorithm.advantage": ("kind", ADVANTAGE_CLASSES),
    "algorithm.value_head": ("kind", VALUE_HEAD_CLASSES),
}
"""The sections that are discriminated unions (by path): their tag field and the class of each
tag."""


def available_presets() -> list[str]:
    """Names of the presets shipped with streamrl."""
    folder = resources.files("streamrl") / "presets"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _read_yaml(path: Path | Any, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_problem(path, exc)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{what} must hold a mapping of sections, got {type(data).__name__}"])
    return data


def _yaml_problem(path: Path | Any, exc: yaml.YAMLError) -> str:
    """`<file>:<line>:<column>: <problem>`. Never PyYAML's own message: it quotes the
    offending line, which may hold a secret."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.reader.ReaderError):
        return f"{path}: not valid YAML: {exc.reason} (character {exc.position + 1})"
    if mark is None:
        return f"{path}: not valid YAML ({type(exc).__name__})"
    context = getattr(exc, "context", None)
    problem = getattr(exc, "problem", None) or "not valid YAML"
    where = f"{path}:{mark.line + 1}:{mark.column + 1}"
    return f"{where}: not valid YAML: {f'{context}, ' if context else ''}{problem}"


def _load_layer(ref: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A preset name or YAML path, with its `extends:` chain resolved (parents first)."""
    if ref in seen:
        raise ConfigError([f"presets extend each other in a cycle: {' -> '.join((*seen, ref))}"])
    path = Path(ref)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ConfigError([f"config file {ref} does not exist"])
        data = _read_yaml(path, f"config file {ref}")
    else:
        preset = resources.files("streamrl") / "presets" / f"{ref}.yaml"
        if not preset.is_file():
            close = difflib.get_close_matches(ref, available_presets(), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                [f"unknown preset '{ref}'{hint} Available: {', '.join(available_presets())}"]
            )
        data = _read_yaml(preset, f"preset {ref}")
    parents = data.pop("extends", []) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = deep_merge(merged, _load_layer(parent, (*seen, ref)))
    return deep_merge(merged, data)


CREDENTIAL_OVERRIDE = (
    rf"(?i)^(?:[^=]*\.)?\s*{CREDENTIAL_NAME}\s*[.=]"
    rf"|^\s*(?:storage|placement)\b[^=]*=.*?(?<![\w-])[\"']?{CREDENTIAL_NAME}[\"']?\s*:"
    rf"|^[^=]*=.*?(?:{CREDENTIAL_URL})"
)
"""An override that sets a credential: one whose dotted key names one
(`placement.env.HF_TOKEN=...`), a storage/placement mapping with such a key
(`storage.storage_options={secret: ...}`), or a value holding a URL with a password, a token or
a signature (`storage.endpoint_url=https://user:pass@host`, a presigned `data.path`: see
`storage.control.credentials.CREDENTIAL_URL`). The deployments' parameter schema refuses it, so the
Prefect server refuses the flow run before storing its parameters; in the flow,
`parse_overrides` refuses every credential, naming its path."""

Override = Annotated[
    str,
    Field(
        description="A dotted override, section.field=value (learner.lr=1e-6); never a "
        "credential: those are refused (give them to the workers as environment variables or a "
        "Kubernetes secret).",
        json_schema_extra={"not": {"pattern": CREDENTIAL_OVERRIDE}},
    ),
]


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`["learner.lr=1e-6", "generator.stop=[A, B]"]` → nested dict; values parsed as YAML.

    An override that sets a credential (`placement.env.HF_TOKEN=...`,
    `storage.storage_options={secret: ...}`) is refused, naming its path, never its value."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ConfigError(
                [f"override {item!r} must look like section.field=value, e.g. learner.lr=1e-6"]
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = nested
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"override {item!r} conflicts with an earlier one for {part}"])
            node = child
        node[leaf] = value
    if found := credential_paths(nested):
        raise ConfigError([credentials_problem(found)], "overrides")
    return nested


def load_config(
    presets: Sequence[str] = (),
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """Build and validate a RunConfig: defaults ← presets ← YAML file ← dotted overrides.

    Raises `ConfigError` listing every problem, each with the field's dotted name.
    """
    merged: dict[str, Any] = {}
    for name in presets:
        merged = deep_merge(merged, _load_layer(name))
    if path is not None:
        merged = deep_merge(merged, _load_layer(str(path)))
    merged = deep_merge(merged, parse_overrides(overrides))
    return validate_config(merged)


def validate_config(data: Mapping[str, Any], source: str = "configuration") -> RunConfig:
    """Validate a (merged) config mapping; raise `ConfigError` with user-facing messages."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError([_describe(err) for err in exc.errors()], source) from None


def _model_at(
    loc: Sequence[str | int], tagged: Mapping[str, type[BaseModel]]
) -> type[BaseModel] | None:
    """The pydantic model holding the field at `loc`, for 'did you mean' suggestions;
    `tagged` gives the class chosen at each union's path."""
    model: type[BaseModel] = RunConfig
    for depth, part in enumerate(loc[:-1], start=1):
        path = ".".join(str(p) for p in loc[:depth])
        if path in tagged:
            model = tagged[path]
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _untag(loc: list[str | int]) -> tuple[list[str | int], dict[str, type[BaseModel]]]:
    """`loc` without the tags pydantic puts after a union's path (('algorithm', 'dapo',
    'clip_high') → ('algorithm', 'clip_high')), and the class each tag chose, by path."""
    tagged: dict[str, type[BaseModel]] = {}
    for path in sorted(UNIONS, key=lambda p: p.count(".")):  # outer unions first
        parts = path.split(".")
        classes = UNIONS[path][1]
        if loc[: len(parts)] == parts and len(loc) > len(parts) and loc[len(parts)] in classes:
            tagged[path] = classes[str(loc.pop(len(parts)))]
    return loc, tagged


def _describe(err: Mapping[str, Any]) -> str:
    """One pydantic error → 'section.field: what is wrong; how to fix it'."""
    # Drop pydantic's internal location parts (function-after[...], union members).
    loc = [
        p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function")))
    ]
    # A union puts its tag in the location: ('algorithm', 'dapo', 'clip_high').
    loc, tagged = _untag(loc)
    owner = _model_at(loc, tagged) if loc else None
    context = ""
    if loc and str(loc[0]) in tagged:  # a top-level union: name the variant
        tag_field, classes = UNIONS[str(loc[0])]
        tag = next(t for t, cls in classes.items() if cls is tagged[str(loc[0])])
        context = f" ({loc[0]} '{tag}')"
        elsewhere = [t for t, cls in classes.items() if loc[-1] in cls.model_fields]
        if err["type"] == "extra_forbidden" and elsewhere and len(loc) == 2:
            context += f"; it is a field of {loc[0]}.{tag_field}={' | '.join(elsewhere)}"
    where = ".".join(str(p) for p in loc) or "configuration"
    kind = err["type"]
    if kind == "extra_forbidden":
        field = str(loc[-1]) if loc else where
        valid = sorted(owner.model_fields) if owner is not None else []
        older = list(getattr(owner, "older_fields", ()))  # a model that is no Section has none
        close = difflib.get_close_matches(field, valid + older, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        listing = f" Valid fields: {', '.join(valid)}." if valid else ""
        return f"{where}: unknown field{context}.{hint}{listing}"
    if kind in ("union_tag_invalid", "union_tag_not_found") and where in UNIONS:
        tag_field, classes = UNIONS[where]
        choices = ", ".join(classes)
        if kind == "union_tag_not_found":
            return f"{where}: missing '{tag_field}'; choose one of: {choices}"
        tag = err.get("ctx", {}).get("tag")
        close = difflib.get_close_matches(str(tag), list(classes), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{where}.{tag_field}: unknown {where} {tag!r}.{hint} Choose one of: {choices}"
    message = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and where == "configuration":
        return message
    value = err.get("input")
    shown = "" if isinstance(value, dict) or kind == "missing" else f" (got {value!r})"
    return f"{where}: {message}{context}{shown}"
