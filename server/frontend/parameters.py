"""Numbers the doors read from text (an HTTP header, a KServe string parameter): ASCII digits only, of a
bounded length, so that no Unicode digit, sign, space or 5,000-digit value reaches int()."""

from __future__ import annotations

from server.shared.errors import InvalidArgument

MAX_SECONDS = (1 << 32) - 1  # CachePolicy.max_age_s is a uint32


def whole_seconds(value: str | bytes | float | int, what: str) -> int:
    """`value` as a whole number of seconds within 0..MAX_SECONDS: digits (text), a whole number, or a whole
    float (tritonclient sends 60.0 as a double); anything else is INVALID_ARGUMENT naming `what`."""
    if isinstance(value, (str, bytes)):
        digits = value.strip()
        if isinstance(digits, str):
            digits = digits.encode("ascii", "replace")
        number = int(digits) if digits.isdigit() and len(digits) <= 10 else -1
    elif isinstance(value, float):
        number = int(value) if value.is_integer() else -1
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        number = -1
    if not 0 <= number <= MAX_SECONDS:
        raise InvalidArgument(f"{what} must be a whole number of seconds within 0..{MAX_SECONDS}")
    return number
