"""``pdserve generate --router``, ``pdserve info`` and the serving ``pdserve demo``: clients of
a router, through the SDK."""
from __future__ import annotations

import argparse
import itertools
import sys
import time


def cmd_generate_remote(args: argparse.Namespace) -> int:
    """Streams one prompt through a running router."""
    from client import Client, PdserveError
    from engine.cli import check_sampling_flags, sampling_kwargs
    from engine.cli_admin import connection_kwargs

    check_sampling_flags(args)
    try:
        with Client([a.strip() for a in args.router.split(",") if a.strip()],
                    **connection_kwargs(args)) as c:
            info = c.model_info()
            sampling = sampling_kwargs(args, info.sampling_defaults)
            t0 = time.perf_counter()
            # Answered by the model whose defaults were taken, whichever router it reaches.
            for chunk in c.generate(args.prompt, expect_model=info.identity, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.usage is not None:
                    u = chunk.usage
                    # On stderr, as chat's: stdout holds the text alone (`> file`).
                    print(file=sys.stdout, flush=True)
                    print(f"[{u.completion_tokens} tokens, TTFT {u.timings.ttft_s * 1e3:.1f} ms, "
                          f"total {(time.perf_counter() - t0) * 1e3:.0f} ms, "
                          f"{u.cached_tokens} cached prompt tokens]", file=sys.stderr)
    except PdserveError as e:
        print(f"pdserve: error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """Each router's model: name, identity, limits, sampling defaults. Exits 1 when the routers
    serve different models (or chat templates): a client given them all would mix them."""
    import json
    from dataclasses import asdict

    from client import Client, PdserveError
    from engine.cli_admin import connection_kwargs

    addresses = [a.strip() for a in args.router.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--router needs at least one HOST:PORT")
    infos = []
    try:
        for address in addresses:
            with Client(address, **connection_kwargs(args)) as c:
                infos.append(c.model_info(timeout=args.timeout))
    except PdserveError as e:
        print(f"pdserve: error: {address}: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{"router": a, **asdict(i)} for a, i in zip(addresses, infos)],
                         indent=2))
    else:
        print("\n\n".join(_info_text(a, i) for a, i in zip(addresses, infos)))
    if _models_differ([i.identity for i in infos]):
        print("pdserve: the routers serve different models (or chat templates): a stream "
              "goes on only on a router of its own", file=sys.stderr)
        return 1
    return 0


def _models_differ(identities) -> bool:
    """Whether two of the routers would refuse each other's streams: the rule a router applies
    to a chat's continuation (router/model_match.py), so the chat template counts. A router
    older than identities (None) says nothing either way."""
    from router.model_match import model_difference

    known = [i for i in identities if i is not None]
    return any(model_difference(a.name, a.fingerprint, b.name, b.fingerprint)
               or a.chat_template != b.chat_template
               for a, b in itertools.combinations(known, 2))


def _info_text(address: str, info) -> str:
    ident = info.identity
    defaults = info.sampling_defaults or "(none: the engine's)"
    return "\n".join([
        f"router {address}: model {info.model}",
        f"  fingerprint {ident.fingerprint if ident else '(not reported)'}",
        f"  chat template {(ident.chat_template or 'none') if ident else '(not reported)'}",
        f"  vocab size {info.vocab_size}, max model len {info.max_model_len}, "
        f"block size {info.block_size}",
        f"  eos token ids {info.eos_token_ids}",
        f"  sampling defaults {defaults}"])


def cmd_demo_serving(args: argparse.Namespace, prompts: list[str]) -> int:
    """`make demo`: pdserve up on the model, prompts streamed through the SDK, clean stop."""
    from client import Client
    from engine.presets import resolve_model
    from router.launcher import Cluster, ClusterSpec

    print(f"preparing {args.model} (built-in presets are generated on first use) ...", flush=True)
    resolve_model(args.model)
    print("starting redis-server, the router, a prefill and a decode worker ...", flush=True)
    # No access log: its line per request would land in the middle of the streamed text, and
    # the demo prints its own summary of each request.
    spec = ClusterSpec(model=args.model, worker_args=["--num-gpu-blocks", "512"],
                       router_args=["--disable-log-requests"])
    with Cluster(spec) as cluster, Client(cluster.router_address, timeout=120) as client:
        print(f"router on {cluster.router_address}", flush=True)
        for prompt in prompts:
            print(f"\n>>> {prompt}", flush=True)
            t0 = time.perf_counter()
            stamps: list[float] = []
            usage = None
            for chunk in client.generate(prompt, max_tokens=args.max_tokens, temperature=0.0,
                                         ignore_eos=True):
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                usage = chunk.usage or usage
            itl = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
            t = usage.timings
            print(f"\n[{len(stamps)} tokens, TTFT {(stamps[0] - t0) * 1e3:.1f} ms, ITL "
                  f"{itl * 1e3:.1f} ms | prefill {t.prefill_compute_s * 1e3:.1f} ms on "
                  f"{usage.prefill_worker_id}, KV transfer {t.kv_transfer_s * 1e3:.1f} ms, "
                  f"decode on {usage.decode_worker_id}]", flush=True)
        print("\nstopping the cluster ...", flush=True)
    print("(random-weight tiny model: the text is noise; the tokens match Hugging Face's)")
    return 0
