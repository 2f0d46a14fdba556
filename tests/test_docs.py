"""The README and docs/ against the code: every setting documented with its default, the README's tour run
as written against a real server, every command, path and link in them real, the result files they cite
in place and self-describing, and no work history anywhere in them."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.sections import SECTIONS
from harness.servers import REPO, ServerProcess, free_port, link_model

DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
RESULTS = REPO / "bench" / "results"
MACHINES = ("2core", "h100", "h200", "h200x2")  # what a result file's name ends with (bench.machine()'s tag)


def rows(markdown: str, heading: str) -> dict[str, list[str]]:
    """The table rows under the first heading that contains `heading` (until the next heading of any
    level), keyed by the first cell's backquoted name."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    out: dict[str, list[str]] = {}
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            out[cells[0].strip("`")] = cells
    return out


def literal(value) -> str:
    """A default as the tables write it: YAML's spelling."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if value == ():
        return "{}"  # an empty mapping (prefix_cache.public_prompts)
    return str(value)


# --- configuration -----------------------------------------------------------------------------------

def test_every_server_setting_is_documented_with_its_default():
    from server.config import Config

    text = (DOCS / "configuration.md").read_text()
    documented: dict[str, list[str]] = {}
    for section in ("### server", "### cache", "### l2", "### kv", "### engines", "### security", "### fleet"):
        documented.update(rows(text, section))
    expected = {}
    for section in dataclasses.fields(Config):
        if section.name == "secrets":
            continue
        for setting in dataclasses.fields(section.default_factory()):
            expected[f"{section.name}.{setting.name}"] = setting.default
    missing = sorted(set(expected) - set(documented))
    assert not missing, f"docs/configuration.md lacks {missing}"
    stale = sorted(set(documented) - set(expected))
    assert not stale, f"docs/configuration.md documents settings the code does not have: {stale}"
    wrong = {name: (documented[name][1], literal(default)) for name, default in expected.items()
             if documented[name][1] != f"`{literal(default)}`"}
    assert not wrong, f"defaults in docs/configuration.md differ from server/config.py (doc, code): {wrong}"


def _model_defaults() -> dict[str, object]:
    """Every leaf key of a model's config.yaml, with the default that server/shared/models.py applies, or
    "required" where a config without the key does not load."""
    import yaml

    from server.shared.models import KNOWN_KEYS, ModelConfigError, load_model

    full = yaml.safe_load((REPO / "models" / "minilm" / "config.yaml").read_text())
    full.update({"engine": {"precision": "fp32"}, "privacy": {"pii": "redact"}, "l2": {"share_across_tenants": True},
                 "hot_keys": {"keep_text": True}})
    attribute = {"engine.precision": "precision", "privacy.pii": "pii", "l2.share_across_tenants": "share_features",
                 "hot_keys.keep_text": "hot_key_text", "normalize.synonyms": "key_variant",
                 "runtime": lambda spec: "upstream" if spec.upstream is not None else "local",
                 "cache.stale_if_error_s": "stale_if_error_s",
                 # (unset: one class, named "default", of cache.ttl_s)
                 "cache.classes": lambda spec: "" if spec.ttl_classes.names == ("default",) else spec.ttl_classes.pairs,
                 "cache.default_class": lambda spec: "" if spec.ttl_classes.names == ("default",) else spec.ttl_classes.default}
    generative = yaml.safe_load((REPO / "models" / "smollm2" / "config.yaml").read_text())
    out: dict[str, object] = {}
    for key, inner in KNOWN_KEYS.items():
        if key == "semantic":
            continue
        if key == "generate":  # a generative model's section: each key's default is its GenerationSpec field's
            for leaf in sorted(inner):
                config = json.loads(json.dumps(generative))
                config["generate"].pop(leaf, None)
                with tempfile.TemporaryDirectory() as tmp:
                    (Path(tmp) / "m").mkdir()
                    (Path(tmp) / "m" / "config.yaml").write_text(yaml.safe_dump(config))
                    out[f"generate.{leaf}"] = getattr(load_model(Path(tmp) / "m").generation, leaf)
            continue
        if key == "upstream":  # an upstream model's section: kind and urls required, the rest its UpstreamSpec's
            from server.shared.upstream_spec import UpstreamSpec, upstream_from_config

            config = {"kind": "openai", "urls": ["http://127.0.0.1:1/v1"]}
            for leaf in sorted(inner):
                if leaf in config:
                    with pytest.raises(ValueError):
                        upstream_from_config({k: v for k, v in config.items() if k != leaf}).check("embedding")
                    out[f"upstream.{leaf}"] = "required"
                else:
                    out[f"upstream.{leaf}"] = getattr(UpstreamSpec(), leaf)
            continue
        if key == "prefix_cache":  # a generative model's too: its PrefixSpec's defaults
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "m").mkdir()
                (Path(tmp) / "m" / "config.yaml").write_text(yaml.safe_dump(generative))
                spec = load_model(Path(tmp) / "m").prefix
            out.update({f"prefix_cache.{leaf}": getattr(spec, leaf) for leaf in sorted(inner)})
            continue
        for name in ([f"{key}.{n}" for n in sorted(inner)] if inner else [key]):
            outer, _, leaf = name.partition(".")
            config = json.loads(json.dumps(full))
            if leaf:
                config.get(outer, {}).pop(leaf, None)
            else:
                config.pop(outer, None)
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "m").mkdir()
                (Path(tmp) / "m" / "config.yaml").write_text(yaml.safe_dump(config))
                try:
                    spec = load_model(Path(tmp) / "m")
                except ModelConfigError as exc:
                    assert "missing required setting" in str(exc), exc
                    out[name] = "required"
                    continue
            assert name in attribute, f"{name} has a default: tell this test which ModelSpec field holds it"
            found = attribute[name]
            out[name] = found(spec) if callable(found) else getattr(spec, found)
    return out


def test_every_model_setting_is_documented_with_its_default():
    text = (DOCS / "configuration.md").read_text()
    documented = rows(text, "## Model settings")
    expected = _model_defaults()
    missing = sorted(set(expected) - set(documented))
    assert not missing, f"docs/configuration.md lacks model settings {missing}"
    assert "semantic" in documented
    wrong = {}
    for name, default in expected.items():
        cell = documented[name][1]
        if cell != ("required" if default == "required" else f"`{literal(default)}`"):
            wrong[name] = (cell, default)
    assert not wrong, f"model defaults in docs/configuration.md differ from server/shared/models.py: {wrong}"


def test_every_semantic_policy_setting_is_documented_with_its_default():
    from server.shared.match_policy import CalibratedPolicy, MatchPolicy

    text = (DOCS / "configuration.md").read_text()
    for heading, policy, extra in (("the calibrated rule", CalibratedPolicy, {"semantic.enabled": False}),
                                   ("the fixed consensus rule", MatchPolicy, {})):
        documented = rows(text, heading)
        expected = {f"semantic.{f.name}": f.default for f in dataclasses.fields(policy)} | extra
        assert set(documented) == set(expected), (heading, sorted(set(documented) ^ set(expected)))
        wrong = {n: (documented[n][1], d) for n, d in expected.items() if documented[n][1] != f"`{literal(d)}`"}
        assert not wrong, (heading, wrong)


def test_every_semantic_answers_setting_is_documented_with_its_default():
    from server.shared.answer_match import AnswerMatchPolicy, answer_match_from_config
    from server.shared.match_policy import CalibratedPolicy

    documented = rows((DOCS / "configuration.md").read_text(), "semantic answers (generative models)")
    policy = answer_match_from_config({"enabled": True, "judge": "j"})
    expected = {f"semantic.{f.name}": getattr(policy.rule, f.name) for f in dataclasses.fields(CalibratedPolicy)}
    expected |= {"semantic.enabled": False, "semantic.context": policy.context}
    judges = {"semantic.judge", "semantic.answer_cosine"}  # one of the two, no default
    assert set(documented) == set(expected) | judges, sorted(set(documented) ^ (set(expected) | judges))
    assert all(documented[name][1] == "one of these two" for name in judges)
    wrong = {n: (documented[n][1], d) for n, d in expected.items() if documented[n][1] != f"`{literal(d)}`"}
    assert not wrong, wrong
    assert {f.name for f in dataclasses.fields(AnswerMatchPolicy)} == {"judge", "rule", "context", "answer_cosine"}


# --- the README's tour, run as written against a real server -------------------------------------------

def _section(markdown: str, heading: str) -> str:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## ") and heading in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def _blocks(markdown: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", markdown, re.S)]


def _expected(code: str) -> list[str]:
    """What the tour says its prints show: the comment after each print( line ("..." matches anything)."""
    return [line.split("#", 1)[1].strip() for line in code.splitlines()
            if line.strip().startswith("print(") and "#" in line]


def _shows(line: str, expected: str) -> bool:
    position = 0
    for piece in expected.split("..."):
        found = line.find(piece.strip(), position)
        if found < 0:
            return False
        position = found + len(piece.strip())
    return True


def test_readme_tour_runs_as_written(tmp_path):
    """Each fenced block of the tour, in order: the shell lines as written (`make run` is the server this
    test starts, on ports and folders of its own), the Python with its prints showing what the comments say."""
    tour = _section(README.read_text(), "tour")
    blocks = _blocks(tour)
    assert [kind for kind, _ in blocks].count("python") >= 1 and any(kind == "sh" for kind, _ in blocks)
    models = tmp_path / "models"
    link_model(models, "minilm", (REPO / "models" / "minilm" / "config.yaml").read_text(),
               {"1": REPO / "models" / "minilm" / "1"})
    link_model(models, "smollm2", (REPO / "models" / "smollm2" / "config.yaml").read_text(),
               {"1": REPO / "models" / "smollm2" / "1"})
    server: ServerProcess | None = None
    metrics_port = free_port()
    try:
        for kind, code in blocks:
            if kind == "sh":
                for line in code.splitlines():
                    command = line.split("  #", 1)[0].strip()
                    if not command or command.startswith("#"):  # a comment: what the command shows
                        continue
                    if command.startswith("make run"):
                        assert "--metrics-port 9464" in command
                        (tmp_path / "server").mkdir()
                        server = ServerProcess(tmp_path / "server", models,
                                               settings=(f"server.metrics_port={metrics_port}",))
                        continue
                    if "train-head" in command:
                        command += f" --models-dir {models}"
                    command = command.replace("9464", str(metrics_port))
                    expected = [l.lstrip("# ").strip() for l in code.splitlines() if l.startswith("# ")]
                    for _ in range(50 if expected else 1):  # /metrics lags the calls by up to a second
                        done = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True,
                                              timeout=300)
                        if done.returncode == 0 and all(e in done.stdout for e in expected):
                            break
                        time.sleep(0.1)
                    assert done.returncode == 0, (command, done.stdout, done.stderr)
                    assert all(e in done.stdout for e in expected), (command, expected, done.stdout)
            elif kind == "python":
                assert server is not None, "the tour calls the server before starting it"
                source = code.replace("127.0.0.1:50051", server.address)
                done = subprocess.run([sys.executable, "-c", source], cwd=REPO, capture_output=True, text=True,
                                      timeout=120)
                assert done.returncode == 0, done.stderr
                printed = done.stdout.splitlines()
                expected = _expected(code)
                assert len(printed) == len(expected), (printed, expected)
                for line, want in zip(printed, expected):
                    assert _shows(line, want), f"printed {line!r}, the README says {want!r}"
        assert server is not None
        assert server.stop() == 0
    finally:
        if server is not None:
            server.stop()


# --- commands, paths and links ------------------------------------------------------------------------

def _shell_lines(page: Path) -> list[tuple[str, bool]]:
    """Command lines of the page's shell blocks and indented code, and (inline: True) its inline code that
    starts with a command, which may name a command without its arguments."""
    text = page.read_text()
    lines = []
    for kind, code in _blocks(text):
        if kind in ("sh", "bash", "console"):
            joined = code.replace("\\\n", " ")
            lines += [(l.split("  #", 1)[0].strip(), False) for l in joined.splitlines()
                      if l.strip() and not l.startswith("#")]
    for inline in re.findall(r"`([^`\n]+)`", text):
        if re.match(r"(make |\.venv/bin/infercache |infercache |python -m bench|bash bench/)", inline):
            lines.append((inline, True))
    for code in re.findall(r"^    ((?:make|infercache|\.venv/bin/infercache|python -m) .*)$", text, re.M):
        lines.append((code.split("  #", 1)[0].strip(), False))
    return lines


def _subcommands() -> set[str]:
    import contextlib
    import io

    from server.__main__ import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"])
    return set(re.search(r"\{([a-z,-]+)\}", out.getvalue()).group(1).split(","))


def _bench_flags(module: str) -> set[str]:
    path = REPO / Path(*module.split(".")) if module != "bench" else REPO / "bench" / "__main__.py"
    source = (path.with_suffix(".py") if module != "bench" else path).read_text()
    return set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', source))


BENCH_SECTIONS = set(SECTIONS)


def test_the_layout_names_every_module_in_its_folders_row():
    """docs/contributing.md's layout: each module of server/ and cachestore/ is named in the row of its folder."""
    page = (DOCS / "contributing.md").read_text()
    block = page[page.index("## Layout"):]
    block = block[block.index("```") + 3:]
    rows: dict[str, str] = {}
    folder = None
    for line in block[:block.index("```")].splitlines():
        if line and not line[0].isspace():
            folder, _, line = line.partition(" ")
            rows[folder] = ""
        if folder is not None:
            rows[folder] += " " + line
    missing = []
    for root in ("server", "cachestore"):
        for path in sorted((REPO / root).rglob("*.py")):
            folder = path.parent.relative_to(REPO).as_posix() + "/"
            if path.name != "__init__.py" and not re.search(rf"\b{path.stem}\b", rows.get(folder, "")):
                missing.append(path.relative_to(REPO).as_posix())
    assert not missing, f"docs/contributing.md's layout does not name {missing} in its folder's row"


def test_the_upstream_configs_load_as_written(tmp_path):
    """docs/upstreams.md's configs are complete: each loads as a model's config.yaml."""
    from server.shared.models import load_model

    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "upstreams.md").read_text(), re.S)
    assert len(blocks) == 4
    for n, block in enumerate(blocks):
        (tmp_path / f"m{n}").mkdir()
        (tmp_path / f"m{n}" / "config.yaml").write_text(block)
        spec = load_model(tmp_path / f"m{n}")
        assert spec.upstream is not None and spec.upstream.urls, block



@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_name_real_targets_subcommands_and_options(page):
    from server.__main__ import parse_args

    targets = set(re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), re.M))
    subcommands = _subcommands()
    for line, inline in _shell_lines(page):
        for command in re.split(r"\s*(?:\|\||&&|;|\|)\s*", line):
            words = shlex.split(command.split(" > ", 1)[0])
            while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                words = words[1:]
            if not words:
                continue
            if words[0] == "make":
                assert words[1] in targets, f"{page.name}: make {words[1]} is no Makefile target"
                args = next((w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")), "")
                if words[1] == "bench":
                    _check_bench_args("bench", shlex.split(args), page)
                elif words[1] == "soak":
                    _check_bench_args("bench.soak", shlex.split(args), page)
            elif words[0] in ("infercache", ".venv/bin/infercache"):
                argv = [w for w in words[1:] if not w.startswith("[")]
                if any(w in ("...", "<token>") or w.startswith("[") for w in words):
                    continue
                try:
                    parse_args(argv)
                except SystemExit as exc:
                    if exc.code != 0 and not (inline and argv and argv[0] in subcommands):
                        pytest.fail(f"{page.name}: `{command}` does not parse ({exc})")
            elif words[:2] == ["python", "-m"] or words[:2] == [".venv/bin/python", "-m"]:
                module = words[2]
                if module.startswith("bench"):
                    assert (REPO / Path(*module.split("."))).with_suffix(".py").is_file() or module == "bench"
                    _check_bench_args(module, words[3:], page)
            elif words[0] == "bash" and words[1].startswith("bench/"):
                assert (REPO / words[1]).is_file(), words[1]
                _check_bench_args("bench", words[2:], page)


def _check_bench_args(module: str, argv: list[str], page: Path) -> None:
    flags = _bench_flags(module)
    for i, word in enumerate(argv):
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in flags, f"{page.name}: python -m {module} has no {flag}"
            if flag == "--sections":
                for name in argv[i + 1].split(","):
                    assert name in BENCH_SECTIONS, f"{page.name}: no bench section {name!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"
    for anchor_page, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        linked = (page.parent / anchor_page) if anchor_page else page
        assert anchor in _anchors(linked.read_text()), f"{page.name} links {anchor_page}#{anchor}: no such heading"
    folders = "bench|server|cachestore|tests|deploy|protos|infercache|examples|models|docs"
    for path in re.findall(rf"`((?:{folders})/[^`\s*{{}}<>]+)`", text):
        path = path.rstrip(".,:;")
        assert (REPO / path).exists(), f"{page.name} names {path}, which does not exist"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


# --- result files --------------------------------------------------------------------------------------

def test_result_files_are_named_for_what_they_measure_and_record_how():
    files = sorted(RESULTS.iterdir())
    assert files
    pattern = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*-(%s)\.json$" % "|".join(MACHINES))
    cited = (DOCS / "benchmarks.md").read_text()
    for path in files:
        assert path.is_file() and pattern.match(path.name), f"bench/results/{path.name}: not <what>-<machine>.json"
        recorded = json.loads(path.read_text())["recorded"]
        for field in ("command", "machine", "commit", "date"):
            assert recorded.get(field), f"{path.name}: recorded.{field} is missing"
        assert f"bench/results/{path.name}" in cited, f"docs/benchmarks.md does not cite {path.name}"


# --- the pages themselves ------------------------------------------------------------------------------

HISTORY = re.compile(r"\bsessions? ?\d+|\bsession[- ]?\d|after\s+the\s+review|\breview\s+fix|\brun [A-D1-9]\b|"
                     r"\brun[- ]?\d+\b|\bissue \d+|DEVICE_NOTES|\.\./shared", re.I)


@pytest.mark.parametrize("path", [*PAGES, *sorted(RESULTS.iterdir())], ids=lambda p: p.name)
def test_no_work_history(path):
    found = HISTORY.findall(path.name + "\n" + path.read_text())
    assert not found, f"{path.name} tells work history: {found[:5]}"


def test_readme_is_short_and_starts_with_the_two_commands():
    raw = README.read_bytes()
    assert len(raw) <= 15_000, f"README.md is {len(raw)} bytes"
    lines = README.read_text().splitlines()
    commands = [l.split("#")[0].strip() for l in lines[:6] if l.startswith("    make")]
    assert commands[:2] == ["make run", "make test"], lines[:6]
