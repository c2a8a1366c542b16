"""Bundled models, built locally into a cache (no model hub is needed): tiny-qwen2 for tests,
smollm2-135m-instruct for the demo. `resolve_model_path(config.model.path)` is what every
component calls before loading a model; see `streamrl.models.cache` for the cache layout.

Imports: `streamrl.config.base`, `streamrl.data` (the bundled facts a tiny model's vocabulary is
built from).
"""

from streamrl.models.cache import (
    BUNDLED_MODELS,
    BundledModel,
    ModelPathError,
    cache_root,
    is_prepared,
    model_dir,
    prepare_model,
    resolve_model_path,
)

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "ModelPathError",
    "cache_root",
    "is_prepared",
    "model_dir",
    "prepare_model",
    "resolve_model_path",
]
