"""Secrets a process takes at start (the Redis URL, which may carry a password; the admin token),
from a flag's value, a file a flag names, or an environment variable, so that a deployment never
has to put one on a command line (``/proc/PID/cmdline`` is world-readable).

    read_secret(value, path, flag="--redis-url", env=REDIS_URL_ENV, environ=os.environ) -> str | None

Precedence: the flag's value, else the file (``FLAG-file``), else the environment variable; giving
both the value and the file is an error. A file holds the secret and at most one trailing newline
(``echo`` and Kubernetes Secret volumes add one). Every error is one line naming the flag and the
file's path, never its content: a ``SecretError``, a ValueError, which every CLI already answers with
one line on stderr and exit code 2.

The stage servers, the router and the launcher all read these secrets, each variable named here once.
"""

from __future__ import annotations

from collections.abc import Mapping

REDIS_URL_ENV = "EPD_REDIS_URL"  # the Redis URL of the embedding cache (password included)
TOKEN_ENV = "EPD_ADMIN_TOKEN"  # the router's admin API token (and the stages' that take its calls)


class SecretError(ValueError):
    """A secret could not be read; the message is one line naming the flag (and the file's path)."""


def read_secret(value: str | None, path: str | None, *, flag: str, env: str,
                environ: Mapping[str, str]) -> str | None:
    """The secret of ``flag`` (e.g. ``--redis-url``): ``value`` (the flag's), else the content of
    ``path`` (``FLAG-file``'s) less one trailing newline, else ``environ[env]``; None when none is
    given (an empty value or variable counts as none, as before files came). SecretError when both
    ``value`` and ``path`` are given, or the file cannot be read or holds nothing."""
    value = value or None
    if value is not None and path is not None:
        raise SecretError(f"give {flag} or {flag}-file, not both")
    if value is not None:
        return value
    if path is not None:
        return _read_file(path, f"{flag}-file")
    return environ.get(env) or None


def _read_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise SecretError(f"{flag} {path}: cannot read it ({reason})") from None
    if text.endswith("\n"):
        text = text[:-1]
    if not text.strip():
        raise SecretError(f"{flag} {path}: the file is empty")
    return text
