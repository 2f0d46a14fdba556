"""An upstream's bearer token, read once when the worker starts: from the environment variable or the file
the model's config names (never from the config itself). Its value is held by a Credential, whose repr
and str never show it; errors name where it was looked for, never what was found."""

from __future__ import annotations

import os
from pathlib import Path

from server.shared.models import ModelConfigError
from server.shared.upstream_spec import UpstreamSpec


class Credential:
    """A secret that prints as its source."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str) -> None:
        self._value = value
        self.source = source

    def header(self) -> str:
        return f"Bearer {self._value}"

    def __repr__(self) -> str:
        return f"Credential(from {self.source})"

    __str__ = __repr__


def _checked(model: str, value: str, source: str) -> Credential:
    """A credential that can go in a header as it is: printable ASCII, no whitespace (a two-line file would
    otherwise fail in the HTTP library, whose error quotes the header: the secret in a log line)."""
    if not value or not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise ModelConfigError(f"{model}: the upstream credential from {source} is empty, or holds whitespace or "
                               "characters that are not printable ASCII")
    return Credential(value, source)


def read_credential(model: str, spec: UpstreamSpec) -> Credential | None:
    """The model's upstream credential, or None where its config names none; ModelConfigError where it
    names one that cannot be read (the model is then not served)."""
    if spec.credential_env:
        value = os.environ.get(spec.credential_env, "").strip()
        if not value:
            raise ModelConfigError(f"{model}: upstream.credential_env names ${spec.credential_env}, which is unset "
                                   "or empty")
        return _checked(model, value, f"${spec.credential_env}")
    if spec.credential_file:
        try:
            value = Path(spec.credential_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{model}: upstream.credential_file {spec.credential_file}: "
                                   f"{type(exc).__name__}") from None
        return _checked(model, value, spec.credential_file)
    return None
