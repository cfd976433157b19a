"""``python -m deepinfer_npu.serve``: an OpenAI-compatible HTTP server (completions, chat, models, health, metrics).

With no ``--model`` it serves the reference model shipped in the package. Every engine option of
``python -m deepinfer_npu.run`` applies. SIGTERM / Ctrl-C: stop accepting, let running requests finish for up to
``--shutdown-timeout`` seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time

logger = logging.getLogger("deepinfer_npu.serve")


def build_parser() -> argparse.ArgumentParser:
    from deepinfer_npu.engine_args import build_parser as engine_parser

    p = engine_parser(prog="python -m deepinfer_npu.serve", description=__doc__.splitlines()[0], engine_only=True)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send; None: the model directory's name")
    s.add_argument("--chat-template", default=None,
                   help="chat template file or text; None: the model's (tokenizer_config.json / chat_template.jinja)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests waiting for their first token beyond which new ones get 503; None: unbounded")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish on SIGTERM before they are aborted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    return p


#: a server's default step size at most: a prefill step delays every running request's next token (vLLM's server
#: default on GPUs of the H100 class; its offline default is 16384, as is the CUDA backend's)
SERVING_MAX_NUM_BATCHED_TOKENS = 8192


def serving_step_tokens(config) -> int | None:
    """``config.max_num_batched_tokens``, or when unset the backend's default capped at
    SERVING_MAX_NUM_BATCHED_TOKENS (None where the backend cannot be resolved: the engine reports why)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    from deepinfer_npu.hal.registry import backend_class

    try:
        default = backend_class(config.backend).default_max_num_batched_tokens
    except (RuntimeError, ValueError):
        return None
    return min(SERVING_MAX_NUM_BATCHED_TOKENS, default)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 after a clean shutdown; 2 bad arguments, model or port."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        level=getattr(logging, args.log_level.upper()))
    import uvicorn

    from deepinfer_npu.config import REFERENCE_MODEL_DIR, EngineConfig
    from deepinfer_npu.engine_args import engine_kwargs
    from deepinfer_npu.entrypoints.async_llm import AsyncLLM
    from deepinfer_npu.entrypoints.chat_template import ChatTemplateError, load_chat_template
    from deepinfer_npu.entrypoints.metrics import ServerMetrics
    from deepinfer_npu.entrypoints.openai.api_server import build_app, describe_routes
    from deepinfer_npu.run import run_headless_node

    if args.model is None and not (REFERENCE_MODEL_DIR / "config.json").exists():
        return _error(f"no --model given and the reference model is not installed at {REFERENCE_MODEL_DIR}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        return _error(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    try:
        config = EngineConfig(model=args.model, **engine_kwargs(args))
        config.max_num_batched_tokens = serving_step_tokens(config)
        chat_template = load_chat_template(config.model_dir, args.chat_template)
        headless = run_headless_node(config)  # a node > 0 (or torchrun rank > 0) serves its ranks, no HTTP
    except (ValueError, FileNotFoundError, ChatTemplateError) as e:
        return _error(e)
    if headless is not None:
        return headless
    try:
        sock = _bind(args.host, args.port)  # before loading the model: a taken port fails fast
    except OSError as e:
        return _error(f"cannot listen on {args.host}:{args.port}: {e}")
    name = args.served_model_name or config.model_dir.name
    metrics = ServerMetrics(name)
    t0 = time.perf_counter()
    try:
        llm = AsyncLLM(config, max_waiting_requests=args.max_waiting_requests, observer=metrics.observe)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sock.close()
        return _error(e)
    metrics.bind(llm)
    llm.prepare_structured_output()  # a server's first constrained request should not wait for xgrammar's import
    app = build_app(llm, name, chat_template, metrics)
    host, port = sock.getsockname()[:2]
    logger.info("model %s loaded in %.1f s (backend %s, max_model_len %d, chat template: %s)", name,
                time.perf_counter() - t0, llm.stats.get("backend"), llm.max_model_len,
                chat_template.origin if chat_template else "none")
    logger.info("routes: %s", ", ".join(r["path"] for r in describe_routes(app)))
    print(f"serving {name} on http://{host}:{port}", flush=True)
    server = _server_class()(uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                                            timeout_graceful_shutdown=args.shutdown_timeout))
    try:
        server.run(sockets=[sock])
    finally:
        llm.shutdown()
    print("server stopped", flush=True)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises the signal that stopped it once it has shut down (the process then dies of it);
        a shutdown asked for by SIGTERM / Ctrl-C that completed is a clean exit here (status 0)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _error(message) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
