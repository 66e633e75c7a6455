"""`specd`: run one service, or all three (`specd up`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from specd.drafter_choice import MODEL_FREE, auto_drafter, resolve_drafter
from specd.engine import ACTIVATION_CHOICES, AUTO_ACTIVATION_CHOICES, DTYPE_CHOICES, LOAD_FORMAT_CHOICES
from specd.up_tls import LOOPBACK, add_tls_args, drafter_delivery, gateway_backend_tls

if TYPE_CHECKING:
    from specd.mps import SharedGpu
    from specd.placement import CpuPlacement

CONFIG_ERROR = 2  # what the services exit with on a flag they cannot run with
USAGE = """specd <command> [options]

commands:
  up          start drafter, verifier and gateway together, restarting any that dies
              (Ctrl-C stops all three)
  drafter     run the drafter service
  verifier    run the verifier service
  gateway     run the gateway (OpenAI-compatible HTTP + gRPC)
  health      check a service's gRPC health (exit 0 when SERVING), for probes
  bench       benchmark a running gateway (or any OpenAI-compatible server)
  traces      summarise a --trace-file (or OTLP JSON) per service and round phase
  distill     train a cheap drafter for a target on the target's own outputs

`specd <command> --help` lists a command's options."""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    from specd.launch import die_with_parent

    die_with_parent()
    if command == "drafter":
        from drafter_service.server import main as run
    elif command == "verifier":
        from verifier_service.server import main as run
    elif command == "gateway":
        from gateway.server import main as run
    elif command == "bench":
        from specd.tools.bench import main as run
    elif command == "traces":
        from specd.tools.traces import main as run
    elif command == "distill":
        from specd.tools.distill import main as run
    elif command == "health":
        from specd.rpc.health import main as run
    elif command == "up":
        run = up
    else:
        print(f"specd: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    run(rest)


def _up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specd up",
        description="Start drafter, verifier and gateway as child processes and restart any that dies "
        "(with backoff; the others keep running); stop all on Ctrl-C/SIGTERM, or when a child cannot start.",
    )
    for add in (
        _add_port_args,
        _add_model_args,
        _add_speculation_args,
        _add_placement_args,
        _add_gateway_args,
        _add_tracing_args,
        add_tls_args,
    ):
        add(p)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for all three to be healthy")
    return p


def _add_port_args(p: argparse.ArgumentParser) -> None:
    """Ports each service listens on."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the gateway listens on; the drafter and verifier always listen on 127.0.0.1",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50050, help="gateway gRPC port")
    p.add_argument("--drafter-port", type=int, default=50051)
    p.add_argument("--verifier-port", type=int, default=50052)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Models, their devices, dtypes and weights."""
    p.add_argument("--target-model", default="embedded", help="verifier model (HF directory, .gguf or 'embedded')")
    p.add_argument(
        "--draft-model", default=None, help="draft model (--drafter model/int4/int8/distilled); default: see --drafter"
    )
    p.add_argument(
        "--drafter",
        choices=["auto", "distilled", "int4", "int8", "model", "ngram", "suffix", "none"],
        default="auto",
        help="distilled: a drafter trained by `specd distill` (default: the one shipped for the embedded target); "
        "int4 / int8: a weight-only copy of the target; model: --draft-model as is (with --quantize); ngram: prompt "
        "lookup; suffix: the suffix drafter (its tries over each request's text and the latest responses, per API "
        "key); auto: suffix on the CPU where the model drafter would be the target itself (a draft would cost a "
        "target step), else model (the shipped distilled drafter does not yet beat the quantized copy)",
    )
    p.add_argument("--drafter-device", default="cpu")
    p.add_argument("--verifier-device", default="cpu")
    p.add_argument(
        "--shared-gpu",
        choices=["auto", "mps", "off"],
        default="auto",
        help="when the drafter and the verifier are on one CUDA device: auto runs them under CUDA MPS (starting "
        "nvidia-cuda-mps-control -d, or using a daemon already running) and, where MPS cannot be had, the "
        "sequential pipeline unless one was named; mps: MPS or refuse to start; off: neither",
    )
    p.add_argument(
        "--load-format",
        choices=LOAD_FORMAT_CHOICES,
        default="auto",
        help="both models' weights; dummy: random weights in the shape of each model directory's config.json "
        "(timing a model whose weights are not at hand: every output is meaningless); synthetic: weights of "
        "that shape made so that the drafter agrees with the target on a set fraction of greedy tokens",
    )
    p.add_argument("--synthetic-agreement", type=float, default=0.8, help="see specd drafter --help")
    p.add_argument("--synthetic-seed", type=int, default=0, help="both services' (see specd drafter --help)")
    p.add_argument(
        "--cuda-graphs",
        choices=["auto", "on", "off"],
        default="auto",
        help="both services' (see specd verifier --help)",
    )
    p.add_argument(
        "--drafter-dtype",
        choices=["auto", *DTYPE_CHOICES],
        default="auto",
        help="auto: float32 for an unquantized drafter on the CPU (distilled, or the target's own 4-bit blocks "
        "through the CPU kernel), else bfloat16 (see specd drafter --help)",
    )
    p.add_argument("--verifier-dtype", default="float32")
    p.add_argument(
        "--verifier-activations",
        choices=AUTO_ACTIVATION_CHOICES,
        default="auto",
        help="the verifier's --activations; auto: int8 where the CPU kernel reads exact weight blocks (the "
        "embedded target) and the CPU sums int8, else float32",
    )
    p.add_argument("--drafter-activations", choices=ACTIVATION_CHOICES, default="float32", help="the drafter's")
    p.add_argument(
        "--quantize",
        choices=["auto", "int8", "int4", "none"],
        default="auto",
        help="draft model weights; auto: on the CPU, where the target is 4-bit already (the embedded one), its "
        "exact blocks read through the CPU kernel in float32, else int8 (see specd drafter --help)",
    )


def _add_speculation_args(p: argparse.ArgumentParser) -> None:
    """How many tokens are drafted and how rounds are pipelined."""
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="most draft tokens per round")
    p.add_argument("--speculative-mode", choices=["auto", "fixed"], default="auto", help="see specd gateway --help")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=0)
    p.add_argument("--speculative-siblings", type=int, default=0, help="see specd gateway --help; 0: chains only")
    p.add_argument("--speculative-branches", type=int, default=0, help="see specd gateway --help; 0: one block")
    p.add_argument(
        "--exchange",
        choices=["gateway", "direct"],
        default="gateway",
        help="see specd gateway --help; direct also starts the drafter with --deliver-to the verifier",
    )
    p.add_argument(
        "--pipeline",
        choices=["sequential", "cohort", "ahead", "auto"],
        default=None,
        help="see specd gateway --help; default: auto where the services have cores of their own "
        "(--placement split), else sequential",
    )


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    """CPU placement, threads, pinning and per-service metrics ports."""
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="time the CPU kernels, steps and placement again: the timings kept for this machine (the cache "
        "directory's calibration/) are dropped first, then the first service to start times and keeps them",
    )
    p.add_argument(
        "--placement",
        choices=["auto", "shared", "split"],
        default="auto",
        help="CPU services: shared: both on all cores; split: the verifier on the first half of the cores, the "
        "drafter on the rest, one thread per core; auto: split if the target's step on half the cores is at "
        "most 1.25x its time on all of them (measured once per machine and cached), else shared. Explicit "
        "--*-cpus/--*-threads, a GPU, or no model drafter: as given",
    )
    p.add_argument(
        "--drafter-overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the drafter's exchanges (its prefill of joining sequences, draft-ahead, the other cohort) while "
        "the verifier works; auto: off where a model drafter and the verifier share the CPU's cores (shared "
        "placement), whose threads would fight over them, else on",
    )
    p.add_argument("--drafter-threads", type=int, default=0, help="drafter's torch threads; 0: torch's default")
    p.add_argument("--verifier-threads", type=int, default=0, help="verifier's torch threads; 0: torch's default")
    p.add_argument("--drafter-cpus", default="", help="pin the drafter to these CPUs, e.g. 1; empty: no pinning")
    p.add_argument("--verifier-cpus", default="", help="pin the verifier to these CPUs, e.g. 0; empty: no pinning")
    p.add_argument("--drafter-metrics-port", type=int, default=0, help="drafter's Prometheus port; 0: none")
    p.add_argument("--verifier-metrics-port", type=int, default=0, help="verifier's Prometheus port; 0: none")


def _add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The gateway's limits, API behaviour and deadlines."""
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument(
        "--max-sequences-per-key",
        type=int,
        default=0,
        help="see specd gateway --help: most sequences one client (API key, else address) holds at once; 0: no limit",
    )
    p.add_argument(
        "--per-request-spec-decode-metrics",
        choices=["off", "summary", "detailed"],
        default="off",
        help="see specd gateway --help: per-request speculation statistics in each response (vLLM's flag)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["", "hermes"],
        default="",
        help='see specd gateway --help; tool_choice "auto" needs one (a target that writes <tool_call> blocks: hermes)',
    )
    p.add_argument("--chat-template", default="", help="see specd gateway --help; a Jinja file served instead")
    p.add_argument(
        "--json-undeclared-keys",
        action="store_true",
        help="see specd gateway --help; JSON objects may hold keys their schema does not declare",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=0,
        help="see specd gateway --help; 0: whole prompts at open on the verifier",
    )
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument(
        "--lease-s",
        type=float,
        default=30.0,
        help="drafter and verifier free a gateway's sequences when it has not renewed its lease for this long",
    )
    p.add_argument(
        "--drafter-timeout-s", type=float, default=5.0, help="gateway's drafter deadline; past it, target-only"
    )
    p.add_argument("--backend-timeout-s", type=float, default=60.0, help="gateway's deadline for verifier calls")
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=10.0,
        help="on Ctrl-C/SIGTERM the gateway stops first and gives in-flight requests this long to finish "
        "(new ones get 503); the drafter and verifier stop after it",
    )


def _add_tracing_args(p: argparse.ArgumentParser) -> None:
    """Where all three services send their spans."""
    p.add_argument("--trace-file", default="", help="all three services append their spans to this JSONL file")
    p.add_argument("--otlp-endpoint", default="", help="OTLP gRPC endpoint all three services export traces to")


def resolve_placement(args: argparse.Namespace, drafter: str) -> CpuPlacement:
    """Where `specd up` runs the drafter and the verifier on the CPU (see --placement)."""
    from specd.engine.checkpoints import cache_dir
    from specd.placement import CpuPlacement, choose_cpu_placement, measured_steps, split_placement

    explicit = args.drafter_cpus or args.verifier_cpus or args.drafter_threads or args.verifier_threads
    on_cpu = args.drafter_device == "cpu" and args.verifier_device == "cpu"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if args.placement == "split":
        if explicit or not on_cpu:
            raise ValueError("--placement split chooses CPUs and threads itself, for services on the CPU")
        return split_placement(cpus, "asked for")
    if args.placement == "shared" or explicit:
        return CpuPlacement(False, reason="as given" if explicit else "")
    if not on_cpu or drafter in ("none", *MODEL_FREE) or len(cpus) < 2:
        return CpuPlacement(False, reason="no CPU model drafter to overlap with, or one CPU")
    if args.load_format != "auto":
        return CpuPlacement(False, reason=f"{args.load_format} weights: the split is not timed for them")
    step_all, step_half, cached = measured_steps(
        args.target_model, args.verifier_dtype, cpus, cache_dir() / "calibration", args.recalibrate
    )
    placement = choose_cpu_placement(step_all, step_half, cpus)
    return replace(placement, reason=placement.reason + (" (measured earlier on this machine)" if cached else ""))


def drafter_overlap(args: argparse.Namespace, placement: CpuPlacement, drafter: str, explicit: bool) -> bool:
    """Whether the drafter works while the verifier does (see --drafter-overlap): not where a model
    drafter shares the verifier's cores, unless the cores were named."""
    if args.drafter_overlap != "auto":
        return bool(args.drafter_overlap == "on")
    if args.pipeline in ("cohort", "ahead"):
        return True  # named: those pipelines are overlap
    on_cpu = args.drafter_device == "cpu" and args.verifier_device == "cpu"
    return placement.split or explicit or not on_cpu or drafter in ("none", *MODEL_FREE)


def apply_placement(args: argparse.Namespace, placement: CpuPlacement) -> None:
    """Give the services the placement's cores and threads; with cores of their own, the pipeline
    that overlaps them (auto) unless one was named."""
    if placement.split:
        args.verifier_cpus, args.drafter_cpus = placement.verifier_cpus, placement.drafter_cpus
        args.verifier_threads, args.drafter_threads = placement.verifier_threads, placement.drafter_threads
    if args.pipeline is None:
        args.pipeline = "auto" if placement.split else "sequential"


def shared_gpu(args: argparse.Namespace, drafter: str) -> SharedGpu | None:
    """Where a model drafter and the verifier share one CUDA device, MPS or the sequential
    pipeline (`specd.mps.decide`), said on stderr; the pipeline it chose goes into `args`. Two
    CUDA devices: the pipeline defaults to auto, as the two then truly run at once."""
    from specd import mps

    if drafter in ("none", *MODEL_FREE):
        return None
    on_cuda = args.drafter_device.startswith("cuda") and args.verifier_device.startswith("cuda")
    shared = mps.decide(args.shared_gpu, args.drafter_device, args.verifier_device, args.pipeline)
    if shared is None:
        if on_cuda and args.pipeline is None:
            args.pipeline = "auto"
        return None
    args.pipeline = shared.pipeline
    print(f"specd up: {shared.message}", file=sys.stderr, flush=True)
    return shared


def refuse_taken_ports(args: argparse.Namespace, drafter: str) -> None:
    """Exit before anything starts when another process holds a port the stack needs: a stack beside
    another one would otherwise pass its health checks with the other's services."""
    from specd.ports import taken_ports

    wanted = {"verifier": (LOOPBACK, args.verifier_port), "gateway HTTP": (args.host, args.http_port)}
    if drafter != "none":
        wanted["drafter"] = (LOOPBACK, args.drafter_port)
    if args.grpc_port:
        wanted["gateway gRPC"] = (args.host, args.grpc_port)
    for name, port in (("drafter", args.drafter_metrics_port), ("verifier", args.verifier_metrics_port)):
        if port:
            wanted[f"{name} metrics"] = (LOOPBACK, port)
    if taken := taken_ports(wanted):
        print(f"specd up: in use by another process: {'; '.join(taken)}; nothing started", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR)


class _UpPlan(NamedTuple):
    """What `specd up` resolved from its flags and the machine before starting anything."""

    drafter: str
    draft_model: str
    quantize: str
    placement: CpuPlacement
    overlap: bool
    shared: SharedGpu | None


def up(argv: Sequence[str]) -> None:
    import grpc  # keep `specd --help` light

    from specd.rpc.health import check

    parser = _up_parser()
    args = parser.parse_args(argv)
    plan = _up_plan(parser, args)
    children = _child_commands(args, plan)
    backend_server_name = args.tls_server_name or args.host
    health = {
        "verifier": f"{LOOPBACK}:{args.verifier_port}",
        "drafter": f"{LOOPBACK}:{args.drafter_port}",
        "gateway": f"{args.host}:{args.grpc_port}",
    }
    from specd.rpc.backend_auth import child_environment
    from specd.rpc.tls import TlsConfigError, channel_credentials

    env, generated = child_environment(os.environ)
    print(
        f"specd up: the drafter and verifier listen on {LOOPBACK} only, and answer only the gateway: "
        + ("by a random token made for this run" if generated else "by the backend token you set"),
        file=sys.stderr,
        flush=True,
    )

    try:
        credentials = channel_credentials(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    except TlsConfigError as exc:
        parser.error(str(exc))

    def healthy(address: str) -> bool:
        server_name = args.tls_server_name if address == health["gateway"] else backend_server_name
        try:
            return check(address, credentials, server_name, timeout_s=1.0) == "SERVING"
        except grpc.RpcError:
            return False

    sys.exit(_supervise(args, plan, children, health, healthy, env))


def _up_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _UpPlan:
    """Check the flags together, resolve the drafter, the placement and the shared GPU; apply the placement."""
    if len({bool(args.tls_cert), bool(args.tls_key), bool(args.tls_ca)}) > 1:
        parser.error("--tls-cert, --tls-key and --tls-ca go together")
    if bool(args.tls_client_cert) != bool(args.tls_client_key) or (args.tls_client_cert and not args.tls_cert):
        parser.error("--tls-client-cert and --tls-client-key go together, and need --tls-cert")
    if not 0 <= args.synthetic_agreement <= 1:
        parser.error(f"--synthetic-agreement must be between 0 and 1, not {args.synthetic_agreement}")
    drafter, draft_model, quantize = resolve_drafter(
        args.drafter, args.draft_model, args.target_model, args.quantize, args.drafter_device
    )
    if args.drafter == "auto":
        why = auto_drafter(args.draft_model, args.target_model, args.drafter_device)[1]
    else:
        why = "as asked (--drafter)"
    print(f"specd up: drafter {drafter}: {why}", file=sys.stderr, flush=True)
    refuse_taken_ports(args, drafter)
    if args.exchange == "direct" and drafter == "none":
        parser.error("--exchange direct sends a drafter's drafts to the verifier: it needs a drafter")
    if args.recalibrate:
        from specd.engine import calibration

        # Dropped here rather than passed on: a child the supervisor restarts then reads what its first start timed.
        print(f"specd up: dropped {calibration.forget()} kept start-up timings", file=sys.stderr, flush=True)
    explicit = bool(args.drafter_cpus or args.verifier_cpus)
    try:
        placement = resolve_placement(args, drafter)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        shared = shared_gpu(args, drafter)
    except ValueError as exc:
        parser.error(str(exc))
    apply_placement(args, placement)
    overlap = drafter_overlap(args, placement, drafter, explicit)
    where = f" (verifier on CPUs {placement.verifier_cpus}, drafter on {placement.drafter_cpus})"
    why = f": {placement.reason}" if placement.reason else ""
    print(
        f"specd up: placement {'split' + where if placement.split else 'shared'}, pipeline {args.pipeline}"
        f"{'' if overlap else ', the drafter working only while the verifier does not'}{why}",
        file=sys.stderr,
        flush=True,
    )
    return _UpPlan(drafter, draft_model, quantize, placement, overlap, shared)


def _child_commands(args: argparse.Namespace, plan: _UpPlan) -> dict[str, list[str]]:
    """Each child's `specd` command line: verifier, drafter (unless none), gateway."""
    drafter, draft_model, quantize = plan.drafter, plan.draft_model, plan.quantize
    server_tls = ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key] if args.tls_cert else []
    backend_tls = [*server_tls, "--tls-client-ca", args.tls_ca] if args.tls_client_cert else server_tls
    tracing = ["--trace-file", args.trace_file, "--otlp-endpoint", args.otlp_endpoint]
    # The backends never leave loopback here, and still ask for the gateway's token:
    # any local user could otherwise open sequences on them.
    common = ["--host", LOOPBACK, "--max-context", str(args.max_context), "--lease-s", str(args.lease_s), *tracing]
    common += ["--load-format", args.load_format, "--cuda-graphs", args.cuda_graphs]
    common += ["--synthetic-seed", str(args.synthetic_seed)]
    children = {
        "verifier": [
            "verifier",
            *common,
            "--port", str(args.verifier_port),
            "--model", args.target_model,
            "--device", args.verifier_device,
            "--dtype", args.verifier_dtype, "--activations", args.verifier_activations,
            "--metrics-port", str(args.verifier_metrics_port),
            "--threads", str(args.verifier_threads),
            "--cpus", args.verifier_cpus,
            *backend_tls,
        ],
    }  # fmt: skip
    if drafter != "none":
        children["drafter"] = [
            "drafter",
            *common,
            "--port", str(args.drafter_port),
            "--drafter", drafter if drafter in MODEL_FREE else "model",
            "--model", draft_model,
            "--device", args.drafter_device,
            "--dtype", args.drafter_dtype, "--activations", args.drafter_activations,
            "--quantize", quantize,
            "--synthetic-agreement", str(args.synthetic_agreement),
            "--metrics-port", str(args.drafter_metrics_port),
            "--threads", str(args.drafter_threads),
            "--cpus", args.drafter_cpus,
            *backend_tls,
            *drafter_delivery(args),
        ]  # fmt: skip
    children["gateway"] = _gateway_command(args, drafter, plan.overlap, tracing, server_tls)
    return children


def _gateway_command(
    args: argparse.Namespace, drafter: str, overlap: bool, tracing: list[str], server_tls: list[str]
) -> list[str]:
    command = [
        "gateway",
        "--host", args.host,
        "--http-port", str(args.http_port),
        "--grpc-port", str(args.grpc_port),
        "--verifier", f"{LOOPBACK}:{args.verifier_port}",
        "--drafter", f"{LOOPBACK}:{args.drafter_port}" if drafter != "none" else "",
        "--tokenizer", args.target_model,
        "--num-speculative-tokens", str(args.num_speculative_tokens),
        "--speculative-mode", args.speculative_mode,
        "--speculative-disable-by-batch-size", str(args.speculative_disable_by_batch_size),
        "--pipeline", args.pipeline,
        "--speculative-siblings", str(args.speculative_siblings),
        "--speculative-branches", str(args.speculative_branches),
        "--max-batch", str(args.max_batch),
        "--max-sequences-per-key", str(args.max_sequences_per_key),
        "--tool-call-parser", args.tool_call_parser,
        "--json-undeclared-keys", "true" if args.json_undeclared_keys else "false",
        "--chat-template", args.chat_template,
        "--per-request-spec-decode-metrics", args.per_request_spec_decode_metrics,
        "--drafter-overlap", "true" if overlap else "false",
        "--prefill-chunk-tokens", str(args.prefill_chunk_tokens),
        "--drafter-timeout-s", str(args.drafter_timeout_s),
        "--backend-timeout-s", str(args.backend_timeout_s),
        "--shutdown-grace-s", str(args.shutdown_grace_s),
        "--exchange", args.exchange,
        *tracing,
        *server_tls,
        *gateway_backend_tls(args),
    ]  # fmt: skip
    return command


def _supervise(
    args: argparse.Namespace,
    plan: _UpPlan,
    children: dict[str, list[str]],
    health: dict[str, str],
    healthy: Callable[[str], bool],
    env: dict[str, str],
) -> int:
    """Start the children, wait for them, restart any that dies until told to stop; the exit code."""
    from specd.launch import GiveUp, Supervisor, spawn_child

    draft_model, shared = plan.draft_model, plan.shared
    supervisor = Supervisor(healthy, spawn=lambda argv: spawn_child(argv, env))
    signal.signal(signal.SIGTERM, lambda *_: supervisor.request_stop())
    signal.signal(signal.SIGINT, lambda *_: supervisor.request_stop())
    code = 0
    try:
        for name, child_args in children.items():
            supervisor.add(name, [sys.executable, "-m", "specd.cli", *child_args], health[name])
        supervisor.start()
        # Convert the embedded GGUF here while the children import (they wait for it on its lock).
        if "embedded" in (args.target_model, draft_model) or args.target_model.endswith(".gguf"):
            from specd.engine.checkpoints import materialize

            materialize(args.target_model)
        supervisor.wait_up(args.startup_timeout)
        scheme = "https" if args.tls_cert else "http"
        print(
            f"specd is up: OpenAI API at {scheme}://{args.host}:{args.http_port}/v1, "
            f"gRPC gateway at {args.host}:{args.grpc_port} (Ctrl-C stops; a service that dies is restarted)",
            flush=True,
        )
        supervisor.run()
    except GiveUp as exc:
        if not supervisor.stopping:
            print(f"specd up: {exc}; stopping everything", file=sys.stderr, flush=True)
            code = 1
    finally:
        # The gateway drains with the backends still up (its grace, then uvicorn's and gRPC's own seconds).
        supervisor.stop_all(first=("gateway",), first_grace_s=args.shutdown_grace_s + 10)
        if shared is not None:
            from specd import mps

            mps.stop_daemon(shared.started)
    return code


if __name__ == "__main__":
    main()
