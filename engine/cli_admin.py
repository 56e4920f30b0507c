"""``pdserve admin``: the router's admin endpoints (RouterAdmin) from the command line.

    pdserve admin --router HOST:PORT workers [--role prefill|decode] [--json]
    pdserve admin --router HOST:PORT stats [--json]
    pdserve admin --router HOST:PORT drain|undrain WORKER_ID
    pdserve admin --router HOST:PORT requests [--json]
    pdserve admin --router HOST:PORT cancel REQUEST_ID
    pdserve admin --router HOST:PORT reset-prefix-cache [WORKER_ID] [--role R] [--json]
    pdserve admin --router HOST:PORT transfers [--limit N] [--json]

A router with TLS or an API key: --tls-ca-file / --tls and --api-key (or
$PDSERVE_ADMIN_API_KEY, then $PDSERVE_API_KEY: the router's admin key where it has one).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from client.channels import call_metadata, open_channels
from client.errors import error_from_rpc
from client.failover import FailoverPolicy, check_addresses

from protos import router_pb2, router_pb2_grpc

# (header, WorkerInfo field) for the workers table.
_COLUMNS = [("worker", "worker_id"), ("role", "role"), ("address", "address"),
            ("tp", "tensor_parallel_size"), ("free/total blocks", None),
            ("running", "num_running"), ("waiting", "num_waiting"), ("leased", "num_leased"),
            ("in flight", "num_inflight"), ("draining", "draining")]
# ... and for the requests table.
_REQUEST_COLUMNS = [("request", "request_id"), ("age s", "age_s"), ("phase", "phase"),
                    ("prefill", "prefill_worker_id"), ("decode", "decode_worker_id"),
                    ("prompt", "prompt_tokens"), ("output", "output_tokens"),
                    ("migrations", "migrations")]
# ... and for the transfers table.
_TRANSFER_COLUMNS = [("transfer", "transfer_id"), ("state", "state"),
                     ("prefill", "prefill_worker_id"), ("decode", "decode_worker_id"),
                     ("blocks", "num_blocks"), ("tokens", "num_tokens"), ("age s", "age_s"),
                     ("expires in s", "expires_in_s"), ("router", "router_id"),
                     ("router live", "router_live")]


def add_connection_args(p: argparse.ArgumentParser, admin: bool = False) -> None:
    """How to reach a router that serves TLS or wants an API key (router/auth.py)."""
    p.add_argument("--api-key", default=None, help=(
        "the router's --admin-api-key, or its --api-key (default: $PDSERVE_ADMIN_API_KEY, "
        "else $PDSERVE_API_KEY, else none)" if admin else
        "the router's --api-key (default: $PDSERVE_API_KEY, else none)"))
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS, verifying the router against the system's roots")
    p.add_argument("--tls-ca-file", default=None,
                   help="PEM CA certificate(s) to verify the router's TLS certificate (implies "
                        "--tls)")


def connection_kwargs(args: argparse.Namespace) -> dict:
    """Client(...) keyword arguments from add_connection_args' flags."""
    roots = None
    if args.tls_ca_file is not None:
        try:
            with open(args.tls_ca_file, "rb") as f:
                roots = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --tls-ca-file: {e}") from None
    return dict(api_key=args.api_key or os.environ.get("PDSERVE_API_KEY") or None,
                tls=args.tls, root_certificates=roots)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="HOST:PORT of a running router")
    add_connection_args(p, admin=True)
    p.add_argument("--timeout", type=_call_timeout, default=10.0, help="seconds per call")
    sub = p.add_subparsers(dest="admin", required=True)
    w = sub.add_parser("workers", help="the live workers and their load")
    w.add_argument("--role", choices=["prefill", "decode"], default="")
    w.add_argument("--json", action="store_true")
    s = sub.add_parser("stats", help="the router's counters and the workers it routes to")
    s.add_argument("--json", action="store_true")
    for verb, text in (("drain", "stop routing requests to a worker (it keeps serving what "
                                 "it has)"), ("undrain", "route requests to it again")):
        d = sub.add_parser(verb, help=text)
        d.add_argument("worker_id")
    r = sub.add_parser("requests", help="the requests in flight on this router, oldest first")
    r.add_argument("--json", action="store_true")
    c = sub.add_parser("cancel", help="cancel a request in flight on this router (its client "
                                      "gets CANCELLED; both workers free its blocks)")
    c.add_argument("request_id")
    x = sub.add_parser("reset-prefix-cache",
                       help="forget the workers' prefix caches (all, one role's, or one "
                            "worker's); a worker holding blocks refuses; exit 1 unless every "
                            "worker asked was reset")
    x.add_argument("worker_id", nargs="?", default="")
    x.add_argument("--role", choices=["prefill", "decode"], default="")
    x.add_argument("--json", action="store_true")
    t = sub.add_parser("transfers", help="the prompt KV held for transfers across the cluster "
                                         "(prefill leases and the decode workers pulling them), "
                                         "those expiring first")
    t.add_argument("--limit", type=_list_limit, default=0,
                   help="at most this many (0: 1000; at most 10000)")
    t.add_argument("--json", action="store_true")


def _call_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < value <= 1e6:  # NaN, inf and huge values would not time out at all
        raise argparse.ArgumentTypeError(f"must be in (0, 1e6] seconds, got {text!r}")
    return value


def _list_limit(text: str) -> int:
    from router.ledger import MAX_LIST_LIMIT  # the router's bound, checked here too

    try:
        n = int(text)
    except ValueError:  # argparse would say "invalid _list_limit value"
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= n <= MAX_LIST_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_LIST_LIMIT}], got {n}")
    return n


def cmd_admin(args: argparse.Namespace) -> int:
    check_addresses(args.router)
    conn = connection_kwargs(args)
    # The admin key when the router has one (router --admin-api-key), else its API key.
    md = call_metadata(args.api_key or os.environ.get("PDSERVE_ADMIN_API_KEY")
                       or conn["api_key"])
    (ch,) = open_channels([args.router], FailoverPolicy(), conn["tls"],
                          conn["root_certificates"], aio=False)
    with ch:
        stub = router_pb2_grpc.RouterAdminStub(ch)
        try:
            rc = _run(stub, args, md)
            sys.stdout.flush()  # here: a reader that left is caught in engine.cli.main
            return rc
        except grpc.RpcError as e:
            # The SDK's message: its hint where the address serves no RouterAdmin.
            err = error_from_rpc(e)  # its code too: a stopping router's CANCELLED is not one
            print(f"pdserve admin: {err.code.name}: {err}", file=sys.stderr)
            return 1


def _run(stub, args: argparse.Namespace, md) -> int:
    if args.admin == "workers":
        resp = stub.ListWorkers(router_pb2.ListWorkersRequest(role=args.role),
                                timeout=args.timeout, metadata=md)
        # A router older than the field sends none: nothing is known to differ.
        why = list(resp.model_mismatch) or [""] * len(resp.workers)
        if args.json:
            print(json.dumps([{**_dict(w), "model_mismatch": y}
                              for w, y in zip(resp.workers, why)], indent=2))
            return 0
        print(_table(resp.workers, _COLUMNS,
                     {"model": ["another" if y else "the router's" for y in why]}))
        for w, y in zip(resp.workers, why):
            if y:  # the table has no room for why: the router's own words, after it
                print(f"{w.worker_id} gets no requests: {y}")
        return 0
    if args.admin == "stats":
        stats = stub.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=args.timeout,
                                     metadata=md)
        d = _dict(stats)
        print(json.dumps(d, indent=2) if args.json
              else "\n".join(f"{k}: {v}" for k, v in d.items()))
        return 0
    if args.admin == "requests":
        resp = stub.ListRequests(router_pb2.ListRequestsRequest(), timeout=args.timeout,
                                 metadata=md)
        print(json.dumps([_dict(r) for r in resp.requests], indent=2) if args.json
              else _table(resp.requests, _REQUEST_COLUMNS))
        return 0
    if args.admin == "reset-prefix-cache":
        return _reset_prefix_cache(stub, args, md)
    if args.admin == "transfers":
        resp = stub.ListTransfers(router_pb2.ListTransfersRequest(limit=args.limit),
                                  timeout=args.timeout, metadata=md)
        if args.json:
            print(json.dumps(_dict(resp), indent=2))
        else:
            print(_table(resp.transfers, _TRANSFER_COLUMNS))
            if resp.num_omitted:
                print(f"... and {resp.num_omitted} more")
        return 0
    if args.admin == "cancel":
        stub.CancelRequest(router_pb2.CancelRequestRequest(request_id=args.request_id),
                           timeout=args.timeout, metadata=md)
        print(f"{args.request_id}: cancelled")
        return 0
    resp = stub.DrainWorker(router_pb2.DrainWorkerRequest(
        worker_id=args.worker_id, undrain=args.admin == "undrain"), timeout=args.timeout,
        metadata=md)
    print(f"{args.worker_id}: {'draining' if resp.draining else 'routable'}")
    return 0


def _reset_prefix_cache(stub, args: argparse.Namespace, md) -> int:
    # A reset waits for each worker's running step: more than the default call timeout.
    resp = stub.ResetPrefixCache(
        router_pb2.ResetPrefixCacheRequest(worker_id=args.worker_id, role=args.role),
        timeout=max(args.timeout, 40.0), metadata=md)
    if args.json:
        print(json.dumps([_dict(w) for w in resp.workers], indent=2))
    for w in resp.workers if not args.json else ():
        if w.reset:
            print(f"{w.worker_id}: reset ({w.num_blocks_evicted} cached blocks forgotten)")
        elif w.error:
            print(f"{w.worker_id}: not reset: {w.error}")
        else:
            print(f"{w.worker_id}: not reset: {w.num_blocks_in_use} blocks in use")
    if not resp.workers:
        print("pdserve admin: the router has no routable worker" +
              (f" with role {args.role}" if args.role else "") + ": nothing was reset",
              file=sys.stderr)
        return 1
    return 0 if all(w.reset for w in resp.workers) else 1


def _dict(msg) -> dict:
    # Every field, zeros included, under its proto name: scripts can rely on the keys.
    d = MessageToDict(msg, preserving_proto_field_name=True,
                      always_print_fields_with_no_presence=True)
    _int64_as_numbers(msg.DESCRIPTOR, d)
    return d


_INT64_TYPES = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64,
                          FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED64,
                          FieldDescriptor.TYPE_SFIXED64})


def _int64_as_numbers(desc, d) -> None:
    """Proto3's JSON writes 64-bit integers as strings (JavaScript's numbers are doubles): a
    script would read "requests_total": "12". They are numbers here; no count or id this
    service reports comes near 2**53."""
    if not isinstance(d, dict):  # a well-known type's JSON (a string)
        return
    for f in desc.fields:
        if f.name not in d:
            continue
        value = d[f.name]
        if f.message_type is not None:
            if f.message_type.GetOptions().map_entry:  # none in RouterAdmin's replies
                continue
            for item in value if isinstance(value, list) else [value]:
                _int64_as_numbers(f.message_type, item)
        elif f.type in _INT64_TYPES:
            d[f.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def _table(msgs, columns, extra: dict[str, list[str]] | None = None) -> str:
    """``extra``: more columns after ``columns``, by header, a cell per message in each."""
    extra = extra or {}
    rows = [[h for h, _ in columns] + list(extra)]
    for i, m in enumerate(msgs):
        rows.append([_cell(m, f) for _, f in columns] + [cells[i] for cells in extra.values()])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in rows)


def _cell(msg, field: str | None) -> str:
    if field is None:  # a worker's blocks
        return f"{msg.num_free_blocks}/{msg.num_total_blocks}"
    value = getattr(msg, field)
    return f"{value:.1f}" if isinstance(value, float) else str(value)
