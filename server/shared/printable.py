"""Strings a client chose (a tenant, a text, a model name it asked for), made safe to show an operator: in
a terminal (`infercache cache stats`, `cache hot`) and in a log line.

Raw, such a string could carry terminal escapes (ESC [ ... for colours and cursor moves, ESC ] ... for
OSC: window titles, hyperlinks, clipboard writes on some terminals), a CR that rewrites the line shown, a
LF that forges a line of its own, or bidi overrides that reorder what is read. Every character that
`str.isprintable` refuses (controls C0 and C1, DEL, format characters such as bidi overrides and
zero-width ones, line and paragraph separators, spaces other than " ", unassigned and private-use code
points) is written as a Python escape (\\x1b, \\u202e), and so is the backslash (\\\\), so that no
escaped text can pass for another. What is printable stays as it is, any script included.
"""

from __future__ import annotations

import logging
import traceback


def printable(value: str, keep: str = "") -> str:
    """`value` with what a terminal could act on escaped (see the module docstring); characters in `keep`
    (a traceback's "\\n") pass as they are."""
    if value.isprintable() and "\\" not in value:
        return value
    out = []
    for char in value:
        if char in keep or (char.isprintable() and char != "\\"):
            out.append(char)
        elif char == "\\":
            out.append("\\\\")
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def _traceback(te: traceback.TracebackException):
    """TracebackException.format's lines, each exception's own message escaped whole: a message is where a
    client's string can be (frames come from the server's files), and its line breaks are escaped too."""
    if te.__cause__ is not None:
        yield from _traceback(te.__cause__)
        yield "\nThe above exception was the direct cause of the following exception:\n\n"
    elif te.__context__ is not None and not te.__suppress_context__:
        yield from _traceback(te.__context__)
        yield "\nDuring handling of the above exception, another exception occurred:\n\n"
    if te.stack:
        yield "Traceback (most recent call last):\n"
        yield from (printable(frame, keep="\n") for frame in te.stack.format())
    yield from (printable(line.rstrip("\n")) + "\n" for line in te.format_exception_only())


class PrintableFormatter(logging.Formatter):
    """Log records with their message escaped (a client's string among its arguments can neither break the
    line nor reach the terminal as an escape), and so are the messages in a traceback."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return "".join(_traceback(traceback.TracebackException(*ei))).rstrip("\n")

    def formatStack(self, stack_info: str) -> str:
        return printable(stack_info, keep="\n")
