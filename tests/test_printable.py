"""Client-chosen strings shown to an operator: a tenant named with terminal escapes reaches the store
through a real server, and `infercache cache stats` prints it escaped; a log line of any process escapes
what its arguments hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from server.shared.printable import printable
from tests.helpers import wait_cached
from harness.servers import REPO

# ESC [ (colour, cursor), OSC 0 (window title) and OSC 52 (clipboard) ended by BEL and by ST, a CR that
# rewrites the line, a LF that forges the next one, a bidi override
HOSTILE = ("acme\x1b[2J\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x1b\\\rstore ok\n"
           "tenant-b                 minilm               1        999999         0\u202e")
CONTROLS = [chr(c) for c in (*range(0x20), 0x7f, *range(0x80, 0xa0))] + ["\u202e"]


def _shown(out: str) -> list[str]:
    return [c for c in CONTROLS if c in out.replace("\n", "")]


def test_cache_stats_escapes_a_tenant_name_a_client_chose(start_server):
    server = start_server(frontends=1)
    with server.client() as client:
        client.infer("minilm", "an ordinary question", tenant=HOSTILE)
        wait_cached(client, "minilm", "an ordinary question", tenant=HOSTILE)
    done = subprocess.run([sys.executable, "-m", "server", "cache", "stats", "--cache-dir", str(server.cache_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _shown(done.stdout), f"control characters reach the terminal: {done.stdout!r}"
    rows = done.stdout.splitlines()
    assert len(rows) == 3, rows  # the totals, the header, the one namespace: no line of the tenant's own
    assert rows[2].startswith(printable(HOSTILE)) and "\\x1b]52;" in rows[2] and "\\u202e" in rows[2]


LOGGED = textwrap.dedent("""
    import logging, sys
    from server.shared.process import setup_logging

    setup_logging("INFO", "test")
    hostile = sys.argv[1]
    logging.getLogger("infercache.test").warning("unknown tenant %s", hostile)
    try:
        try:
            {}[hostile]
        except KeyError as exc:
            raise ValueError(hostile) from exc
    except ValueError:
        logging.getLogger("infercache.test").exception("lookup failed")
""")


def test_a_log_line_escapes_what_its_arguments_hold():
    done = subprocess.run([sys.executable, "-c", LOGGED, HOSTILE], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert not _shown(done.stderr), f"control characters reach the log: {done.stderr!r}"
    lines = done.stderr.splitlines()
    assert "[test] infercache.test: unknown tenant acme\\x1b[2J" in lines[0]
    assert "store ok" not in lines[1] and lines[1].endswith("lookup failed")  # the next record, not a forged line
    assert lines[-1].startswith("ValueError: acme\\x1b[2J") and "\\x0dstore ok\\x0atenant-b" in lines[-1]
    assert [line for line in lines if line.startswith("KeyError: ")] == [f"KeyError: {printable(repr(HOSTILE))}"]
    assert "The above exception was the direct cause of the following exception:" in lines
    assert len(lines) == 11, lines  # two records, the second with two tracebacks (2 lines each: code from -c
    # shows no source line) and the 3 lines between them: no line of the client's
