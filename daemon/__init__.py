"""moed.daemon: the long-lived process that owns the model, the expert cache and the socket."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moed")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
