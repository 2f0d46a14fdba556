"""TTL classes: how long a model's answers stay fresh, by the kind of knowledge they hold.

A model's `cache:` section either sets one `ttl_s` (one class, named "default") or names its classes and
the default one:

    cache:
      classes: {static: 3600, dynamic: 30, realtime: 0}   # seconds; 0 = never cached
      default_class: static

A request picks a class the model defines (`CachePolicy.ttl_class`; empty = the default). The class
bounds both ends: an answer stored for it expires after the class's TTL, and a lookup for it accepts no
entry older than that TTL, whichever class stored the entry. `cache.max_ttl_s` (retention) caps every
class. `cache.ttl_jitter` takes a random share off each stored answer's TTL (never adds to it), so entries
written together do not expire together; the fleet tier's copies expire with their records.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from server.shared.errors import InvalidArgument

DEFAULT_CLASS = "default"  # the one class of a model that sets cache.ttl_s
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")  # a /metrics label value and a GetStats counter name part


class TtlClassError(ValueError):
    pass


@dataclass(frozen=True)
class TtlClasses:
    pairs: tuple[tuple[str, int], ...]  # (name, seconds), in the config's order; 0 = never cached
    default: str
    jitter: float = 0.0                 # cache.ttl_jitter (server config), set by the model repository

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.pairs)

    def ttl_s(self, name: str) -> int:
        """The TTL of a class this model defines ("" = the default class); KeyError otherwise."""
        name = name or self.default
        for known, seconds in self.pairs:
            if known == name:
                return seconds
        raise KeyError(name)

    def resolve(self, requested: str, model: str) -> tuple[str, int]:
        """(class name, TTL) of a request's `CachePolicy.ttl_class`; INVALID_ARGUMENT for a class the
        model does not define."""
        name = requested or self.default
        try:
            return name, self.ttl_s(name)
        except KeyError:
            shown = requested if len(requested) <= 64 else requested[:64] + "..."
            raise InvalidArgument(f"cache.ttl_class {shown!r} is not a class of model {model!r} "
                                  f"(its classes: {', '.join(self.names)})") from None

    def capped(self, max_ttl_s: int) -> "TtlClasses":
        """Every class at most `max_ttl_s` (cache.max_ttl_s; 0 = no cap)."""
        if not max_ttl_s:
            return self
        return TtlClasses(tuple((n, min(s, max_ttl_s)) for n, s in self.pairs), self.default, self.jitter)

    def expires_us(self, name: str, created_us: int) -> int:
        """When an answer stored now for class `name` expires: its TTL less up to `jitter` of it, at
        random. A class this model no longer defines (a worker started on an older config) stores as the
        default one; a class that is never cached expires at once (never "0 = never")."""
        try:
            ttl_us = self.ttl_s(name) * 1_000_000
        except KeyError:
            ttl_us = self.ttl_s(self.default) * 1_000_000
        return jittered(created_us, ttl_us, self.jitter)


def jittered(created_us: int, ttl_us: int, jitter: float) -> int:
    """An expiry `ttl_us` after `created_us`, less up to `jitter` of it at random (cache.ttl_jitter)."""
    return created_us + ttl_us - int(ttl_us * jitter * random.random())


def from_config(cache: dict | None) -> TtlClasses:
    """A model's classes from its `cache:` section; TtlClassError saying what is wrong."""
    cache = cache or {}
    classes, ttl_s, default = cache.get("classes"), cache.get("ttl_s"), cache.get("default_class")
    if classes is None:
        if ttl_s is None:
            raise TtlClassError("missing required setting 'cache.ttl_s' (or cache.classes with cache.default_class)")
        if default is not None:
            raise TtlClassError("cache.default_class names one of cache.classes; this model sets none")
        return TtlClasses(((DEFAULT_CLASS, _seconds("cache.ttl_s", ttl_s)),), DEFAULT_CLASS)
    if ttl_s is not None:
        raise TtlClassError("set cache.ttl_s (one class) or cache.classes, not both")
    if not isinstance(classes, dict) or not classes:
        raise TtlClassError(f"cache.classes must map class names to seconds, got {classes!r}")
    pairs = []
    for name, seconds in classes.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise TtlClassError(f"cache.classes: {name!r} is not a class name (lower-case letters, digits, "
                                "'_' and '-', starting with a letter, at most 32)")
        pairs.append((name, _seconds(f"cache.classes.{name}", seconds)))
    if default is None:
        raise TtlClassError(f"cache.default_class is required with cache.classes (one of: {', '.join(classes)})")
    if default not in classes:
        raise TtlClassError(f"cache.default_class {default!r} is not one of cache.classes ({', '.join(classes)})")
    return TtlClasses(tuple(pairs), default)


def _seconds(where: str, value) -> int:
    try:
        seconds = int(value) if not isinstance(value, (bool, float)) else -1
    except (TypeError, ValueError):
        seconds = -1
    if seconds < 0:
        raise TtlClassError(f"{where} must be a whole number of seconds >= 0, got {value!r}")
    return seconds
