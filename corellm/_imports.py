"""Import paths that outlive a move.

* ``facade``: a package that replaced a module of the same name (``corellm.config``,
  ``corellm.plugins``, ``corellm.platforms``, ``corellm.cli``) reads the public names of its
  main module when first asked for them (PEP 562), so importing one module of the folder runs
  no other, and ``from corellm.config import EngineConfig`` keeps working.
* ``MOVED``: modules that moved into a folder (0.6), still importable from their old path until
  0.7. The first import of an old path in a process warns (``CorellmDeprecationWarning``, naming
  the plugin being loaded, if any, and the new path) and returns the module itself: the same
  classes, so ``isinstance`` and monkeypatching agree whichever path imported them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

# old path -> new path
MOVED: dict[str, str] = {
    "corellm.registry": "corellm.plugins.registry",
    "corellm.deprecation": "corellm.plugins.deprecation",
    "corellm.engine_config": "corellm.config.schema",
    "corellm.setup": "corellm.config.setup",
    "corellm.logits_processors": "corellm.config.logits_processors",
    "corellm.devices": "corellm.platforms.devices",
    "corellm.distributed": "corellm.platforms.distributed",
    "corellm.model_config": "corellm.checkpoint.reader",
    "corellm.gguf": "corellm.checkpoint.gguf",
    "corellm.demo": "corellm.checkpoint.demo",
    "corellm.cache": "corellm.checkpoint.cache",
    "corellm.block_pool": "corellm.kv.block_pool",
    "corellm.kv_cache": "corellm.kv.paged",
    "corellm.fair": "corellm.serving.fair",
    "corellm.sandbox": "corellm.serving.sandbox",
    "corellm.constraint_shape": "corellm.serving.constraint_shape",
    "corellm.lru": "corellm.serving.lru",
    "corellm.logs": "corellm.engine.logs",
    "corellm.cli_parser": "corellm.cli.parser",
}
REMOVED_IN = "0.7"


def facade(package: str, main: str, submodules: Iterable[str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package that is the public face of its module ``main``."""
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in subs:
            return importlib.import_module(f"{package}.{name}")
        if not name.startswith("__"):
            module = importlib.import_module(f"{package}.{main}")   # its own errors propagate
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of ``MOVED`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        from corellm.plugins.deprecation import warn_deprecated

        new = MOVED[spec.name]
        module = importlib.import_module(new)
        # stacklevel: past this method to the import statement (importlib's own frames are
        # skipped by the warnings module)
        warn_deprecated(f"the module {spec.name}", new, REMOVED_IN, stacklevel=2)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set __spec__ to the old path's: the module keeps its own.
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, _OldPath) for f in sys.meta_path):
        sys.meta_path.append(_OldPath())
