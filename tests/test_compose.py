"""The compose file parses and every pdserve service's command parses with our own CLI."""
from __future__ import annotations

import pathlib

import yaml

from engine.cli import build_parser

COMPOSE = pathlib.Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
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
        assert svc["restart"] == ("unless-stopped" if third_party else "on-failure")
        if third_party:
            continue
        args = parser.parse_args([_expand(a) for a in svc["command"]])
        roles.add(args.command)
        assert args.host == "0.0.0.0"
        assert args.metrics_port == METRICS_PORT
        if args.command in ("prefill", "decode"):
            assert args.worker_id == name == svc["hostname"]  # the router dials the hostname
            assert args.redis_url == "redis://redis:6379/0"
            assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
            assert args.engine_process  # as `pdserve up` places GPU workers
        if args.command == "router":  # named in the ledger alike across restarts
            assert args.router_id
    assert roles == {"router", "prefill", "decode"}
    # The router's API key comes from the environment (never the command line: ps shows it).
    assert services["router"]["environment"] == ["PDSERVE_API_KEY=${PDSERVE_API_KEY:-}"]
    gpus = [svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
            for n, svc in services.items() if n.startswith(("prefill", "decode"))]
    assert len(gpus) == len(set(gpus))  # one GPU per worker


def test_prometheus_scrapes_every_pdserve_service():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    prom = services["prometheus"]
    assert prom["profiles"] == ["monitoring"]  # opt-in: `docker compose --profile monitoring`
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    targets = {t for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
               for cfg in job["static_configs"] for t in cfg["targets"]}
    want = {f"{n}:{METRICS_PORT}" for n in services if n not in ("redis", "prometheus")}
    assert targets == want
