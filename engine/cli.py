"""The ``pdserve`` console script."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from engine.cli_serve import TOKENIZER_HELP
from engine.cli_vllm import add_refused_vllm_flags
from engine.grpc_experiments import apply_grpc_experiments
from protos.limits import max_message_bytes


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="HF folder or preset name")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER", help=TOKENIZER_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (auto: float32 on the CPU, the "
                        "checkpoint's on CUDA, bfloat16 for a float32 one)")
    p.add_argument("--device", default="auto", help="auto: cuda when there is one, else cpu")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests run at once")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: requests with a lower priority value run first")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens in one engine step: the prefill chunk size")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="this rank's KV-cache budget (default: 1 GiB on the CPU; on CUDA what "
                        "--gpu-memory-utilization leaves beside the weights)")
    add_refused_vllm_flags(p)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the share of the GPU's memory this process may use (weights, "
                        "KV cache, activations); processes sharing a GPU split it, e.g. 0.45 "
                        "each for two")
    p.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="exact KV block count, instead of a memory budget (overrides "
                        "--gpu-memory-utilization; not with --kv-cache-memory-gib)")
    # Both spellings, as vLLM's: its command lines carry --enable-prefix-caching (on here
    # by default), which argparse refused as an unrecognized argument.
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV of cached prompt prefixes (default: on)")
    p.add_argument("--no-enable-partial-block-hits", dest="enable_partial_block_hits",
                   action="store_false",
                   help="reuse cached prefixes in whole blocks only: never copy the cached part "
                        "of a block a prompt shares only partly")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts over steps of at most "
                                      "--max-num-batched-tokens (default: on)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks to split the model over (worker processes; gloo/NCCL)")
    p.add_argument("--tp-idle-ping-interval-s", type=float, default=5.0,
                   help="TP>1: while no step runs, ping every rank this often, so a stopped or "
                        "wedged rank fails the engine (as a dead one does) before a request "
                        "waits out the step timeout on it (0: no pings)")
    p.add_argument("--tp-idle-ping-timeout-s", type=float, default=10.0,
                   help="TP>1: a rank that has not answered an idle ping within this is taken "
                        "as wedged")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "cpu", "triton"],
                   help="auto: Triton on CUDA, the compiled CPU kernels on CPU")
    p.add_argument("--linear-backend", default="auto", choices=["auto", "onednn", "mkl", "torch"],
                   help="auto: on the CPU, weights packed for oneDNN or oneMKL (float32), "
                        "whichever runs this model's layers faster here (timed once per host)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: never capture or replay CUDA graphs")
    p.add_argument("--max-seq-len-to-capture", type=int, default=8192,
                   help="CUDA graphs cover decode steps whose contexts fit this many tokens")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    # Unset flags leave the field to the model's recommended defaults (its
    # generation_config.json), then to the CLI's own: greedy, and max_tokens below.
    p.set_defaults(cli_max_tokens=max_tokens)
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"default: the model's recommendation, else {max_tokens}")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's recommendation, else 0 (greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages tokens already in the prompt or output")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="subtracted from tokens the output has, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtracted per occurrence in the output, in [-2, 2]")
    p.add_argument("--priority", type=int, default=None,
                   help="lower runs first, on engines with --scheduling-policy priority")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="no eos, stop token or stop string ends the output before this many")
    p.add_argument("--bad-words", nargs="+", default=None, metavar="WORD",
                   help="words the output must not contain")
    p.add_argument("--guided-choice", nargs="+", default=None, metavar="TEXT",
                   help="the output is one of these texts (ends at it, with the model's eos)")
    p.add_argument("--guided-regex", default=None, metavar="PATTERN",
                   help="the output text fully matches this regular expression")
    p.add_argument("--guided-json", type=_json_schema, default=None, metavar="SCHEMA",
                   help="the output is JSON valid under this JSON schema (its JSON text, or a "
                        "file holding it)")
    p.add_argument("--guided-whitespace-pattern", default=None, metavar="PATTERN",
                   help="with --guided-json: a regular expression of the whitespace allowed "
                        "around JSON's commas, colons and brackets, e.g. '[ \\n]*'")
    p.add_argument("--logit-bias", type=_logit_bias, default=None, metavar="JSON",
                   help='added to token ids\' logits, e.g. \'{"42": 5.0, "7": -100}\'')


def _logit_bias(text: str) -> dict[int, float]:
    try:
        raw = json.loads(text)
        return {int(k): float(v) for k, v in raw.items()}
    except (ValueError, AttributeError, TypeError):
        raise argparse.ArgumentTypeError(
            'a JSON object of token id to bias, e.g. {"42": 5.0}') from None


def _json_schema(text: str) -> str:
    """A JSON schema's text, given as such or as a file's path."""
    try:
        if not text.lstrip().startswith("{") and os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        json.loads(text)
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"not a JSON schema (or a file holding one): {e}") \
            from None
    return text


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                   "logit_bias", "priority", "bad_words", "guided_choice", "guided_regex",
                   "guided_json", "guided_whitespace_pattern")


def check_sampling_flags(args: argparse.Namespace) -> None:
    """A bad sampling flag fails (ValueError) before any model loads or router is called:
    a router's answer to it came after connecting, or as UNAVAILABLE when there was none."""
    from engine.guides import check_guide
    from engine.sampling_params import SamplingParams

    check_guide(SamplingParams(**sampling_kwargs(args, {})))


def sampling_kwargs(args: argparse.Namespace, model_defaults: dict) -> dict:
    """SamplingParams (or SDK) keyword arguments: the flags given, then for what neither
    they nor the model's recommended ``model_defaults`` set, the CLI's greedy fallbacks.
    The model's defaults themselves are left for the engine or router to fill in."""
    kw = {name: getattr(args, name) for name in _SAMPLING_FLAGS
          if getattr(args, name, None) is not None}
    fallbacks = {"max_tokens": args.cli_max_tokens, "temperature": 0.0}
    for name, value in fallbacks.items():
        if name not in kw and name not in model_defaults:
            kw[name] = value
    return kw


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                scheduling_policy=args.scheduling_policy,
                max_model_len=args.max_model_len, kv_cache_memory_gib=args.kv_cache_memory_gib,
                gpu_memory_utilization=args.gpu_memory_utilization,
                num_gpu_blocks=args.num_gpu_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_partial_block_hits=args.enable_partial_block_hits,
                enable_chunked_prefill=args.enable_chunked_prefill,
                tensor_parallel_size=args.tensor_parallel_size,
                tp_idle_ping_interval_s=args.tp_idle_ping_interval_s,
                tp_idle_ping_timeout_s=args.tp_idle_ping_timeout_s,
                attention_backend=args.attention_backend, linear_backend=args.linear_backend,
                enforce_eager=args.enforce_eager,
                max_seq_len_to_capture=args.max_seq_len_to_capture)


DEMO_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Paged attention stores the KV cache in blocks so that",
]


def refuse_engine_flags(args: argparse.Namespace, why: str, model: bool = True) -> None:
    """A command that runs no engine here refuses engine flags set to other than their
    defaults, rather than ignore them (a --dtype that never applies would mislead);
    ``model``: --model too (a router serves its own)."""
    base = argparse.ArgumentParser()
    _add_engine_args(base)
    given, defaults = engine_kwargs(args), engine_kwargs(base.parse_args([]))
    changed = sorted(k for k in given if given[k] != defaults[k])
    if model and args.model != base.parse_args([]).model:
        changed.insert(0, "model")
    if changed:
        raise ValueError(f"engine flags ({', '.join(changed)}) do not apply here: {why}")


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.offline:
        from engine.cli_remote import cmd_demo_serving

        refuse_engine_flags(args, "the demo's cluster takes only --model and --max-tokens "
                                  "(use --offline, or pdserve up)", model=False)
        return cmd_demo_serving(args, DEMO_PROMPTS)
    from engine import LLM

    print(f"loading {args.model} (built-in presets are generated on first use) ...", flush=True)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        _demo_prompts(llm, args.max_tokens)
    print("\n(random-weight tiny model: the text is noise; the tokens match Hugging Face's)")
    return 0


def _demo_prompts(llm, max_tokens: int) -> None:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in DEMO_PROMPTS:
        t0 = time.perf_counter()
        first = None
        n = 0
        print(f"\n>>> {prompt}", flush=True)
        for out in llm.stream(prompt, params):
            if first is None:
                first = time.perf_counter() - t0
            n += len(out.new_token_ids)
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
        total = time.perf_counter() - t0
        itl = (total - first) / max(n - 1, 1)
        print(f"\n[{n} tokens, TTFT {first * 1e3:.1f} ms, ITL {itl * 1e3:.1f} ms]", flush=True)


def _cmd_info(args: argparse.Namespace) -> int:
    from engine.cli_remote import cmd_info

    return cmd_info(args)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.router is not None:  # "" too: not a silent run of the local engine
        from engine.cli_remote import cmd_generate_remote

        refuse_engine_flags(args, "a router's workers run with their own")
        return cmd_generate_remote(args)
    from engine import LLM, SamplingParams

    check_sampling_flags(args)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        defaults = llm.sampling_defaults
        params = SamplingParams(**{**defaults, **sampling_kwargs(args, defaults)})
        for out in llm.stream(args.prompt, params):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    print()
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.presets import make_model

    path = make_model(args.preset, args.out)
    print(path)
    return 0


# `pdserve bench NAME` runs bench/NAME.py: its add_args(parser) and main(args).
BENCHMARKS = [
    ("offline", "engine vs HF generate vs a matmul roofline"),
    ("serve", "online serving through the router vs the in-process engine: TTFT, TPOT, ITL, "
              "throughput, shared-prefix TTFT"),
    ("kvtransfer", "KV block transfer between processes vs memcpy"),
    ("streams", "the router's multiplexed decode stream vs a Decode call per request: "
                "throughput and CPU per token of each process"),
    ("chat_turns", "a chat's next turn prefilled on the decode worker holding its reply vs "
                   "on the prefill worker: turn-2 TTFT"),
    ("failover", "a worker SIGKILLed (or SIGSTOPped: --fault hang; SIGTERMed: --fault stop) "
                 "under running streams: "
                 "migrated streams' stall vs the undisturbed run, token parity"),
    ("attention", "CPU paged decode attention: the C kernel vs the torch backend vs a copy"),
    ("huge_pages", "a decode step's linear layers with their packs in huge pages vs 4 KiB "
                   "pages"),
    ("prefill_attention", "attention of prefill chunks after a cached prefix: query groups "
                          "folded vs a K/V copy per query head"),
    ("gpu", "GPU suite: engine vs HF decode, nano-vllm W1, CUDA graphs on/off, decode-kernel "
            "bandwidth vs copy"),
    ("startup", "a cluster's start, scale-out and stop with the tokenizer snapshot cached vs "
                "not: seconds and CPU"),
    ("guided", "guided_json / guided_regex decoding vs the same tokens unguided, cold and "
               "with the guide's states cached"),
    ("soak", "minutes of mixed traffic with cancels through a cluster: wrong tokens against "
             "the in-process engine, failed requests, each service's memory over time"),
    ("chaos", "soak's traffic through a supervised cluster whose workers are killed, hung "
              "and stopped one at a time: wrong tokens, failed requests, what was left held"),
]


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"bench.{args.bench}").main(args)


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """``benchmarks`` False leaves the bench modules unimported (several import torch, which
    the router, the launcher and the client side otherwise never load)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="start a local disaggregated cluster and stream a few "
                       "prompts through it (--offline: the in-process engine)")
    _add_engine_args(p)
    p.add_argument("--offline", action="store_true", help="the in-process engine only")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate text for one prompt (offline engine, or "
                       "through a running router with --router)")
    _add_engine_args(p)
    p.add_argument("--router", default=None,
                   help="HOST:PORT of a running router; several, comma-separated, fail over "
                        "(a stream whose router dies goes on on the next)")
    from engine import cli_admin

    cli_admin.add_connection_args(p)
    p.add_argument("--prompt", required=True)
    _add_sampling_args(p, max_tokens=64)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="the model a running router serves (several routers, "
                       "comma-separated: each one's; exits 1 when they differ)")
    p.add_argument("--router", required=True, help="HOST:PORT[,HOST:PORT...]")
    cli_admin.add_connection_args(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per router")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_info)

    from engine import cli_chat

    p = sub.add_parser("chat", help="a conversation on the terminal, rendered with the model's "
                       "chat template (the in-process engine, or a running router with --router)")
    _add_engine_args(p)
    p.add_argument("--router", default=None,
                   help="HOST:PORT of a running router (several, comma-separated, fail over)")
    cli_admin.add_connection_args(p)
    cli_chat.add_args(p)
    _add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=cli_chat.cmd_chat)

    from engine import cli_serve, cli_up

    p = sub.add_parser("up", help="Redis, router, prefill and decode workers, all local")
    cli_up.add_up_args(p)
    p.set_defaults(func=cli_up.cmd_up)
    p = sub.add_parser("router", help="run the router service")
    cli_serve.add_router_args(p)
    p.set_defaults(func=cli_serve.cmd_router)
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"run one {role} worker")
        _add_engine_args(p)
        # Here, not among the engine flags: generate and chat take --seed per request.
        p.add_argument("--seed", type=int, default=0,
                       help="the engine's random state at start, which samples of requests "
                            "without a seed of their own draw from (as vLLM's --seed)")
        cli_serve.add_worker_args(p)
        p.set_defaults(func=getattr(cli_serve, f"cmd_{role}"))

    p = sub.add_parser("admin", help="a running router's admin endpoints: workers, stats, "
                       "drain/undrain a worker, requests in flight and their cancel, "
                       "KV transfers in flight, prefix-cache reset")
    cli_admin.add_args(p)
    p.set_defaults(func=cli_admin.cmd_admin)

    p = sub.add_parser("make-model", help="write a built-in preset as an HF folder")
    p.add_argument("preset")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    import importlib
    for name, text in BENCHMARKS if benchmarks else ():
        b = bsub.add_parser(name, help=text)
        importlib.import_module(f"bench.{name}").add_args(b)
        b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before any gRPC channel or server exists in this process or the ones it starts.
    apply_grpc_experiments()
    _tolerant_stdout()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(benchmarks="bench" in argv).parse_args(argv)
    try:
        max_message_bytes()  # a bad value fails here, not in each service it would start
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, and no traceback
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_reader_left():
            raise  # another pipe than stdout's (a socket, a child's): a fault to show
        # The reader left (`pdserve admin workers | head -1`): what it did not read is not
        # wanted, and no traceback is. stdout goes to /dev/null, or the interpreter's own
        # flush at exit would fail on the pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (a captured stdout), no poll
        return False


def _tolerant_stdout() -> None:
    """Model text on a terminal that is not UTF-8: a character it cannot show is replaced,
    not a UnicodeEncodeError that cut a generation midway (and failed every chat turn)."""
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if encoding != "utf8" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
