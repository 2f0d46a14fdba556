"""A real Prometheus process for tests that check /metrics end to end: it scrapes the given targets every
second, evaluates the given rule files every second, and answers PromQL over its HTTP API. Debian's
`prometheus` (`make test` installs it). Ready in well under a second, but its first scrape comes about
5 s after start (Prometheus hands discovered targets to the scrapers at most every 5 s): wait_for `up`.

    prom = PrometheusProcess(tmp_path, ["127.0.0.1:9464"], rule_files=[REPO / "deploy/prometheus/alerts.yml"])
    try:
        prom.wait_for('up{job="infercache"}', lambda r: r and r[0]["value"][1] == "1")
        prom.query("sum(rate(infercache_requests_total[1m]))")   # [{"metric": {...}, "value": [ts, "0.5"]}]
    finally:
        prom.stop()
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from harness.servers import free_port

READY_TIMEOUT_S = 30.0


def available() -> str | None:
    """Why Prometheus cannot run here, or None."""
    if shutil.which("prometheus") is None:
        return "prometheus not installed (make test installs it: apt-get install prometheus)"
    return None


def sample_value(sample: dict) -> float:
    """The number of one instant-query result ({"metric": ..., "value": [ts, "1.5"]})."""
    return float(sample["value"][1])


class PrometheusError(RuntimeError):
    """The API answered an error (a bad expression, a timeout): its errorType and error."""


class PrometheusProcess:
    """`prometheus` on a free port of 127.0.0.1, its data and log in workdir/prometheus-PORT/.

    targets: host:port of the endpoints to scrape (job `job`, path `metrics_path`). port: the port to
    listen on (default a free one); pass one and its address as a target for Prometheus to scrape itself.
    """

    def __init__(self, workdir: Path, targets: Sequence[str], *, rule_files: Iterable[Path | str] = (),
                 job: str = "infercache", metrics_path: str = "/metrics", interval: str = "1s",
                 port: int | None = None, wait: bool = True) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(workdir) / f"prometheus-{self.port}"
        self.dir.mkdir(parents=True)
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(self._config(targets, rule_files, job, metrics_path, interval))
        self.log_path = self.dir / "prometheus.log"
        self.args = ["prometheus", f"--config.file={self.config_path}", f"--storage.tsdb.path={self.dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.proc: subprocess.Popen | None = None
        self.start(wait=wait)

    @staticmethod
    def _config(targets: Sequence[str], rule_files: Iterable[Path | str], job: str, metrics_path: str,
                interval: str) -> str:
        # JSON is YAML: no PyYAML needed, and every string is quoted
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(Path(f).resolve()) for f in rule_files],
            "scrape_configs": [{"job_name": job, "metrics_path": metrics_path,
                                "static_configs": [{"targets": list(targets)}]}],
        }
        return json.dumps(config, indent=2) + "\n"

    def start(self, wait: bool = True) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own descriptor
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()  # a Prometheus that did not come up must not outlive the caller
                raise

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until GET /-/ready answers 200 (the TSDB is open and the rules are loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"prometheus on {self.port} exited:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus on {self.port} not ready after {timeout} s:\n{self.log_text()}")
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    # ---------------------------------------------------------------------------------------- the API

    def _api(self, path: str, params: dict[str, str], timeout: float = 10.0):
        """POSTs the form (an expression may be longer than a URL can be) and returns `data`."""
        body = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=body,
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:  # 400 bad_data, 422 execution, 503 timeout: JSON bodies too
            try:
                answer = json.load(exc)
            except ValueError:
                raise PrometheusError(f"{path} {params}: HTTP {exc.code}") from exc
        if answer.get("status") != "success":
            raise PrometheusError(f"{params.get('query')!r}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str, at: float | None = None) -> list:
        """Instant query (now, or at unix time `at`): the result list, [] when nothing matches. A scalar or
        string result comes back as one sample with empty labels."""
        params = {"query": expr}
        if at is not None:
            params["time"] = repr(float(at))
        data = self._api("/api/v1/query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float | str) -> list:
        """Range query between unix times: [{"metric": {...}, "values": [[ts, "v"], ...]}, ...]."""
        data = self._api("/api/v1/query_range", {"query": expr, "start": repr(float(start)),
                                                 "end": repr(float(end)), "step": str(step)})
        return data["result"]

    def wait_for(self, expr: str, predicate: Callable[[list], bool], timeout: float = 15.0,
                 interval: float = 0.2) -> list:
        """Polls the instant query until predicate(result) is true and returns that result; TimeoutError
        (with the last result) otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} did not satisfy the predicate within {timeout} s; last: {result}")
            time.sleep(interval)

    def targets(self) -> list[dict]:
        """The active scrape targets (health, lastError...): what to look at when `up` stays 0."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as response:
            return json.load(response)["data"]["activeTargets"]

    # ------------------------------------------------------------------------------------------ stop

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def __enter__(self) -> PrometheusProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
