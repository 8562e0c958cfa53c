#!/usr/bin/env python3
"""Check the Kubernetes manifests of deploy/: render, validate against the schemas, cross-check.

For the base and every overlay:

1. Render the kustomization with ``kubectl kustomize`` when kubectl is on PATH, and always with
   the small built-in renderer below (resources, ``images``, JSON-6902 ``patches``: the features
   these manifests use; anything else is an error). With kubectl present the two renders must
   agree, so the built-in one stays a faithful stand-in on machines without kubectl.
2. Validate every core object against the Kubernetes OpenAPI schemas (kubernetes-validate,
   strict: unknown fields are errors) for each version in ``--k8s-versions``. Objects of CRDs
   (ServiceMonitor, PodMonitor of the Prometheus Operator) have no schema there and get
   structural checks instead.
3. Cross-check what the schemas cannot see: selectors match the pod labels, probes and Service
   ports name a container port, volumes exist, GPUs are requested, /dev/shm and
   PROMETHEUS_MULTIPROC_DIR are emptyDirs, the start-up probe allows a long-context model time
   to load, service links are off, and the plugin's settings (VLLM_SPARSE_* variables and the
   VLLM_SPARSE_CONFIG file from its ConfigMap) pass the plugin's own validation.
4. Security rules (every Deployment and Job): images pinned by digest (``--release``: not the
   all-zero placeholder), non-root, no capabilities, no privilege escalation, a read-only root
   filesystem with /tmp on an emptyDir. For the serving Deployment: the API key from a Secret
   (never in the arguments), a NetworkPolicy that admits only selected sources to named ports,
   compile caches (VLLM_CACHE_ROOT, TRITON_CACHE_DIR) on per-pod emptyDirs, claims mounted
   read-only, vLLM's usage telemetry off, and the model pinned to a commit (MODEL_REVISION) that
   the model-download Job fetches too.

Exit status 1 with every problem listed when anything fails. Usage:
    python deploy/check.py [--kubectl auto|never|require] [--k8s-versions 1.28,1.33] [--release] [DIR ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_VERSIONS = ("1.28.0", "1.33.0")
MIN_STARTUP_SECONDS = 600  # download + load + warm-up of a long-context model
CRD_GROUPS = ("monitoring.coreos.com/",)
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
PLACEHOLDER_DIGEST = "@sha256:" + "0" * 64  # what the manifests ship: replaced before a release
PLACEHOLDER_REVISION = "0" * 40  # likewise for the model's commit (MODEL_REVISION)
COMMIT = re.compile(r"[0-9a-f]{40}")
TELEMETRY_OFF = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class CheckError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Built-in kustomize subset
# ---------------------------------------------------------------------------------------------

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}


def _load_yaml_docs(path: Path) -> list[dict]:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise CheckError(f"{path}: invalid YAML: {e}") from None
    for d in docs:
        if not isinstance(d, dict):
            raise CheckError(f"{path}: expected Kubernetes objects (mappings), got {type(d).__name__}")
    return docs


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise CheckError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts: list[str], where: str):
    cur = doc
    for p in parts:
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise CheckError(f"{where}: no list item {p!r}")
            cur = cur[int(p)]
        elif isinstance(cur, dict):
            if p not in cur:
                raise CheckError(f"{where}: no key {p!r}")
            cur = cur[p]
        else:
            raise CheckError(f"{where}: cannot descend into a {type(cur).__name__} at {p!r}")
    return cur


def apply_json6902(doc: dict, ops: list, where: str) -> dict:
    """RFC 6902 add / remove / replace / test on a copy of ``doc``."""
    doc = copy.deepcopy(doc)
    if not isinstance(ops, list):
        raise CheckError(f"{where}: a JSON 6902 patch is a list of operations")
    for i, op in enumerate(ops):
        w = f"{where}: operation {i}"
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise CheckError(f"{w}: needs 'op' and 'path'")
        kind, parts = op["op"], _pointer(op["path"])
        parent = _walk(doc, parts[:-1], f"{w} ({op['path']})")
        last = parts[-1]
        if kind == "test":
            got = _walk(doc, parts, f"{w} ({op['path']})")
            if got != op.get("value"):
                raise CheckError(f"{w}: test failed at {op['path']}: {got!r} != {op.get('value')!r}")
        elif kind in ("add", "replace"):
            if "value" not in op:
                raise CheckError(f"{w}: {kind} needs 'value'")
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                if last == "-" and kind == "add":
                    parent.append(value)
                elif last.isdigit() and int(last) <= len(parent) - (kind == "replace"):
                    if kind == "add":
                        parent.insert(int(last), value)
                    else:
                        parent[int(last)] = value
                else:
                    raise CheckError(f"{w}: bad list index {last!r} at {op['path']}")
            elif isinstance(parent, dict):
                if kind == "replace" and last not in parent:
                    raise CheckError(f"{w}: replace of missing {op['path']}")
                parent[last] = value
            else:
                raise CheckError(f"{w}: parent of {op['path']} is not a container")
        elif kind == "remove":
            _walk(doc, parts, f"{w} ({op['path']})")
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise CheckError(f"{w}: operation {kind!r} is not supported by the built-in renderer")
    return doc


def _matches_target(obj: dict, target: dict) -> bool:
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    meta = obj.get("metadata", {})
    checks = {"group": group, "version": version, "kind": obj.get("kind"), "name": meta.get("name"),
              "namespace": meta.get("namespace")}
    for key, want in target.items():
        if key not in checks:
            raise CheckError(f"patch target field {key!r} is not supported by the built-in renderer")
        if checks[key] != want:
            return False
    return True


def _set_image(container: dict, images: list[dict]) -> None:
    ref = container.get("image", "")
    name, tag, digest = ref, None, None
    if "@" in name:
        name, digest = name.split("@", 1)
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    for img in images:
        if img.get("name") == name:
            name = img.get("newName", name)
            tag = img.get("newTag", tag)
            digest = img.get("digest", digest)
            container["image"] = name + (f"@{digest}" if digest else f":{tag}" if tag else "")
            return


def render_builtin(directory: Path) -> list[dict]:
    """Objects of a kustomization directory, using only the features listed above."""
    directory = Path(directory)
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise CheckError(f"{directory}: no kustomization.yaml")
    (k,) = _load_yaml_docs(kfile) or [{}]
    unknown = set(k) - _KUSTOMIZATION_KEYS
    if unknown:
        raise CheckError(f"{kfile}: {sorted(unknown)} not supported by the built-in renderer "
                         "(render with kubectl kustomize)")
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res)
        if path.is_dir():
            objects += render_builtin(path)
        elif path.is_file():
            objects += _load_yaml_docs(path)
        else:
            raise CheckError(f"{kfile}: resource {res!r} does not exist")
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            _set_image(c, k.get("images", []))
    for i, patch in enumerate(k.get("patches", [])):
        where = f"{kfile}: patch {i}"
        if "path" in patch:
            ppath = directory / patch["path"]
            if not ppath.is_file():
                raise CheckError(f"{where}: {patch['path']} does not exist")
            ops = yaml.safe_load(ppath.read_text())
            where = f"{ppath}"
        else:
            ops = yaml.safe_load(patch.get("patch", ""))
        if not isinstance(ops, list):
            raise CheckError(f"{where}: only JSON 6902 patches (a list of operations) are supported by "
                             "the built-in renderer")
        targets = [j for j, o in enumerate(objects) if _matches_target(o, patch.get("target", {}))]
        if not targets:
            raise CheckError(f"{where}: target {patch.get('target')} matches no object")
        for j in targets:
            objects[j] = apply_json6902(objects[j], ops, where)
    return objects


def render_kubectl(directory: Path) -> list[dict]:
    proc = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CheckError(f"kubectl kustomize {directory}: {proc.stderr.strip()}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def _key(obj: dict) -> tuple[str, str]:
    return obj.get("kind", "?"), obj.get("metadata", {}).get("name", "?")


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def validate_schemas(objects: list[dict], versions) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    found: dict[str, list[str]] = {}  # message -> versions that report it
    for obj in objects:
        kind, name = _key(obj)
        if str(obj.get("apiVersion", "")).startswith(CRD_GROUPS):
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except ValidationError as e:
                path = "/".join(str(p) for p in e.path) or "(object)"
                found.setdefault(f"{kind}/{name}: schema: {path}: {e.message}", []).append(version)
            except SchemaNotFoundError as e:
                found.setdefault(f"{kind}/{name}: {e.message}", []).append(version)
    return [f"{msg} (Kubernetes {', '.join(vs)})" for msg, vs in found.items()]


def _labels_match(selector: dict | None, labels: dict | None) -> bool:
    selector = (selector or {}).get("matchLabels", selector or {})
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def _check_monitor(obj: dict, services: list[dict], pods: list[dict]) -> list[str]:
    kind, name = _key(obj)
    errs = []
    spec = obj.get("spec") or {}
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        errs.append(f"{kind}/{name}: apiVersion must be monitoring.coreos.com/v1")
    eps_key = {"ServiceMonitor": "endpoints", "PodMonitor": "podMetricsEndpoints"}.get(kind)
    if eps_key is None:
        return [f"{kind}/{name}: unknown kind in group monitoring.coreos.com"]
    unknown = set(spec) - {"selector", eps_key, "namespaceSelector", "jobLabel", "targetLabels",
                           "podTargetLabels", "sampleLimit"}
    if unknown:
        errs.append(f"{kind}/{name}: unknown spec fields {sorted(unknown)}")
    endpoints = spec.get(eps_key)
    if not isinstance(endpoints, list) or not endpoints:
        return errs + [f"{kind}/{name}: spec.{eps_key} must be a non-empty list"]
    if kind == "ServiceMonitor":
        targets = [s for s in services if _labels_match(spec.get("selector"), s["metadata"].get("labels"))]
        ports = {p.get("name") for s in targets for p in s.get("spec", {}).get("ports", [])}
    else:
        targets = [p for p in pods if _labels_match(spec.get("selector"), p.get("metadata", {}).get("labels"))]
        ports = {port.get("name") for p in targets for c in p.get("spec", {}).get("containers", [])
                 for port in c.get("ports", [])}
    if not targets:
        errs.append(f"{kind}/{name}: selector {spec.get('selector')} selects nothing in this render")
    for i, ep in enumerate(endpoints):
        if not isinstance(ep, dict):
            errs.append(f"{kind}/{name}: {eps_key}[{i}] must be a mapping")
            continue
        if ep.get("port") not in ports:
            errs.append(f"{kind}/{name}: {eps_key}[{i}].port {ep.get('port')!r} is not a named port of the "
                        f"selected objects ({sorted(p for p in ports if p)})")
        if ep.get("path", "/metrics") != "/metrics":
            errs.append(f"{kind}/{name}: {eps_key}[{i}].path should be /metrics (vLLM's endpoint)")
        for field in ("interval", "scrapeTimeout"):
            if field in ep and not str(ep[field]).rstrip("smh").isdigit():
                errs.append(f"{kind}/{name}: {eps_key}[{i}].{field}={ep[field]!r} is not a duration like 30s")
    return errs


def _probe_seconds(probe: dict) -> int:
    return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3)) + \
        int(probe.get("initialDelaySeconds", 0))


def _check_settings(env: dict, mounts: dict, volumes: dict, configmaps: dict, where: str) -> list[str]:
    """The plugin's own validation of VLLM_SPARSE_* and the VLLM_SPARSE_CONFIG file."""
    try:
        from vllm_sparse_backend.config import ConfigError, load_settings
    except ImportError as e:
        return [f"{where}: cannot import vllm_sparse_backend to check its settings ({e})"]
    settings_env = {k: v for k, v in env.items() if k.startswith("VLLM_SPARSE_") and isinstance(v, str)}
    errs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = settings_env.get("VLLM_SPARSE_CONFIG")
        if path:
            mdir = posixpath.dirname(path)
            vol = volumes.get(mounts.get(mdir, ""))
            cm = configmaps.get(((vol or {}).get("configMap") or {}).get("name"))
            if cm is None:
                return [f"{where}: VLLM_SPARSE_CONFIG={path} is not a file of a mounted ConfigMap of this render"]
            text = (cm.get("data") or {}).get(posixpath.basename(path))
            if text is None:
                return [f"{where}: ConfigMap {cm['metadata']['name']} has no key {posixpath.basename(path)}"]
            local = Path(tmp) / posixpath.basename(path)
            local.write_text(text)
            settings_env["VLLM_SPARSE_CONFIG"] = str(local)
        try:
            load_settings(settings_env)
        except ConfigError as e:
            errs.append(f"{where}: plugin settings rejected: {e}".replace(str(Path(tmp)) + os.sep, ""))
    return errs


def _volume_at(path: str, mounts: dict, volumes: dict) -> dict:
    """The volume whose mount holds ``path`` (the longest mount path that is ``path`` or a parent of it)."""
    best = ""
    for mpath in mounts:
        if (path == mpath or path.startswith(mpath.rstrip("/") + "/")) and len(mpath) > len(best):
            best = mpath
    return volumes.get(mounts.get(best), {}) if best else {}


def check_pod_security(where: str, pod: dict, release: bool) -> list[str]:
    """Rules for every pod template (Deployment, Job): see the module doc, item 4."""
    errs = []
    pod_ctx = pod.get("securityContext") or {}
    volumes = {v.get("name"): v for v in pod.get("volumes", [])}
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        cw = f"{where} container {c.get('name')}"
        ctx = c.get("securityContext") or {}
        image = str(c.get("image", ""))
        if not DIGEST.search(image):
            errs.append(f"{cw}: image {image!r} is not pinned by digest (NAME@sha256:<64 hex>; a tag can be moved)")
        elif release and image.endswith(PLACEHOLDER_DIGEST):
            errs.append(f"{cw}: image {image!r} has the placeholder digest; set your build's digest in the overlay")
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            errs.append(f"{cw}: runAsNonRoot must be true (container or pod securityContext)")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            errs.append(f"{cw}: runAsUser is 0 (root)")
        if ctx.get("allowPrivilegeEscalation") is not False:
            errs.append(f"{cw}: securityContext.allowPrivilegeEscalation must be false")
        if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or []):
            errs.append(f"{cw}: securityContext.capabilities.drop must contain ALL")
        if (ctx.get("capabilities") or {}).get("add"):
            errs.append(f"{cw}: securityContext.capabilities.add must be empty")
        if ctx.get("privileged"):
            errs.append(f"{cw}: must not be privileged")
        if ctx.get("readOnlyRootFilesystem") is not True:
            errs.append(f"{cw}: securityContext.readOnlyRootFilesystem must be true (writable places are emptyDirs)")
        mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}
        if "emptyDir" not in volumes.get(mounts.get("/tmp"), {}):
            errs.append(f"{cw}: /tmp must be the mount of an emptyDir volume (the root filesystem is read-only)")
    return errs


def check_serving(where: str, container: dict, env: dict, mounts: dict, volumes: dict) -> list[str]:
    """Rules for the serving container of a Deployment: see the module doc, item 4."""
    cw = f"{where} container {container.get('name')}"
    errs = []
    key = env.get("VLLM_API_KEY")
    ref = (key or {}).get("secretKeyRef") if isinstance(key, dict) else None
    if not ref or not ref.get("name") or not ref.get("key"):
        errs.append(f"{cw}: VLLM_API_KEY must come from a Secret (valueFrom.secretKeyRef): without it any "
                    "client that reaches the port can use the API")
    elif ref.get("optional"):
        errs.append(f"{cw}: the VLLM_API_KEY secretKeyRef must not be optional (a missing Secret would serve "
                    "without a key)")
    extra = env.get("VLLM_EXTRA_ARGS") if isinstance(env.get("VLLM_EXTRA_ARGS"), str) else ""
    words = extra.split() + [str(a) for a in container.get("args", []) + container.get("command", [])]
    if any(w == "--api-key" or w.startswith("--api-key=") for w in words):
        errs.append(f"{cw}: --api-key in the container's arguments puts the key in the manifest; use VLLM_API_KEY "
                    "from a Secret")
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        value = env.get(name)
        if not isinstance(value, str):
            errs.append(f"{cw}: {name} is not set (compile caches must be per pod, on an emptyDir)")
        elif "emptyDir" not in _volume_at(value, mounts, volumes):
            errs.append(f"{cw}: {name}={value} is not on an emptyDir volume (compiled code must not be shared "
                        "between pods)")
    for mpath, vname in mounts.items():
        vol = volumes.get(vname, {})
        ro = [m for m in container.get("volumeMounts", []) if m.get("mountPath") == mpath][0].get("readOnly")
        if "persistentVolumeClaim" in vol and ro is not True:
            errs.append(f"{cw}: claim volume {vname} at {mpath} must be mounted readOnly (the model-download Job "
                        "writes it)")
    for name, want in TELEMETRY_OFF.items():
        if env.get(name) != want:
            errs.append(f"{cw}: {name} must be {want!r} (vLLM's usage telemetry off)")
    revision = env.get("MODEL_REVISION")
    if not (isinstance(revision, str) and COMMIT.fullmatch(revision)):
        errs.append(f"{cw}: MODEL_REVISION={revision!r} must be a 40-hex commit of the model repository "
                    "(a branch name can change under a running deployment)")
    return errs


def check_network_policies(policies: list[dict], pods: list[dict]) -> list[str]:
    """Each serving pod template is selected by a NetworkPolicy for Ingress whose every rule names
    its sources and ports (none admits every pod or every port)."""
    errs = []
    for tmpl in pods:
        labels = tmpl.get("metadata", {}).get("labels")
        ports = {p.get("name") for c in tmpl["spec"].get("containers", []) for p in c.get("ports", [])} | \
                {p.get("containerPort") for c in tmpl["spec"].get("containers", []) for p in c.get("ports", [])}
        chosen = [p for p in policies if _labels_match(p.get("spec", {}).get("podSelector"), labels)]
        if not any("Ingress" in (p["spec"].get("policyTypes") or ["Ingress"]) for p in chosen):
            errs.append(f"pods {labels}: no NetworkPolicy for Ingress selects them (any pod of the cluster could "
                        "reach the API)")
        for pol in chosen:
            _, name = _key(pol)
            for i, rule in enumerate(pol["spec"].get("ingress") or []):
                w = f"NetworkPolicy/{name}: ingress[{i}]"
                peers = rule.get("from") or []
                if not peers or any(not peer or peer.get("namespaceSelector") == {} and "podSelector" not in peer
                                    or (peer.get("ipBlock") or {}).get("cidr") in ("0.0.0.0/0", "::/0")
                                    for peer in peers):
                    errs.append(f"{w}: admits every source; name the gateway's and Prometheus's namespaces or pods")
                if not rule.get("ports"):
                    errs.append(f"{w}: admits every port; name the ports")
                for port in rule.get("ports") or []:
                    if port.get("port") not in ports:
                        errs.append(f"{w}: port {port.get('port')!r} is not a port of the selected containers")
    return errs


def cross_check(objects: list[dict], release: bool = False) -> list[str]:
    errs = []
    by_kind: dict[str, list[dict]] = {}
    for o in objects:
        by_kind.setdefault(o.get("kind"), []).append(o)
    services = by_kind.get("Service", [])
    configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    pvcs = {c["metadata"]["name"] for c in by_kind.get("PersistentVolumeClaim", [])}
    pods = []
    for dep in by_kind.get("Deployment", []):
        _, name = _key(dep)
        w = f"Deployment/{name}"
        spec = dep.get("spec", {})
        tmpl = spec.get("template", {})
        labels = tmpl.get("metadata", {}).get("labels", {})
        pod = tmpl.get("spec", {})
        pods.append(tmpl)
        if not _labels_match(spec.get("selector"), labels):
            errs.append(f"{w}: spec.selector does not match the pod template's labels")
        if pod.get("enableServiceLinks") is not False:
            errs.append(f"{w}: enableServiceLinks must be false (a Service named vllm-sparse would inject "
                        "VLLM_SPARSE_* variables, which the plugin rejects)")
        volumes = {v.get("name"): v for v in pod.get("volumes", [])}
        for v in volumes.values():
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in pvcs:
                errs.append(f"{w}: volume {v['name']} claims {claim}, which is not in this render")
            cm = (v.get("configMap") or {}).get("name")
            if cm is not None and cm not in configmaps:
                errs.append(f"{w}: volume {v['name']} uses ConfigMap {cm}, which is not in this render")
        if not pod.get("containers"):
            errs.append(f"{w}: no containers")
        for c in pod.get("containers", []):
            cw = f"{w} container {c.get('name')}"
            ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
            mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}
            for mpath, vname in mounts.items():
                if vname not in volumes:
                    errs.append(f"{cw}: volumeMount {mpath} names volume {vname!r}, which is not defined")
            env = {e.get("name"): e.get("value", e.get("valueFrom")) for e in c.get("env", [])}
            limits = c.get("resources", {}).get("limits", {})
            requests = c.get("resources", {}).get("requests", {})
            gpus = limits.get("nvidia.com/gpu")
            if not isinstance(gpus, int) or gpus < 1:
                errs.append(f"{cw}: resources.limits needs nvidia.com/gpu >= 1")
            elif requests.get("nvidia.com/gpu", gpus) != gpus:
                errs.append(f"{cw}: nvidia.com/gpu request and limit differ")
            for r in ("cpu", "memory"):
                if r not in requests:
                    errs.append(f"{cw}: resources.requests.{r} is missing")
            for pname in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(pname)
                get = (probe or {}).get("httpGet") or {}
                if get.get("path") != "/health":
                    errs.append(f"{cw}: {pname} must be an httpGet on /health")
                    continue
                port = get.get("port")
                if port not in ports and port not in ports.values():
                    errs.append(f"{cw}: {pname} port {port!r} is not a container port")
            if c.get("startupProbe") and _probe_seconds(c["startupProbe"]) < MIN_STARTUP_SECONDS:
                errs.append(f"{cw}: startupProbe allows {_probe_seconds(c['startupProbe'])} s, less than the "
                            f"{MIN_STARTUP_SECONDS} s a long-context model may need to load")
            shm = volumes.get(mounts.get("/dev/shm"), {})
            if (shm.get("emptyDir") or {}).get("medium") != "Memory":
                errs.append(f"{cw}: /dev/shm must be an emptyDir with medium: Memory")
            prom = env.get("PROMETHEUS_MULTIPROC_DIR")
            if not isinstance(prom, str):
                errs.append(f"{cw}: PROMETHEUS_MULTIPROC_DIR is not set (the plugin's metrics would not "
                            "reach vLLM's /metrics)")
            elif "emptyDir" not in volumes.get(mounts.get(prom), {}):
                errs.append(f"{cw}: PROMETHEUS_MULTIPROC_DIR={prom} is not the mount of an emptyDir volume")
            errs += _check_settings(env, mounts, volumes, configmaps, cw)
            errs += check_serving(w, c, env, mounts, volumes)
        errs += check_pod_security(w, pod, release)
    serving = {}
    for dep in by_kind.get("Deployment", []):
        for c in dep["spec"]["template"]["spec"].get("containers", []):
            env = {e.get("name"): e.get("value") for e in c.get("env", [])}
            serving[(env.get("MODEL"), env.get("MODEL_REVISION"))] = f"Deployment/{_key(dep)[1]}"
            if release and env.get("MODEL_REVISION") == PLACEHOLDER_REVISION:
                errs.append(f"Deployment/{_key(dep)[1]} container {c.get('name')}: MODEL_REVISION is the "
                            "placeholder commit; set the model repository's commit you tested")
    for job in by_kind.get("Job", []):
        w = f"Job/{_key(job)[1]}"
        pod = job.get("spec", {}).get("template", {}).get("spec", {})
        errs += check_pod_security(w, pod, release)
        for c in pod.get("containers", []):
            env = {e.get("name"): e.get("value") for e in c.get("env", [])}
            if "MODEL" in env and serving and (env["MODEL"], env.get("MODEL_REVISION")) not in serving:
                errs.append(f"{w} container {c.get('name')}: downloads {env['MODEL']} at {env.get('MODEL_REVISION')}, "
                            f"which no Deployment serves (served: {sorted(map(str, serving))})")
    errs += check_network_policies(by_kind.get("NetworkPolicy", []), pods)
    for svc in services:
        _, name = _key(svc)
        spec = svc.get("spec", {})
        chosen = [p for p in pods if _labels_match(spec.get("selector"), p.get("metadata", {}).get("labels"))]
        if not chosen:
            errs.append(f"Service/{name}: selector {spec.get('selector')} selects no pod template")
        cports = {p.get("name") for t in chosen for c in t["spec"].get("containers", []) for p in c.get("ports", [])}
        cnums = {p.get("containerPort") for t in chosen for c in t["spec"].get("containers", [])
                 for p in c.get("ports", [])}
        for p in spec.get("ports", []):
            tp = p.get("targetPort", p.get("port"))
            if tp not in cports and tp not in cnums:
                errs.append(f"Service/{name}: targetPort {tp!r} is not a port of the selected containers")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        _, name = _key(pdb)
        if not any(_labels_match(pdb.get("spec", {}).get("selector"), p.get("metadata", {}).get("labels"))
                   for p in pods):
            errs.append(f"PodDisruptionBudget/{name}: selector selects no pod template")
    for o in objects:
        if str(o.get("apiVersion", "")).startswith(CRD_GROUPS):
            errs += _check_monitor(o, services, pods)
    return errs


# ---------------------------------------------------------------------------------------------

def _targets(root: Path) -> list[Path]:
    out = [root / "base"] if (root / "base" / "kustomization.yaml").is_file() else []
    overlays = root / "overlays"
    if overlays.is_dir():
        out += sorted(p for p in overlays.iterdir() if (p / "kustomization.yaml").is_file())
    return out


def check_dir(directory: Path, versions, use_kubectl: bool, release: bool = False) -> tuple[list[str], int]:
    """Problems of one kustomization directory and the number of objects rendered."""
    try:
        objects = render_builtin(directory)
    except CheckError as e:
        return [f"render: {e}"], 0
    errors = []
    if use_kubectl:
        try:
            ref = render_kubectl(directory)
        except CheckError as e:
            return [f"render: {e}"], 0
        mine = {_key(o): o for o in objects}
        theirs = {_key(o): o for o in ref}
        if mine != theirs:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            errors.append(f"the built-in renderer and kubectl kustomize disagree on {diff}")
        objects = ref
    keys = [_key(o) for o in objects]
    dups = {k for k in keys if keys.count(k) > 1}
    if dups:
        errors.append(f"duplicate objects {sorted(dups)}")
    schema_errors = validate_schemas(objects, versions)
    errors += schema_errors
    if schema_errors:  # cross-checks read fields the schemas have just found malformed
        errors.append("cross-checks skipped until the schema errors are fixed")
        return errors, len(objects)
    try:
        errors += cross_check(objects, release)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a CRD object of the wrong shape
        errors.append(f"malformed object ({type(e).__name__}: {e}); cross-checks stopped")
    return errors, len(objects)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path,
                    help="kustomization directories (default: deploy/base and deploy/overlays/*)")
    ap.add_argument("--kubectl", choices=("auto", "never", "require"), default="auto",
                    help="render with kubectl kustomize too: when on PATH (auto), never, or fail without it")
    ap.add_argument("--k8s-versions", default=",".join(DEFAULT_VERSIONS),
                    help="Kubernetes versions whose schemas the objects must satisfy")
    ap.add_argument("--release", action="store_true",
                    help="also refuse the placeholder image digest the repository's manifests carry")
    args = ap.parse_args(argv)
    has_kubectl = shutil.which("kubectl") is not None
    if args.kubectl == "require" and not has_kubectl:
        print("deploy/check.py: --kubectl require, but kubectl is not on PATH", file=sys.stderr)
        return 1
    use_kubectl = has_kubectl and args.kubectl != "never"
    versions = [v.strip() for v in args.k8s_versions.split(",") if v.strip()]
    dirs = args.dirs or _targets(HERE)
    if not dirs:
        print("deploy/check.py: no kustomization directories found", file=sys.stderr)
        return 1
    failed = False
    for d in dirs:
        errors, n = check_dir(d, versions, use_kubectl, args.release)
        how = "kubectl kustomize + built-in" if use_kubectl else "built-in renderer (no kubectl)"
        if errors:
            failed = True
            print(f"FAIL {d}: {len(errors)} problem(s) [{how}]")
            for e in errors:
                print(f"  - {e}")
        else:
            print(f"ok   {d}: {n} objects valid for Kubernetes {', '.join(versions)} [{how}]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
