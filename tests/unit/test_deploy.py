"""Offline checks of everything under deploy/: launch script, systemd units, Dockerfile, compose, Kubernetes.

Each check validates against the real tool or schema where one is installed
(systemd-analyze, hadolint, shellcheck, kubectl kustomize, the compose spec and
Kubernetes schemas), and checks that every SPECD_* variable the files set is a
real option of the service that reads it, so a renamed flag cannot leave a
deployment silently configured with defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import importlib.resources
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from specd import configuration
from specd.rpc.backend_auth import BACKEND_TOKEN_ENV
from specd.rpc.health import HealthConfig
from verifier_service.config import VerifierConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICES = ("drafter", "verifier", "gateway")
# Read by the code outside the config dataclasses.
OTHER_VARIABLES = {"SPECD_CACHE_DIR"}


def known_variables() -> set[str]:
    names = set(OTHER_VARIABLES)
    for prefix, cls in (
        ("DRAFTER", DrafterConfig),
        ("VERIFIER", VerifierConfig),
        ("GATEWAY", GatewayConfig),
        ("HEALTH", HealthConfig),
    ):
        names |= {configuration.env_name(f, prefix) for f in dataclasses.fields(cls)}
    return names


def assert_known(variables: set[str], where: str) -> None:
    unknown = {v for v in variables if v.startswith("SPECD_")} - known_variables()
    assert not unknown, f"{where} sets variables no service reads: {sorted(unknown)}"


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def tool(name: str) -> str:
    """An executable installed next to this interpreter (pip-installed tools) or on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


# -- launch script ------------------------------------------------------------------------------


def launch_dry_run(**env: str) -> str:
    result = subprocess.run(
        ["bash", str(DEPLOY / "launch.sh"), "--dry-run", "--max-context", "512"],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def flag(command: str, name: str) -> str:
    match = re.search(rf"{re.escape(name)} (\S+)", command)
    assert match, f"{name} missing from {command!r}"
    return match.group(1)


@pytest.mark.parametrize(
    ("gpus", "drafter", "verifier"), [("0", "cpu", "cpu"), ("1", "cuda:0", "cuda:0"), ("2", "cuda:0", "cuda:1")]
)
def test_launch_places_services_by_gpu_count(gpus, drafter, verifier):
    command = launch_dry_run(SPECD_GPU_COUNT=gpus)
    assert command.startswith("specd up ")
    assert flag(command, "--drafter-device") == drafter
    assert flag(command, "--verifier-device") == verifier
    assert command.rstrip().endswith("--max-context 512"), "extra arguments go to specd up"


def test_launch_reads_the_services_variables():
    command = launch_dry_run(
        SPECD_GPU_COUNT="4",
        SPECD_DRAFTER_GPU="2",
        SPECD_VERIFIER_GPU="3",
        SPECD_VERIFIER_MODEL="/m/target",
        SPECD_DRAFTER_DTYPE="float16",
        SPECD_VERIFIER_PORT="6000",
        SPECD_GATEWAY_HTTP_PORT="9000",
        SPECD_TLS_CERT="/t/s.pem",
        SPECD_TLS_KEY="/t/k.pem",
        SPECD_TLS_CA="/t/ca.pem",
        SPECD="python -m specd.cli",
    )
    assert command.startswith("python -m specd.cli up ")
    assert (flag(command, "--drafter-device"), flag(command, "--verifier-device")) == ("cuda:2", "cuda:3")
    assert flag(command, "--target-model") == flag(command, "--draft-model") == "/m/target"
    assert flag(command, "--drafter-dtype") == "float16"
    assert flag(command, "--verifier-port") == "6000" and flag(command, "--http-port") == "9000"
    assert (flag(command, "--tls-cert"), flag(command, "--tls-ca")) == ("/t/s.pem", "/t/ca.pem")
    assert "--tls-client-cert" not in command


def test_launch_keeps_backend_traffic_authenticated():
    # launch.sh runs `specd up`, which keeps the backends on loopback and gives them a
    # random token (tests/integration/test_launch.py shows a call without it refused).
    command = launch_dry_run(SPECD_GPU_COUNT="0", SPECD_DRAFTER_HOST="0.0.0.0", SPECD_VERIFIER_HOST="0.0.0.0")
    assert command.startswith("specd up ")
    assert "--insecure" not in command
    from specd.cli import _up_parser

    host = next(a for a in _up_parser()._actions if "--host" in a.option_strings)
    assert "always listen on 127.0.0.1" in host.help, "specd up's --host is the gateway's alone"


def test_launch_script_passes_shellcheck():
    result = subprocess.run([tool("shellcheck"), str(DEPLOY / "launch.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_launch_flags_exist_in_specd_up():
    from specd.cli import _up_parser

    options = {o for action in _up_parser()._actions for o in action.option_strings}
    command = launch_dry_run(SPECD_GPU_COUNT="0", SPECD_TLS_CERT="c", SPECD_TLS_KEY="k", SPECD_TLS_CA="a")
    used = set(re.findall(r"(?<!\S)(--[a-z-]+)", command))
    assert used <= options, f"launch.sh passes flags specd up lacks: {sorted(used - options)}"


# -- systemd ------------------------------------------------------------------------------------


def test_systemd_units_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (systemd's own check of the unit files)")
    units = [*sorted((DEPLOY / "systemd").glob("specd*.service")), DEPLOY / "systemd" / "specd.target"]
    assert {u.name for u in units} >= {f"specd-{s}.service" for s in SERVICES}
    # verify checks that ExecStart's binary exists: point it at this environment's specd.
    specd = tool("specd")
    for unit in units:
        text = unit.read_text()
        if unit.suffix == ".service":
            exec_start = re.search(r"^ExecStart=(\S+) (\w+)$", text, re.M)
            assert exec_start and exec_start.group(1) == "/opt/specd/venv/bin/specd", unit.name
            assert exec_start.group(2) == unit.stem.removeprefix("specd-")
            assert re.search(r"^User=specd$", text, re.M), f"{unit.name} must not run as root"
        (tmp_path / unit.name).write_text(text.replace("/opt/specd/venv/bin/specd", specd))
    result = subprocess.run(
        [analyze, "verify", *(str(tmp_path / u.name) for u in units)], capture_output=True, text=True, timeout=60
    )
    complaints = [line for line in result.stderr.splitlines() if str(tmp_path) in line or "specd" in line]
    assert result.returncode == 0 and not complaints, result.stderr


def test_systemd_units_authenticate_backend_traffic():
    for service in SERVICES:
        text = (DEPLOY / "systemd" / f"specd-{service}.service").read_text()
        # A credential the unit cannot load keeps it from starting: no silent fallback to open.
        assert re.search(r"^LoadCredential=backend-token:/etc/specd/backend-token$", text, re.M), service
        variable = f"SPECD_{service.upper()}_BACKEND_TOKEN_FILE"
        assert re.search(rf"^Environment={variable}=%d/backend-token$", text, re.M), service
        assert_known({variable}, f"specd-{service}.service")
        assert "INSECURE" not in text


def test_systemd_environment_file_sets_real_options():
    env = env_file(DEPLOY / "systemd" / "specd.env")
    assert_known(set(env), "deploy/systemd/specd.env")
    assert not any(k.endswith("_INSECURE") for k in env)
    assert env["SPECD_DRAFTER_DEVICE"] != env["SPECD_VERIFIER_DEVICE"], "the two-GPU example uses two GPUs"


# -- Docker -------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        logical.append(current)
        current = ""
    assert not current, "the Dockerfile ends inside a continuation"
    return [(parts[0].upper(), parts[1] if len(parts) > 1 else "") for parts in (x.split(None, 1) for x in logical)]


def test_dockerfile_runs_specd_as_a_non_root_user():
    instructions = dockerfile_instructions()
    users = [args for op, args in instructions if op == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "a numeric non-root uid (Kubernetes runAsNonRoot checks it)"
    last = {op: args for op, args in instructions}
    assert json.loads(last["ENTRYPOINT"]) == ["specd"]
    cmd = json.loads(last["CMD"])
    assert cmd[0] in SERVICES
    assert any(op == "ARG" and args.startswith("TORCH_VARIANT=") for op, args in instructions)


def test_dockerfile_is_lint_clean():
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_keeps_what_the_image_copies():
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    assert ".git" in patterns and ".venv" in patterns
    copied = [args.split()[:-1] for op, args in dockerfile_instructions() if op == "COPY"]
    assert copied
    for sources in copied:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            ignored = [p for p in patterns if fnmatch.fnmatch(source, p) or source.startswith(p.rstrip("/") + "/")]
            assert not ignored, f"COPY {source} is excluded by .dockerignore {ignored}"
    # pyproject.toml names README.md as the package's readme: the build needs it.
    assert any("README.md" in s for s in copied)


# -- Compose ------------------------------------------------------------------------------------


def compose_schema() -> dict[str, Any]:
    schema = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(schema.read_text())


COMPOSE_FILES = ("compose.yaml", "compose.gpu.yaml")


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_match_the_compose_specification(name):
    document = yaml.safe_load((DEPLOY / "compose" / name).read_text())
    validator = jsonschema.Draft7Validator(compose_schema())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    assert not errors, errors
    broken = copy.deepcopy(document)
    broken["services"]["verifier"]["healthcheck"] = {"test": ["CMD", "true"], "interval": 10}
    assert not validator.is_valid(broken), "the schema check must be able to fail"


def test_compose_services():
    base = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    gpu = yaml.safe_load((DEPLOY / "compose" / "compose.gpu.yaml").read_text())
    services = base["services"]
    assert set(services) == {*SERVICES, "jaeger"}
    assert services["jaeger"]["profiles"] == ["tracing"]
    for name in SERVICES:
        service = services[name]
        assert service["command"] == [name]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "specd", "health"]
        port = test[3].rsplit(":", 1)[1]
        expected = {"drafter": "50051", "verifier": "50052", "gateway": "50050"}[name]
        assert port == expected, f"{name} healthcheck on port {port}"
        assert_known(set(service["environment"]), f"compose service {name}")
    for name in SERVICES:
        # Required: compose refuses to start without it, rather than run the backends open.
        token = services[name]["environment"][BACKEND_TOKEN_ENV]
        assert token.startswith("${SPECD_BACKEND_TOKEN:?"), (name, token)
        assert not any(k.endswith("_INSECURE") for k in services[name]["environment"])
    assert services["gateway"]["depends_on"] == {
        "verifier": {"condition": "service_healthy"},
        "drafter": {"condition": "service_healthy"},
    }
    reserved = {}
    for name in ("drafter", "verifier"):
        (device,) = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        reserved[name] = device["device_ids"]
        assert_known(set(gpu["services"][name]["environment"]), f"compose.gpu.yaml {name}")
    assert reserved["drafter"] != reserved["verifier"], "drafter and verifier must default to different GPUs"


# -- Kubernetes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["cpu", "gpu", "gpu-tls"])
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the kustomize overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / request.param)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return request.param, [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_kubernetes_manifests_are_valid(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, docs = rendered
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = copy.deepcopy(by_kind(docs, "Deployment")["specd-gateway"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_kubernetes_topology(rendered):
    overlay, docs = rendered
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    assert set(deployments) == {f"specd-{s}" for s in SERVICES}
    assert set(by_kind(docs, "PodDisruptionBudget")) == set(deployments)
    (config,) = by_kind(docs, "ConfigMap").values()
    assert_known(set(config["data"]), f"the {overlay} ConfigMap")
    ports = {"drafter": 50051, "verifier": 50052}
    for role, port in ports.items():
        service = services[f"specd-{role}"]
        assert service["spec"]["clusterIP"] == "None", "drafter and verifier Services are headless"
        assert service["spec"]["ports"][0]["port"] == port
        assert config["data"][f"SPECD_{role.upper()}_PORT"] == str(port)
        # The dns form: the gateway resolves the headless Service to every ready pod.
        assert config["data"][f"SPECD_GATEWAY_{role.upper()}"] == f"dns:///specd-{role}:{port}"
    assert services["specd-gateway"]["spec"].get("clusterIP") != "None"
    for name, deployment in deployments.items():
        role = name.removeprefix("specd-")
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        (container,) = pod["containers"]
        assert container["args"] == [role]
        assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
        grpc_port = ports.get(role, 50050)
        probes = ["livenessProbe", "startupProbe"] + (["readinessProbe"] if role != "gateway" else [])
        for probe in probes:
            if overlay.endswith("-tls"):
                # kubelet's gRPC probe has no TLS: `specd health` checks the certificate.
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["specd", "health", f"127.0.0.1:{grpc_port}"], (name, probe)
                assert command[3:] == ["--server-name", name]
            else:
                assert container[probe]["grpc"]["port"] == grpc_port, (name, probe)
        if role == "gateway":
            readiness = container["readinessProbe"]["httpGet"]
            assert readiness["path"] == "/health"
            assert readiness.get("scheme", "HTTP") == ("HTTPS" if overlay.endswith("-tls") else "HTTP")
        resources = container["resources"]
        assert "memory" in resources["requests"] and "memory" in resources["limits"]
        gpus = resources["limits"].get("nvidia.com/gpu")
        if overlay.startswith("gpu") and role != "gateway":
            assert gpus == "1" and container["image"].endswith(":cuda")
            assert config["data"][f"SPECD_{role.upper()}_DEVICE"] == "cuda"
        else:
            assert gpus is None
    for name, deployment in deployments.items():
        # Every overlay: the backend token from a Secret the pods cannot start without,
        # in the gateway and in both backends (the -tls overlay adds mutual TLS on top).
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", ())}
        ref = env[BACKEND_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "specd-backend-token" and ref["key"] == "token", name
        assert not ref.get("optional", False), f"{name}: an optional token would let the pod run unauthenticated"
    assert not any(k.endswith("_INSECURE") for k in config["data"])
    if overlay.endswith("-tls"):
        for variable in ("TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"):
            for role in ports:
                assert config["data"][f"SPECD_{role.upper()}_{variable}"].startswith("/etc/specd/tls/")
        assert config["data"]["SPECD_GATEWAY_BACKEND_TLS_CA"] == "/etc/specd/tls/ca.crt"
        for deployment in deployments.values():
            mounts = {
                m["name"]: m["mountPath"]
                for m in deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            }
            assert mounts["tls"] == "/etc/specd/tls"
    if overlay == "cpu":
        assert not by_kind(docs, "PersistentVolumeClaim"), "the CPU overlay runs the embedded model, no volume"
        assert config["data"]["SPECD_VERIFIER_MODEL"] == "embedded"


def test_kubernetes_backends_outlive_the_gateways_drain(rendered):
    """Deleted together, all pods get SIGTERM at once: each backend's preStop must keep it serving
    through the gateway's preStop and drain, and every pod's grace period must cover its stop."""
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    (config,) = by_kind(docs, "ConfigMap").values()
    drain_s = float(config["data"].get("SPECD_GATEWAY_SHUTDOWN_GRACE_S", 10))

    def pre_stop_s(name: str) -> float:
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", command
        return float(command[1])

    gateway_s = pre_stop_s("specd-gateway") + drain_s
    for name, deployment in deployments.items():
        own_s = pre_stop_s(name) + (drain_s if name == "specd-gateway" else 5)
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > own_s, name
        if name != "specd-gateway":
            assert pre_stop_s(name) > gateway_s, f"{name} stops before the gateway has drained"


# -- each service restarts on its own ---------------------------------------------------------


def unit_directives(path: Path) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            directives.setdefault(key.strip(), []).append(value.strip())
    return directives


def test_systemd_restarts_each_service_alone():
    for service in SERVICES:
        unit = unit_directives(DEPLOY / "systemd" / f"specd-{service}.service")
        assert unit["Restart"] in (["on-failure"], ["always"]), f"specd-{service} is not restarted when it dies"
        # Requires=/BindsTo= (or PartOf= another service) would stop or restart this unit with
        # that one; Wants=/After= only order their starts.
        for directive in ("Requires", "BindsTo", "Requisite"):
            assert directive not in unit, f"specd-{service} has {directive}=, tying it to another service"
        assert unit.get("PartOf") == ["specd.target"], f"specd-{service} must be part of the target only"
        # A unit that hits its start limit stays down for good: the limit must allow for RestartSec.
        restart_s = float(unit["RestartSec"][0])
        burst = int(unit.get("StartLimitBurst", ["5"])[0])
        interval = float(unit.get("StartLimitIntervalSec", ["10"])[0])
        assert restart_s * burst >= interval, f"specd-{service} could hit its start limit and stay down"


def test_compose_restarts_each_service_alone():
    services = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    for name in SERVICES:
        assert services[name]["restart"] in ("always", "unless-stopped", "on-failure"), name
        # depends_on with restart: true would restart the gateway whenever a backend restarts.
        for dependency, condition in services[name].get("depends_on", {}).items():
            assert not condition.get("restart", False), f"{name} is restarted with {dependency}"


def test_kubernetes_restarts_each_service_alone(rendered):
    _, docs = rendered
    for name, deployment in by_kind(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        # One service per pod: the kubelet restarts a crashed container without touching the others.
        assert len(pod["containers"]) == 1, f"{name} shares its pod with another container"
        assert pod.get("restartPolicy", "Always") == "Always", name
