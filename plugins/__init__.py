"""corellm's built-in plugins, installed as the ``corellm_plugins`` package.

Each subpackage is one plugin, registered through the ``corellm`` entry-point group exactly as a
third-party plugin would be. The core never imports these, and they never import each other.
"""
