"""The compose file parses and every pdserve service's command parses with our own CLI; the
ports it publishes, and what the image's build context leaves out."""
from __future__ import annotations

import fnmatch
import pathlib
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import yaml

from engine.cli import build_parser
from engine.grpc_server import worst_case_stop_s

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
PROMETHEUS = COMPOSE.parent / "prometheus.yml"
METRICS_PORT = 9400


def _expand(arg: str) -> str:
    # ${VAR:-default} -> default, as compose does when VAR is unset.
    if arg.startswith("${") and ":-" in arg:
        return arg[arg.index(":-") + 2:-1]
    return arg


def test_compose_services_and_commands():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"redis", "router", "prefill-0", "prefill-1", "decode-0"} <= set(services)
    parser = build_parser()
    roles = set()
    for name, svc in services.items():
        # Crashed services come back (as `pdserve up` brings them back); clean stops do not.
        third_party = name in ("redis", "prometheus")
        if third_party:
            assert svc["restart"] == "unless-stopped"
            continue
        # A bare on-failure restarted a service refused its configuration (exit 2 at every
        # start) forever: at most as many times as `pdserve up` restarts one by default.
        policy, _, retries = svc["restart"].partition(":")
        assert (policy, retries) == ("on-failure", str(_up_default_max_restarts())), name
        args = parser.parse_args([_expand(a) for a in svc["command"]])
        roles.add(args.command)
        assert args.host == "0.0.0.0"
        assert args.metrics_port == METRICS_PORT
        if args.command in ("prefill", "decode"):
            assert args.redis_url == "redis://redis:6379/0"
            assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
            assert args.engine_process  # as `pdserve up` places GPU workers
            # NCCL between TP ranks and UCX between workers need more than a container's
            # 64 MB /dev/shm and one IPC namespace.
            assert svc["ipc"] == "host"
        if args.command == "router":  # named in the ledger alike across restarts
            assert args.router_id
        # Docker SIGKILLs a service past its stop_grace_period: never before the service's
        # own bounds would have ended its stop (a kill leaves its leases to expire).
        grace = svc["stop_grace_period"]
        assert grace.endswith("s")
        assert float(grace[:-1]) >= worst_case_stop_s(args.drain_timeout_s,
                                                      args.shutdown_grace_s), name
    assert roles == {"router", "prefill", "decode"}
    # The router's API key comes from the environment (never the command line: ps shows it).
    assert services["router"]["environment"] == ["PDSERVE_API_KEY=${PDSERVE_API_KEY:-}",
                                                 "PDSERVE_ADMIN_API_KEY=${PDSERVE_ADMIN_API_KEY:-}"]
    gpus = [svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
            for n, svc in services.items() if n.startswith(("prefill", "decode"))]
    assert len(gpus) == len(set(gpus))  # one GPU per worker


def test_prometheus_scrapes_every_pdserve_service():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    prom = services["prometheus"]
    assert prom["profiles"] == ["monitoring"]  # opt-in: `docker compose --profile monitoring`
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    # Looked up in Docker's DNS, which answers every replica of a scaled service: a static
    # "decode-0:9400" scraped one replica of three, whichever the lookup gave.
    scraped = set()
    for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]:
        assert set(job) == {"job_name", "dns_sd_configs"}, job["job_name"]
        for cfg in job["dns_sd_configs"]:
            assert (cfg["type"], cfg["port"]) == ("A", METRICS_PORT)
            scraped |= set(cfg["names"])
    assert scraped == {n for n in services if n not in ("redis", "prometheus")}


def _up_default_max_restarts() -> int:
    return build_parser().parse_args(["up"]).max_restarts


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) per Dockerfile instruction, continuation lines joined."""
    text = (COMPOSE.parent / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_image_can_compile_kernels_at_run_time():
    """Triton builds each kernel's launcher, a Python extension, with the system C compiler
    when the kernel first runs on a GPU, and the CPU kernels are built on first use: an image
    without gcc and Python's headers fails at the first step, not at build time."""
    installed = set()
    for op, args in _dockerfile_instructions():
        if op == "RUN" and "apt-get install" in args:
            installed |= set(shlex.split(args.split("apt-get install", 1)[1].split("&&")[0]))
    assert {"gcc", "libc6-dev", "python3-dev", "redis-server"} <= installed


def test_image_installs_the_torch_the_project_is_tested_with():
    """pyproject asks for torch>=2.4 only: `pip install .` in the image took PyPI's newest
    torch, not the one the Makefile installs and the tests run against."""
    makefile = (ROOT / "Makefile").read_text()
    tested = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M).group(1)
    args = {}
    for op, rest in _dockerfile_instructions():
        if op == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        if op == "RUN" and "pip install" in rest:
            installs = shlex.split(rest.split("pip install", 1)[1].split("&&")[0])
            pins = [a for a in installs if a.startswith("torch==")]
            assert len(pins) == 1, rest
            version = pins[0].removeprefix("torch==")
            version = args.get(version[2:-1], version) if version.startswith("${") else version
            assert version == tested, (version, tested)
            assert "." in installs  # the package itself, in the same resolution
            return
    raise AssertionError("the Dockerfile installs nothing with pip")


def test_image_keeps_caches_on_the_models_volume():
    """What a worker builds on first use (presets, tokenizer snapshots, Triton's and the CPU
    kernels) lands on the volume every pdserve service mounts, so a restart does not redo it."""
    env = {}
    for op, args in _dockerfile_instructions():
        if op == "ENV":
            env.update(kv.split("=", 1) for kv in shlex.split(args))
    caches = ("PDSERVE_CACHE_DIR", "PDSERVE_TOKENIZER_CACHE", "PDSERVE_KERNEL_CACHE",
              "TRITON_CACHE_DIR")
    assert all(env[name].startswith("/models") for name in caches), env
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in services.items():
        if name not in ("redis", "prometheus"):
            assert any(v.endswith(":/models") for v in svc["volumes"]), name


def test_published_ports_listen_on_loopback_unless_widened():
    """The router takes requests (and drains workers) without a key unless one is set, and
    metrics never want one: nothing is published beyond the host unless PUBLISH_HOST says so
    (compose/README.md)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    assert set(published) == {"router", "prometheus"}  # workers and Redis: the network only
    for name, ports in published.items():
        for port in ports:
            host, outside, inside = re.fullmatch(r"(\$\{PUBLISH_HOST:-[^}]*\}):(\d+):(\d+)",
                                                 port).groups()
            assert _expand(host) == "127.0.0.1" and outside == inside, (name, port)
    assert {p.rsplit(":", 1)[1] for p in published["router"]} == {"50051", str(METRICS_PORT)}


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: a pattern matches it or a
    folder above it, from the context's root, or at any depth after ``**/``."""
    parts = path.split("/")
    for pattern in patterns:
        anywhere = pattern.startswith("**/")
        pattern = pattern.removeprefix("**/")
        for end in range(1, len(parts) + 1):
            starts = range(end) if anywhere else [0]
            if any(fnmatch.fnmatchcase("/".join(parts[i:end]), pattern) for i in starts):
                return True
    return False


def test_the_build_context_leaves_out_caches_and_the_virtual_environment():
    """compose/Dockerfile copies the whole context (COPY . .): without .dockerignore the image
    carried .venv (gigabytes), .git and every cache."""
    assert ("COPY", ". .") in _dockerfile_instructions()
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # nothing let back in
    for path in (".venv/bin/python", ".git/HEAD", ".cache/test-models/x", ".pytest_cache/v",
                 ".hypothesis/examples", "engine/__pycache__/cli.cpython-311.pyc",
                 "pdserve.egg-info/PKG-INFO", "build/lib/engine/cli.py",
                 "compose/models/Qwen3-0.6B/model.safetensors"):
        assert _ignored(path, patterns), path
    # What `pip install .` builds the image's package from stays in.
    needed = ["pyproject.toml", "README.md", "LICENSE", "kernels/csrc/cpu_math.h"]
    for package in ("engine", "kernels", "kvtransfer", "prefill_svc", "decode_svc", "router",
                    "client", "bench", "protos"):
        needed += [str(f.relative_to(ROOT)) for f in (ROOT / package).rglob("*")
                   if f.is_file() and "__pycache__" not in f.parts]
    assert not [p for p in needed if _ignored(p, patterns)]


def _worker_services(services: dict) -> dict:
    return {n: svc for n, svc in services.items() 
            if svc.get("command", [""])[0] in ("prefill", "decode")}


def test_every_worker_service_scales(monkeypatch):
    """`docker compose up --scale decode-0=3`: three containers of one service. A fixed
    hostname, --worker-id, container_name or host port made them one name to the router (the
    hostname every replica advertised, which Docker's DNS answers with any of them), one id in
    the registry, or a clash at start. Each replica now advertises its own hostname (its
    container's short id, resolvable on the compose network) and takes its id from it."""
    from engine.cli_serve import _worker_config
    from engine.worker_runtime import WorkerRuntime

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    parser = build_parser()
    for name, svc in _worker_services(services).items():
        assert not {"hostname", "container_name", "ports"} & set(svc), name
        args = parser.parse_args([_expand(a) for a in svc["command"]])
        config = _worker_config(args, args.command)
        seen = set()
        for container_id in ("3f2a9c1b7d10", "8e41d0c2aa57", "c09b77e3f415"):
            # What WorkerRuntime.bind reads: the container's hostname, set by Docker.
            monkeypatch.setattr("socket.gethostname", lambda cid=container_id: cid)
            replica = SimpleNamespace(worker_id=config.worker_id, config=config)
            WorkerRuntime.bind(replica, f"{args.host}:{args.port}")
            assert replica.address == f"{container_id}:{args.port}", name
            seen.add(replica.worker_id)
        assert len(seen) == 3, (name, seen)
        # Replicas share their service's GPU (Docker assigns none per replica): each one's
        # share of its memory is set from the environment, not fixed in the file.
        share = svc["command"][svc["command"].index("--gpu-memory-utilization") + 1]
        assert share == f"${{{args.command.upper()}_GPU_MEMORY_UTILIZATION:-0.9}}", name


def test_the_worker_health_check_answers_with_the_images_packages():
    """The health check runs in the image (python3 is the venv's, first on PATH, with pdserve's
    grpcio and grpcio-health-checking): run here against a real health service, on the port
    each worker listens on, it passes only while that reports SERVING."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    spec = yaml.safe_load(COMPOSE.read_text())
    test = spec["x-worker"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "-c"]
    code = test[3]
    port = int(re.search(r"'localhost:(\d+)'", code).group(1))
    for name, svc in _worker_services(spec["services"]).items():
        assert svc["healthcheck"] == spec["x-worker"]["healthcheck"], name
        assert build_parser().parse_args([_expand(a) for a in svc["command"]]).port == port
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        here = code.replace(f"'localhost:{port}'", f"'127.0.0.1:{bound}'")
        outcomes = []
        for status in (health_pb2.HealthCheckResponse.NOT_SERVING,
                       health_pb2.HealthCheckResponse.SERVING):
            servicer.set("", status)
            outcomes.append(subprocess.run([sys.executable, "-c", here], timeout=60).returncode)
        assert outcomes == [1, 0]
    finally:
        server.stop(None)
