"""deploy/k8s: the sidecar manifests, checked offline.

Each kustomization (base, gpu) is rendered here by a small renderer that knows exactly the kustomize
features these files use (resources, images, strategic merge patches); where kubectl is installed, its
own `kubectl kustomize` output must agree. Every rendered document, and every complete resource file,
is validated in strict mode (unknown fields fail) against the Kubernetes JSON schemas bundled with
kubernetes-validate, pinned to one Kubernetes version. Then the Deployment is checked against the
server's own config, loaded from the ConfigMap through server/config.py: probes, drain budget, writable
paths, volume sizes, metrics, security context.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from server import config as config_mod
from server.__main__ import parse_args

K8S_VERSION = "1.33.0"  # the schemas every manifest must satisfy (bundled with kubernetes-validate 1.37.0)
ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("base", "gpu")
SIDECAR = "infercache"
SUPERVISOR_EXTRA_S = 5  # server/supervisor.py _stop: each group gets drain_s + 5 s before it is killed
UID = 10001


# --- a minimal kustomize -------------------------------------------------------------------------

# Strategic merge: lists merged element by element on these keys (as Kubernetes declares them); any
# other list is replaced by the patch's.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath",
              "env": "name", "ports": "containerPort", "imagePullSecrets": "name"}


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def strategic_merge(base: dict, patch: dict) -> dict:
    """base with patch applied: maps merged, null deletes a key, keyed lists merged by MERGE_KEYS (an
    element with `$patch: delete` removes its namesake)."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(key, str) and key.startswith("$"):
            raise AssertionError(f"patch directive {key} is not supported by this renderer")
        if value is None:
            out.pop(key, None)
        elif key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = strategic_merge(out[key], value)
        elif key in out and isinstance(out[key], list) and isinstance(value, list) and key in MERGE_KEYS:
            merged, field = list(out[key]), MERGE_KEYS[key]
            for item in value:
                at = next((i for i, old in enumerate(merged) if old.get(field) == item.get(field)), None)
                if item.get("$patch") == "delete":  # the element named by its merge key goes
                    if at is not None:
                        del merged[at]
                elif at is None:
                    merged.append(_without_nulls(item))
                else:
                    merged[at] = strategic_merge(merged[at], item)
            out[key] = merged
        else:
            out[key] = _without_nulls(value)
    return out


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _split_image(image: str) -> tuple[str, str]:
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:  # no tag, or the colon belonged to a registry's port
        return image, ""
    return name, tag


def _set_images(doc: dict, rules: list[dict]) -> None:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name, tag = _split_image(container["image"])
        for rule in rules:
            if rule["name"] == name:
                name, tag = rule.get("newName", name), rule.get("newTag", tag)
                container["image"] = f"{name}:{tag}" if tag else name


def _render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "images", "patches"}
    assert set(kustomization) <= known, f"{directory}: kustomize features this renderer lacks: {set(kustomization) - known}"
    assert kustomization["kind"] == "Kustomization"
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += _render(path) if path.is_dir() else _documents(path)
    for entry in kustomization.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only patches given by path are supported: {entry}"
        for patch in _documents(directory / entry["path"]):
            targets = [i for i, doc in enumerate(docs) if doc["kind"] == patch["kind"]
                       and doc["metadata"]["name"] == patch["metadata"]["name"]]
            assert len(targets) == 1, f"patch {entry['path']} matches {len(targets)} resources"
            docs[targets[0]] = strategic_merge(docs[targets[0]], patch)
    for doc in docs:
        _set_images(doc, kustomization.get("images", []))
    return docs


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(_render(K8S / overlay))


def rendered(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(overlay)))


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def container(docs: list[dict], name: str = SIDECAR) -> dict:
    found = [c for c in pod_spec(docs)["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container {name}"
    return found[0]


def volume_of(docs: list[dict], name: str) -> dict:
    return next(v for v in pod_spec(docs)["volumes"] if v["name"] == name)


_UNITS = {"": 1, "k": 1000, "M": 1000 ** 2, "G": 1000 ** 3, "T": 1000 ** 4,
          "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "Ti": 1024 ** 4, "m": 0.001}


def quantity(value) -> float:
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert match and match.group(2) in _UNITS, f"quantity {value!r}"
    return float(match.group(1)) * _UNITS[match.group(2)]


# --- the config in the ConfigMap, through the server's own loader -----------------------------------

def config_path_in_container(docs: list[dict]) -> str:
    """The file `--config` names, checked against the command line parser of `infercache serve`."""
    command = container(docs)["command"] + container(docs).get("args", [])
    assert command[:2] == ["infercache", "serve"], command
    args = parse_args(command[1:])
    assert args.config, "the sidecar must be started with --config"
    return args.config


def config_text(docs: list[dict]) -> str:
    path = config_path_in_container(docs)
    mount = next(m for m in container(docs)["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = volume_of(docs, mount["name"])
    configmap = one(docs, "ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    return configmap["data"][path[len(mount["mountPath"].rstrip("/")) + 1:]]


def load_config(docs: list[dict], tmp_path: Path) -> config_mod.Config:
    """The ConfigMap's config.yaml with the sidecar's environment, as `infercache serve` would read them."""
    path = tmp_path / "config.yaml"
    path.write_text(config_text(docs))
    environ = {e["name"]: e["value"] for e in container(docs).get("env", [])}
    return config_mod.load(str(path), environ, {})


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture
def docs(overlay) -> list[dict]:
    return rendered(overlay)


@pytest.fixture
def config(docs, tmp_path) -> config_mod.Config:
    return load_config(docs, tmp_path)


# --- schemas ----------------------------------------------------------------------------------------

def test_pinned_schemas_are_bundled_and_strict_mode_rejects_unknown_fields():
    assert K8S_VERSION in kv.all_versions()
    deployment = one(rendered("base"), "Deployment")
    assert kv.validate(deployment, K8S_VERSION, strict=True) == "1.33"  # that version's own schemas
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, K8S_VERSION, strict=True)
    named_port = copy.deepcopy(deployment)  # gRPC probes take a number, not a port's name
    named_port["spec"]["template"]["spec"]["containers"][1]["livenessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(named_port, K8S_VERSION, strict=True)


def test_rendered_documents_validate(docs):
    kinds = sorted(d["kind"] for d in docs)
    assert {"ConfigMap", "Deployment", "NetworkPolicy", "Service"} <= set(kinds), kinds
    for doc in docs:
        assert kv.validate(doc, K8S_VERSION, strict=True) == "1.33", doc["metadata"]["name"]


def test_every_complete_resource_file_validates():
    """Each manifest on its own (patches are validated merged, above)."""
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and not p.stem.endswith("-patch"))
    assert len(files) >= 5, files
    for path in files:
        for doc in _documents(path):
            assert kv.validate(doc, K8S_VERSION, strict=True) == "1.33", path


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: the renderer here is the check")
def test_kubectl_kustomize_agrees_with_the_renderer(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def normal(value):  # kustomize may reorder keyed list elements
        if isinstance(value, dict):
            return {k: normal(v) for k, v in value.items()}
        if isinstance(value, list):
            items = [normal(v) for v in value]
            return sorted(items, key=lambda v: json.dumps(v, sort_keys=True)) if all(isinstance(v, dict) for v in items) \
                else items
        return value
    theirs = {(d["kind"], d["metadata"]["name"]): normal(d) for d in yaml.safe_load_all(out.stdout) if d}
    ours = {(d["kind"], d["metadata"]["name"]): normal(d) for d in rendered(overlay)}
    assert theirs == ours


# --- the Deployment against the server's config -----------------------------------------------------

def test_config_loads_through_the_server_loader(config, docs):
    assert config.server.port == 50051
    assert config.server.host == "0.0.0.0"  # kubelet probes dial the pod IP
    environ = {e["name"] for e in container(docs).get("env", [])}
    assert not {n for n in environ if n.startswith("INFERCACHE_")}, "env would override the config file"
    assert pod_spec(docs)["enableServiceLinks"] is False  # Service env vars named INFERCACHE_* stop the server
    app = container(docs, "app")
    assert {"name": "INFERCACHE_ADDR", "value": f"localhost:{config.server.port}"} in app["env"]


def test_a_bad_key_in_the_configmap_fails_the_loader(docs, tmp_path):
    configmap = one(docs, "ConfigMap")
    configmap["data"]["config.yaml"] += "    not_a_setting: 1\n"
    with pytest.raises(config_mod.ConfigError, match="not_a_setting"):
        load_config(docs, tmp_path)


def test_probes_are_grpc_on_the_server_port(config, docs):
    sidecar = container(docs)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports["grpc"] == config.server.port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sidecar[kind]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
        assert probe["grpc"]["port"] == config.server.port, kind
        assert probe["grpc"].get("service", "") == "", kind  # the server-wide status
    startup = sidecar["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60  # model loading takes seconds


def test_grace_period_covers_prestop_and_both_drains(config, docs):
    pre_stop = container(docs)["lifecycle"]["preStop"]
    sleep_s = pre_stop["sleep"]["seconds"]
    assert sleep_s > 0
    drain = sleep_s + 2 * (config.server.drain_s + SUPERVISOR_EXTRA_S)  # frontends, then workers
    assert pod_spec(docs)["terminationGracePeriodSeconds"] > drain


def test_security_context(docs):
    spec = pod_spec(docs)
    pod = spec["securityContext"]
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    assert not [v for v in spec["volumes"] if "hostPath" in v], "hostPath only as a documented variant"
    for c in spec["containers"] + spec.get("initContainers", []):
        effective = {**pod, **c.get("securityContext", {})}
        assert effective["runAsNonRoot"] is True, c["name"]
        assert effective["runAsUser"] == UID, c["name"]
        assert effective["readOnlyRootFilesystem"] is True, c["name"]
        assert effective["allowPrivilegeEscalation"] is False, c["name"]
        assert effective["capabilities"]["drop"] == ["ALL"] and not effective["capabilities"].get("add")
        assert effective["seccompProfile"]["type"] == "RuntimeDefault", c["name"]
        assert not effective.get("privileged"), c["name"]


def _mount_for(docs: list[dict], path: str) -> tuple[dict, dict]:
    """The sidecar's mount holding `path` (the longest prefix) and its volume."""
    path = str(Path(path))
    mounts = [m for m in container(docs)["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on the read-only root filesystem"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, volume_of(docs, mount["name"])


def test_every_path_the_server_writes_is_on_a_writable_volume(config, docs):
    written = {"cache.dir": config.cache.dir, "l2 store": str(config_mod.feature_store_settings(config).path),
               "engines.dir": config.engines.dir, "server.socket_dir": config.server.socket_dir,
               "$HOME": next(e["value"] for e in container(docs)["env"] if e["name"] == "HOME")}
    for what, path in written.items():
        assert path.startswith("/"), f"{what} {path}: relative to the image's working directory"
        mount, volume = _mount_for(docs, path)
        assert not mount.get("readOnly"), what
        assert set(volume) & {"emptyDir", "persistentVolumeClaim"}, f"{what}: {volume}"
    assert config.server.socket_dir, "server.socket_dir: set it on the tmp volume"
    # cache.dir: an emptyDir, and a folder inside it (a damaged store is moved to a sibling folder)
    mount, volume = _mount_for(docs, config.cache.dir)
    assert "emptyDir" in volume
    assert Path(config.cache.dir) != Path(mount["mountPath"])


def test_cache_volume_holds_both_lmdb_maps(config, docs):
    mib = 1024 ** 2
    _, volume = _mount_for(docs, config.cache.dir)
    limit = quantity(volume["emptyDir"]["sizeLimit"])
    maps = config.cache.map_size_mb * mib
    _, features_volume = _mount_for(docs, str(config_mod.feature_store_settings(config).path))
    if features_volume["name"] == volume["name"]:
        maps += config.l2.map_size_mb * mib
    assert limit > config.cache.budget_mb * mib
    assert limit >= maps + 256 * mib, "the kubelet evicts the pod past sizeLimit, and the server cannot see it"


def test_resources_fit_the_process_counts(config, docs):
    resources = container(docs)["resources"]
    for kind in ("cpu", "memory"):
        assert quantity(resources["limits"][kind]) >= quantity(resources["requests"][kind]) > 0, kind
    cpus = quantity(resources["limits"]["cpu"])
    assert 1 <= config.server.frontends <= cpus, "server.frontends must be set (0 = one per node CPU)"
    assert config.server.workers >= 1, "server.workers must be set (0 = count what the container sees)"
    if config.engines.runtime == "onnxruntime":
        assert 1 <= config.server.engine_threads <= cpus, "engine_threads must be set (0 = node CPUs)"


def test_metrics_port_is_exposed_and_annotated(config, docs):
    assert config.server.metrics_port == 9090 and config.server.metrics_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports["metrics"] == config.server.metrics_port
    template = one(docs, "Deployment")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.server.metrics_port)
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] in (["metrics"], [config.server.metrics_port])


def test_only_the_metrics_port_is_open_to_other_pods(config, docs):
    if config.security.tokens_file or config_mod._loopback(config.server.host):
        pytest.skip("the gRPC port needs no network policy")
    policy = one(docs, "NetworkPolicy")
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    opened = []
    for rule in policy["spec"].get("ingress", []):
        assert rule.get("ports"), "a rule without ports opens every port, the cache's included"
        opened += [p["port"] for p in rule["ports"]]
    assert config.server.port not in opened and "grpc" not in opened
    assert config.server.metrics_port in opened


def test_base_and_gpu_differ_where_they_should(tmp_path):
    base, gpu = rendered("base"), rendered("gpu")
    assert container(base)["image"] == "infercache:cpu"
    assert container(gpu)["image"] == "infercache:cuda"
    assert container(gpu, "app")["image"] == container(base, "app")["image"]
    limits = container(gpu)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(base)["resources"]["limits"]
    assert quantity(limits["memory"]) > quantity(container(base)["resources"]["limits"]["memory"])
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in pod_spec(gpu)["tolerations"])
    (tmp_path / "gpu").mkdir()
    config = load_config(gpu, tmp_path / "gpu")
    assert config.engines.runtime == "auto"
    assert config.server.workers == limits["nvidia.com/gpu"] * config.server.workers_per_gpu
    # the L3 engine store on a claim this overlay defines, shared by the pods
    _, volume = _mount_for(gpu, config.engines.dir)
    assert set(volume) == {"name", "persistentVolumeClaim"}
    claim = one(gpu, "PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
