"""PII detection and redaction: a text step of the normalization pipeline.

Runs after NFKC and before casefolding/punctuation folding, so it sees the original separators
("a.b@example.com", "+44 20 7946 0958"). Each match becomes a typed placeholder ("[card number]"),
so two queries that differ only in their PII share a cache key and no PII reaches the cache.

Detected, in this order (an earlier kind wins over an overlapping later one):
  email        local@domain.tld (dots, plus, hyphens, subdomains; the TLD is 2+ letters)
  iban         2 letters, 2 check digits, 11..30 alphanumerics, compact or in groups of 4
               separated by single spaces; kept only when the ISO 13616 mod-97 check is 1
  card         13..19 digits, compact or as 4-4-4[-4][-1..4] / 4-6-4[5] with single spaces or
               hyphens; kept only when the Luhn check passes and the number starts in the major
               networks' ranges (3-6, or 2221-2720), which keeps out Luhn-valid timestamps and ids
  national_id  US SSN ddd-dd-dddd / "ddd dd dddd" (area not 000, 666, 9xx; group not 00; serial
               not 0000); UK NI number "QQ 12 34 56 C" (HMRC prefix letter rules, plus the QQ
               specimen prefix; suffix A-D; optional spaces)
  ip           IPv4 dotted quads (not inside longer dotted strings such as "1.2.3.4.5") and IPv6,
               both validated with the ipaddress module
  phone        "+CC ..." with 8..15 digits; North American (415) 555-2671, 415-555-2671,
               415.555.2671, 4155552671; national numbers with a leading 0 and 10..11 digits
               ("020 7946 0958", "07700 900123")

Not detected: names, postal addresses, dates of birth, bare account numbers and sort codes, SSNs
as 9 bare digits, passport/licence numbers. Left alone on purpose: amounts, dates, times, years,
PINs, order numbers. A 4-part version "1.2.3.4" looks exactly like an IPv4 address and is redacted.

Matching is linear: a look-behind stops each pattern starting inside a token, repeats are bounded
or possessive, and checksums and length rules run in Python on the candidate. When a run of digit
groups is too long (a card followed by a year), the longest prefix that ends between groups and
passes the check is kept. Text with no ASCII digit, '@' or ':' (most queries) costs one search.
"""

from __future__ import annotations

import ipaddress
import re
from bisect import bisect_left
from collections.abc import Callable, Iterator

Span = tuple[int, int]

KINDS: tuple[str, ...] = ("email", "iban", "card", "national_id", "ip", "phone")
PLACEHOLDERS: dict[str, str] = {
    "email": "[email address]",
    "iban": "[iban]",
    "card": "[card number]",
    "national_id": "[national id]",
    "ip": "[ip address]",
    "phone": "[phone number]",
}

_TRIGGER = re.compile(r"[0-9@:]")
_DIGIT = re.compile(r"[0-9]")
_GROUP_END = re.compile(r"[^0-9A-Za-z]+")  # separators between the groups of a candidate

_EMAIL = re.compile(r"(?<![\w.%+-])[\w.%+-]++@[\w.-]++")
_IBAN = re.compile(
    r"(?<!\w)[A-Za-z]{2}[0-9]{2}"
    r"(?:[A-Za-z0-9]{11,30}+(?!\w)|(?: [A-Za-z0-9]{1,4}+(?![A-Za-z0-9])){3,8}+)"
)
_CARD = re.compile(
    r"(?<![\w.,])(?:[0-9]{13,19}+"
    r"|[0-9]{4}(?:[ -][0-9]{4}+(?![0-9])){2,3}+(?:[ -][0-9]{1,4}+)?"
    r"|[0-9]{4}[ -][0-9]{6}[ -][0-9]{4,5})(?![0-9])"
)
_SSN = re.compile(
    r"(?<![\w-])(?!000|666|9)[0-9]{3}([ -])(?!00)[0-9]{2}\1(?!0000)[0-9]{4}(?!\w|-[0-9])"
)
_NINO = re.compile(
    r"(?<!\w)(?:QQ|(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z])"
    r" ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D](?!\w)",
    re.IGNORECASE,
)
_IPV4 = re.compile(r"(?<!\w)(?<![0-9]\.)(?:[0-9]{1,3}\.){3}[0-9]{1,3}(?!\w|\.[0-9])")
_IPV6 = re.compile(r"(?<![0-9A-Fa-f:.])[0-9A-Fa-f.]*+:[0-9A-Fa-f:.]*+")
_PHONE_INTL = re.compile(r"(?<![\w+])\+[0-9](?:[ .()-]{0,2}+[0-9]){0,24}+")
_PHONE_NANP = re.compile(
    r"(?<![\w+.,/-])(?:1[ .-]?)?(?:\([2-9][0-9]{2}\) ?|[2-9][0-9]{2}[ .-]?)"
    r"[2-9][0-9]{2}[ .-]?[0-9]{4}(?!\w|[.,/-][0-9])"
)
_PHONE_NATIONAL = re.compile(
    r"(?<![\w+.,/-])0[1-9][0-9]{0,9}+(?:[ -][0-9]{2,8}+(?![0-9])){0,4}+(?!\w|[.,/:-][0-9])"
)


def _ndigits(s: str) -> int:
    return len(_DIGIT.findall(s))


def _card_ok(s: str) -> bool:
    d = "".join(_DIGIT.findall(s))
    if not (13 <= len(d) <= 19 and (d[0] in "3456" or "2221" <= d[:4] <= "2720")):  # issuer ranges
        return False
    nums = [int(c) for c in reversed(d)]
    return (sum(nums[0::2]) + sum(sum(divmod(2 * n, 10)) for n in nums[1::2])) % 10 == 0


def _iban_ok(prefix: str) -> bool:
    groups = prefix.split(" ")
    if any(len(g) != 4 for g in groups[:-1]):  # spaced form: groups of 4, the last may be short
        return False
    s = "".join(groups).upper()
    return 15 <= len(s) <= 34 and int("".join(str(int(c, 36)) for c in s[4:] + s[:4])) % 97 == 1


def _longest(pattern: re.Pattern[str], text: str, ok: Callable[[str], bool]) -> Iterator[Span]:
    """Spans of the longest prefix of each candidate, cut between groups, that passes ok()."""
    for m in pattern.finditer(text):
        s = m.group()
        for end in [len(s)] + [g.start() for g in reversed(list(_GROUP_END.finditer(s)))]:
            if end and ok(s[:end]):
                yield m.start(), m.start() + end
                break


def _emails(text: str) -> Iterator[Span]:
    if "@" not in text:
        return
    for m in _EMAIL.finditer(text):
        local, _, domain = m.group().partition("@")
        domain = domain.rstrip(".")
        labels = domain.split(".")
        if (len(labels) >= 2 and all(labels) and labels[-1].isalpha() and len(labels[-1]) >= 2
                and not any(lab[0] == "-" or lab[-1] == "-" for lab in labels)
                and any(c.isalnum() for c in local)):
            yield m.start(), m.start() + len(local) + 1 + len(domain)


def _parses(parse: Callable[[str], object], s: str) -> bool:
    try:
        parse(s)
    except ValueError:
        return False
    return True


def _is_word(text: str, i: int) -> bool:
    return 0 <= i < len(text) and (text[i].isalnum() or text[i] == "_")


def _ipv6s(text: str) -> Iterator[Span]:
    if ":" not in text:
        return
    for m in _IPV6.finditer(text):
        start, end = m.span()
        if text[start] == ":" and text[start + 1:start + 2] != ":":  # "IP:2001:db8::1"
            start += 1
        s = text[start:end].rstrip(".")
        if s.endswith(":") and not s.endswith("::"):  # "... 2001:db8::1: next"
            s = s[:-1]
        end = start + len(s)
        if (s.count(":") >= 2 and s.strip(":.") and not _is_word(text, start - 1)
                and not _is_word(text, end) and _parses(ipaddress.IPv6Address, s)):
            yield start, end


def _phones(text: str) -> Iterator[Span]:
    yield from _longest(_PHONE_INTL, text, lambda s: 8 <= _ndigits(s) <= 15)
    yield from (m.span() for m in _PHONE_NANP.finditer(text))
    yield from _longest(_PHONE_NATIONAL, text, lambda s: 10 <= _ndigits(s) <= 11)


# (kind, fewest ASCII digits a match can contain, finder), in KINDS order. Most texts that miss
# the fast path hold only an amount or a count, and the digit minimum skips most finders for them.
_FINDERS: tuple[tuple[str, int, Callable[[str], Iterator[Span]]], ...] = (
    ("email", 0, _emails),
    ("iban", 2, lambda text: _longest(_IBAN, text, _iban_ok)),
    ("card", 13, lambda text: _longest(_CARD, text, _card_ok)),
    ("national_id", 6, lambda text: (m.span() for p in (_SSN, _NINO) for m in p.finditer(text))),
    ("ip", 0, _ipv6s),
    ("ip", 4, lambda text: (m.span() for m in _IPV4.finditer(text)
                            if _parses(ipaddress.IPv4Address, m.group()))),
    ("phone", 8, _phones),
)


def _candidates(text: str) -> Iterator[tuple[int, int, str]]:
    if _TRIGGER.search(text) is None:
        return
    digits = _ndigits(text)
    for kind, min_digits, finder in _FINDERS:
        if digits >= min_digits:
            for start, end in finder(text):
                yield start, end, kind


def find(text: str) -> list[tuple[int, int, str]]:
    """Non-overlapping (start, end, kind) spans in text order; earlier KINDS win overlaps."""
    spans: list[tuple[int, int, str]] = []  # sorted by start, non-overlapping
    for start, end, kind in _candidates(text):
        i = bisect_left(spans, (start,))
        if (i and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
            continue
        spans.insert(i, (start, end, kind))
    return spans


def redact(text: str) -> str:
    """Replace each PII span with its kind's placeholder; text without PII comes back as is."""
    if _TRIGGER.search(text) is None:  # the fast path, inlined: most queries stop here
        return text
    spans = find(text)
    if not spans:
        return text
    parts, pos = [], 0
    for start, end, kind in spans:
        parts += (text[pos:start], PLACEHOLDERS[kind])
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


def contains_pii(text: str) -> bool:
    return next(_candidates(text), None) is not None
