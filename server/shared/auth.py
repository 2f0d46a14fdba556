"""Who may do what: bearer tokens in call metadata, each mapped to a role and optionally a tenant.

The token file (`security.tokens_file`, YAML) is read at start and again on SIGHUP, by the supervisor
alone: it writes the token set in force (digests only) to a file in its socket directory, which every
frontend reads when it starts and when the supervisor forwards SIGHUP (so a restarted frontend serves
the set in force, never the one the server started with):

    - token: "..."          # at least 24 characters; e.g. `openssl rand -base64 32`
      role: client          # Infer, InferBatch, ListModels, and GetStats of the answering process only
      tenant: acme          # optional: this token acts as tenant "acme" and as no other
    - token: "..."
      role: admin           # everything: also Invalidate and the whole of GetStats

A call carries `authorization: Bearer <token>` (gRPC metadata; an HTTP header on the OpenAI door). A
missing or unknown token is UNAUTHENTICATED, a role too low PERMISSION_DENIED. A token bound to a tenant
fills an empty `tenant` of its requests and refuses any other (PERMISSION_DENIED), in Infer, InferBatch
and Invalidate alike. Without a token file every
caller is an unbound admin (the default on loopback; server/config.py refuses other addresses unless
`security.allow_anonymous` says so). Health checks and reflection stay open: probes carry no token.

Tokens are kept only as SHA-256 digests, and a presented token is looked up by its digest: the time a
lookup takes depends on digest bytes, which say nothing usable about any token (no byte-by-byte
comparison of a secret is ever made, so there is no timing oracle). Tokens never reach a log or a message.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from server.shared.errors import PermissionDenied, Unauthenticated

CLIENT, ADMIN = "client", "admin"
_RANK = {CLIENT: 0, ADMIN: 1}
MIN_TOKEN_CHARS = 24
_PREFIX = "bearer "


class TokenFileError(ValueError):
    pass


@dataclass(frozen=True)
class Grant:
    role: str
    tenant: str | None = None  # None: may act as any tenant


ANONYMOUS = Grant(ADMIN)  # authentication off


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def read_tokens(path: str) -> dict[bytes, Grant]:
    """sha256(token) -> Grant from a token file; TokenFileError naming the entry that is wrong."""
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise TokenFileError(f"token file {path} is not valid YAML: {exc}") from None
    if not isinstance(entries, list) or not entries:
        raise TokenFileError(f"token file {path}: expected a list of {{token, role, tenant}} entries")
    table: dict[bytes, Grant] = {}
    for n, entry in enumerate(entries):
        where = f"token file {path}, entry {n}"
        if not isinstance(entry, dict) or set(entry) - {"token", "role", "tenant"}:
            raise TokenFileError(f"{where}: expected a mapping with token, role and optionally tenant")
        token, role, tenant = entry.get("token"), entry.get("role"), entry.get("tenant")
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or token != token.strip():
            raise TokenFileError(f"{where}: token must be a string of at least {MIN_TOKEN_CHARS} characters "
                                 "without surrounding spaces (e.g. openssl rand -base64 32)")
        if role not in _RANK:
            raise TokenFileError(f"{where}: role must be {CLIENT} or {ADMIN}, got {role!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise TokenFileError(f"{where}: tenant must be a string")
        key = digest(token)
        if key in table:
            raise TokenFileError(f"{where}: the same token appears twice")
        table[key] = Grant(role, tenant)
    return table


class Gate:
    """Checks each call's token against the table (None: authentication off)."""

    def __init__(self, tokens: dict[bytes, Grant] | None) -> None:
        self.tokens = tokens

    def admit(self, context, role: str) -> Grant:
        """The grant of a call (its context's metadata) that needs `role`. With authentication off,
        ANONYMOUS, without reading the metadata (the hit path pays nothing)."""
        if self.tokens is None:
            return ANONYMOUS
        found = [value for name, value in context.invocation_metadata() or () if name == "authorization"]
        if len(found) > 1:  # (which one is meant is ambiguous: the HTTP door refuses a repeated header too)
            raise Unauthenticated("send one authorization, not several")
        return self.admit_bearer(found[0] if found else None, role)

    def admit_bearer(self, value: str | None, role: str) -> Grant:
        """The grant of a call whose `authorization` value (gRPC metadata, HTTP header; None: absent) is
        `value`, for a call that needs `role`."""
        if self.tokens is None:
            return ANONYMOUS
        if value is None:
            raise Unauthenticated("this server needs a token: send 'authorization: Bearer <token>'")
        if not value[:len(_PREFIX)].lower() == _PREFIX:
            raise Unauthenticated("authorization must be 'Bearer <token>'")
        grant = self.tokens.get(digest(value[len(_PREFIX):].strip()))
        if grant is None:
            raise Unauthenticated("unknown token")
        if _RANK[grant.role] < _RANK[role]:
            raise PermissionDenied(f"this call needs the {role} role; the token has {grant.role}")
        return grant


def bind_tenant(grant: Grant, request) -> None:
    """A tenant-bound token acts as its tenant: fills an empty `tenant`, refuses another one."""
    if grant.tenant is None:
        return
    if not request.tenant:
        request.tenant = grant.tenant
    elif request.tenant != grant.tenant:
        raise PermissionDenied("this token may act only as its own tenant; leave tenant empty or set it to that")


def write_in_force(path: Path, tokens: dict[bytes, Grant]) -> None:
    """The supervisor's token set in force, for the frontends: digests and grants, never a token; 0600,
    replaced atomically (a frontend never reads half of it)."""
    entries = {key.hex(): [grant.role, grant.tenant] for key, grant in tokens.items()}
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(entries, out)
    os.replace(partial, path)


def read_in_force(path: Path) -> dict[bytes, Grant]:
    """What write_in_force wrote; TokenFileError if it cannot be read."""
    try:
        table = {}
        for key, (role, tenant) in json.loads(path.read_text()).items():
            if role not in _RANK:
                raise ValueError(f"unknown role {role!r}")
            table[bytes.fromhex(key)] = Grant(role, tenant)
        return table
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise TokenFileError(f"cannot read the token set in force from {path}: {exc}") from None
