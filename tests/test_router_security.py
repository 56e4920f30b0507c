"""The router over TLS with an API key (router/auth.py), through real processes: the SDK, the
CLI and the launcher's own health and routability checks, and what is refused."""
from __future__ import annotations

import json
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client, FailoverPolicy, UnauthenticatedError, UnavailableError
from client.channels import call_metadata, check_api_key
from engine import SamplingParams
from engine.cli import main as cli_main
from engine.grpc_server import ServerConfig
from protos import router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts

MODEL = SERVING_MODEL

GREEDY = dict(temperature=0.0, ignore_eos=True)
KEY = "s3cret-key"
ADMIN_KEY = "0perator-key"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def cluster(tls_files):
    cert, key = tls_files
    spec = ClusterSpec(model=MODEL, num_prefill=0, worker_args=WORKER_ARGS,
                       router_args=["--tls-cert-file", cert, "--tls-key-file", key,
                                    "--api-key", KEY, "--admin-api-key", ADMIN_KEY])
    # Its health and routability checks go over TLS, the latter with the admin key.
    with Cluster(spec) as c:
        yield c


def _roots(tls_files) -> bytes:
    with open(tls_files[0], "rb") as f:
        return f.read()


def test_a_client_with_the_ca_and_the_key_is_served(cluster, tls_files, reference):
    prompt = random_prompts(1, seed=81, lo=20, hi=20)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    with Client(cluster.router_address, timeout=60, api_key=KEY,
                root_certificates=_roots(tls_files)) as c:
        chunks = list(c.generate(prompt, max_tokens=8, **GREEDY))
        assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
        assert c.complete(prompt, max_tokens=8, **GREEDY).token_ids == want.token_ids


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_key_is_unauthenticated(cluster, tls_files, key):
    prompt = random_prompts(1, seed=82, lo=10, hi=10)[0]
    with Client(cluster.router_address, timeout=30, api_key=key,
                root_certificates=_roots(tls_files)) as c:
        with pytest.raises(UnauthenticatedError, match="API key"):
            list(c.generate(prompt, max_tokens=4))
        with pytest.raises(UnauthenticatedError):
            c.complete(prompt, max_tokens=4)


@pytest.mark.parametrize("value, served", [(f"bearer {KEY}", True), (f"BEARER {KEY}", True),
                                           (f"bearer {KEY.upper()}", False),
                                           (KEY, False), (f"Bearer  {KEY}", False)])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(cluster, tls_files, value,
                                                                  served):
    """RFC 7235: the scheme is a token matched without case; some clients and proxies send
    ``bearer``. The key after it is compared byte for byte."""
    creds = grpc.ssl_channel_credentials(_roots(tls_files))
    with grpc.secure_channel(cluster.router_address, creds) as ch:
        call = router_pb2_grpc.RouterStub(ch).GetModelInfo
        request = router_pb2.ModelInfoRequest()
        if served:
            assert call(request, timeout=10, metadata=(("authorization", value),)).model
        else:
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10, metadata=(("authorization", value),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_key_and_a_plaintext_client_gets_nowhere(cluster, tls_files):
    creds = grpc.ssl_channel_credentials(_roots(tls_files))
    with grpc.secure_channel(cluster.router_address, creds) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with Client(cluster.router_address, timeout=5, api_key=KEY,
                failover=FailoverPolicy(max_retries=0)) as c:
        with pytest.raises(UnavailableError):
            c.complete([1, 2, 3], max_tokens=2)


def test_the_cli_reaches_the_router_with_the_ca_and_the_key(cluster, tls_files, capsys,
                                                            monkeypatch):
    cert = tls_files[0]
    assert cli_main(["admin", "--router", cluster.router_address, "--tls-ca-file", cert,
                     "--api-key", ADMIN_KEY, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_decode_workers"] == 1 and stats["num_prefill_workers"] == 0
    for key in ([], ["--api-key", KEY]):  # none, or the one for generating
        assert cli_main(["admin", "--router", cluster.router_address, "--tls-ca-file", cert,
                         *key, "workers"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", ADMIN_KEY)
    assert cli_main(["admin", "--router", cluster.router_address, "--tls-ca-file", cert,
                     "workers"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)  # the key from the environment
    assert cli_main(["generate", "--router", cluster.router_address, "--tls-ca-file", cert,
                     "--prompt", "hello", "--max-tokens", "4"]) == 0
    assert "4 tokens" in capsys.readouterr().err  # the figures go to stderr


@pytest.mark.parametrize("key", ["", " x", "a b", "x\n", 5, "clé", "ключ"])
def test_bad_api_keys_are_refused_on_both_sides(key):
    with pytest.raises(ValueError, match="api_key"):
        check_api_key(key)
    with pytest.raises(ValueError, match="api_key"):
        call_metadata(key)


def test_tls_needs_both_files_and_existing_ones(tls_files, tmp_path):
    cert, key = tls_files
    with pytest.raises(ValueError, match="both"):
        ServerConfig(tls_cert_file=cert)
    with pytest.raises(ValueError, match="does not exist"):
        ServerConfig(tls_cert_file=cert, tls_key_file=str(tmp_path / "missing.pem"))
    assert ServerConfig(tls_cert_file=cert, tls_key_file=key).tls


def test_the_admin_service_takes_the_admin_key_and_only_it(cluster, tls_files):
    """A client allowed to generate is not allowed to drain workers or cancel others'
    requests: RouterAdmin wants --admin-api-key, Router --api-key."""
    from protos import router_pb2, router_pb2_grpc

    creds = grpc.ssl_channel_credentials(_roots(tls_files))
    with grpc.secure_channel(cluster.router_address, creds) as ch:
        admin = router_pb2_grpc.RouterAdminStub(ch)
        for key in (KEY, None, "wrong"):
            with pytest.raises(grpc.RpcError) as err:
                admin.ListRequests(router_pb2.ListRequestsRequest(), timeout=10,
                                   metadata=call_metadata(key))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        admin.ListRequests(router_pb2.ListRequestsRequest(), timeout=10,
                           metadata=call_metadata(ADMIN_KEY))
    with Client(cluster.router_address, timeout=30, api_key=ADMIN_KEY,
                root_certificates=_roots(tls_files),
                failover=FailoverPolicy(max_retries=0)) as c:
        with pytest.raises(UnauthenticatedError):
            c.complete([1, 2, 3], max_tokens=2)


@pytest.mark.parametrize("names", ["DNS:localhost", "DNS:pdserve.example,DNS:*.example",
                                   "IP:127.0.0.1"])
def test_the_launchers_probe_trusts_a_certificate_that_does_not_name_127_0_0_1(tmp_path, names):
    """The launcher probes its services on 127.0.0.1 with their own certificate: one made for
    localhost (or a host name) failed the hostname check on every probe, and `pdserve up`
    waited out its start timeout for a router that served all along."""
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health

    from router.launcher import _channel

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", f"subjectAltName={names}"], check=True, capture_output=True)
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        with _channel(["--tls-cert-file", str(cert)], f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)
