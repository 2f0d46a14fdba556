"""A store folder setting that names a file: the server says what is wrong and does not start, and leaves
the file as it was (it used to claim it had moved the store aside and started a fresh one, while the file
stayed, an empty folder appeared beside it, and every request was a miss)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.servers import REPO


@pytest.mark.parametrize("setting", ["cache.dir", "l2.dir"])
def test_a_store_folder_that_is_a_file_stops_the_start_with_the_reason(start_server, tmp_path, setting):
    path = tmp_path / "not-a-folder"
    path.write_text("an operator's file\n")
    where = {"cache_dir": path} if setting == "cache.dir" else {"settings": (f"{setting}={path}",)}
    server = start_server(frontends=1, wait=False, **where)
    assert server.proc.wait(120) != 0
    log = server.log_text()
    assert f"{setting} {path} is a file, not a directory" in log, log
    assert "starting a fresh one" not in log and "Traceback" not in log
    assert path.read_text() == "an operator's file\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("not-a-folder")) == ["not-a-folder"]


def test_cache_stats_says_the_folder_is_a_file(tmp_path):
    path = tmp_path / "not-a-folder"
    path.write_text("an operator's file\n")
    done = subprocess.run([sys.executable, "-m", "server", "cache", "stats", "--cache-dir", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"cache.dir {path} is a file, not a directory" in done.stdout + done.stderr
    assert "damaged" not in done.stdout + done.stderr and "moves it aside" not in done.stdout + done.stderr
