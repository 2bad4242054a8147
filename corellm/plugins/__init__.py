"""The plugin system: discovery of plugins and the plugin API version (``discovery``), the
registry of the components they offer (``registry``), deprecations attributed to the plugin
that uses them (``deprecation``), and the conformance checks a component passes when it is
built (``conformance``).

``corellm.plugins`` is the public face of ``discovery`` (``PLUGIN_API_VERSION``,
``load_registry``, ``Registry``, ...): its names are read from there when first asked for, so
importing one module of this folder runs no other."""

from typing import TYPE_CHECKING

from corellm._imports import facade

if TYPE_CHECKING:
    from corellm.plugins.discovery import *  # noqa: F403

__getattr__ = facade(__name__, "discovery", ("discovery", "registry", "deprecation",
                                             "conformance"))
