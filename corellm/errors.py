"""Exceptions corellm raises at its boundaries. Each names what is wrong and where."""

from __future__ import annotations


class CorellmError(Exception):
    """Base class of every error corellm raises on purpose."""


class ProblemsError(CorellmError, ValueError):
    """Base of the errors that list every problem of a document, each at its key path.

    ``problems`` holds one ``(key_path, message)`` pair per problem, e.g.
    ``("scheduler.max_num_seq", "unknown option; did you mean max_num_seqs?")``.
    """

    what = "document"

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid {self.what}{f' ({source})' if source else ''}"
        lines = [f"  {path}: {msg}" if path else f"  {msg}" for path, msg in self.problems]
        super().__init__(head + ":\n" + "\n".join(lines))


class ConfigDeprecationWarning(FutureWarning):
    """A config key that still works but has moved; the message names the new key. Shown by
    default (a FutureWarning), since the people who read it are the ones who wrote the
    config."""


class CorellmDeprecationWarning(FutureWarning):
    """A plugin-facing interface (an import path, a method, a signature) that still works but
    will be removed in the next minor release; the message names the replacement. When a plugin
    triggers it while being loaded or built, corellm re-issues it naming the plugin and its
    distribution. Shown by default (a FutureWarning): the person running corellm learns that an
    installed plugin needs updating before the release that drops the old interface."""


class ConfigError(ProblemsError):
    """The engine configuration is invalid."""

    what = "corellm config"


class PluginError(CorellmError):
    """A plugin could not be loaded, is ambiguous, or does not satisfy its hook specification."""


class OptionError(CorellmError, ValueError):
    """Raised by a component's factory when one of its options cannot work here (a file that
    does not exist, a combination the hardware lacks). ``key`` is the option's name within the
    section; corellm reports it as a config error at the option's full key path
    (``sampler.delegate.<key>``) naming the plugin."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class InvalidRequestError(CorellmError, ValueError):
    """A request (prompt or sampling parameters) was rejected before anything was scheduled.

    ``field`` names the offending field, e.g. ``"sampling_params.top_p"`` or ``"prompt"``.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple:
        # Pickled as (field, message): raised in a check process, it reaches the server whole.
        return type(self), (self.field, self.message)


class CheckpointError(CorellmError):
    """A model checkpoint directory is missing, incomplete or malformed."""


class RequestAbortedError(CorellmError):
    """A request was ended before it finished, by its client or the server (``reason``: e.g.
    ``shutdown``); a stream waiting on it raises this."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)
