"""`fastremover serve`: the flags, the bind-address rule, and uvicorn on a socket we open (so `--port 0` works and the
real address is printed)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import sys

from fastremover.config import EngineConfig, ModelSource, add_engine_args, add_model_args
from fastremover.env import API_KEY_ENV, serve_api_key
from fastremover.errors import FastRemoverError
from fastremover.extras import install_hint

EXIT_USER_ERROR = 2


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the HTTP removal service (OpenAI-style /v1/videos API + a web page)")
    add_model_args(p, default="classic")
    # the engine flags of `remove` (fastremover/config.py); without --device, one worker per GPU
    add_engine_args(p, help={"device": "cpu | cuda | cuda:N (default: one worker per GPU, else the CPU)"})
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--data-dir", default="fastremover-data",
                   help="job store, uploads and outputs (default ./fastremover-data)")
    p.add_argument("--media-root", action="append", default=[], metavar="DIR",
                   help="a folder whose files clients may name by path (repeatable; default: none, uploads only)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (or set {API_KEY_ENV})")
    p.add_argument("--insecure-public", action="store_true",
                   help="allow binding a non-loopback address without an API key")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="a Host name clients use besides the loopback names and --host (repeatable; '*.example.com' "
                   "patterns; '*' for any). Default: loopback names and --host without an API key, any with one")
    p.add_argument("--allow-urls", action="store_true",
                   help="accept http(s) URL inputs (public hosts only, size and time capped)")
    p.add_argument("--url-timeout", type=float, default=60.0,
                   help="wall-clock seconds one URL download may take, redirects included (default 60)")
    p.add_argument("--keep-hours", type=float, default=24.0, help="delete finished jobs and uploads after this long")
    p.add_argument("--max-upload-mb", type=float, default=2048.0, help="largest request body in MiB (413 above)")
    p.add_argument("--max-queue", type=int, default=64, help="queued jobs accepted before answering 429")
    p.add_argument("--max-decoded-gib", type=float, default=4.0,
                   help="decoded size limit of a job's video + mask (frames x pixels), as in `remove`")
    p.add_argument("--sync-timeout", type=float, default=600.0, help="seconds POST /v1/videos/sync waits")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM, seconds the running job may take to finish before it is re-queued")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_serve_extra() -> None:
    """The service's packages (the `serve` extra), or one FastRemoverError naming the missing one and the install."""
    for module, package in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("python_multipart", "python-multipart")):
        try:
            __import__(module)
        except ImportError:
            raise FastRemoverError(f"fastremover serve needs {package}, which is not installed: "
                                   f"{install_hint('serve')}") from None


def config_from_args(args):
    require_serve_extra()
    from fastremover.serve.app import ServeConfig

    source, engine = ModelSource.from_args(args), EngineConfig.from_args(args)  # checked before anything loads
    api_key = args.api_key or serve_api_key()
    if not is_loopback(args.host) and api_key is None and not args.insecure_public:
        raise FastRemoverError(f"--host {args.host}: without --api-key the server binds to loopback only; give "
                               "--api-key KEY (or --insecure-public to serve everyone)")
    for name in ("keep_hours", "max_upload_mb", "max_decoded_gib", "sync_timeout", "url_timeout"):
        if not getattr(args, name) > 0:
            raise FastRemoverError(f"--{name.replace('_', '-')} must be positive")
    for name in args.allowed_host or []:
        if not name or "/" in name or "*" in name[1:] or (name.startswith("*") and name != "*"
                                                          and not name.startswith("*.")):
            raise FastRemoverError(f"--allowed-host {name!r}: give a host name, '*.example.com' or '*'")
    if args.max_queue < 1 or args.shutdown_grace < 0 or not 0 <= args.port <= 65535:
        raise FastRemoverError("--max-queue must be >= 1, --shutdown-grace >= 0 and --port in 0..65535")
    return ServeConfig(
        data_dir=args.data_dir, model=source, engine=engine, media_roots=list(args.media_root), api_key=api_key,
        max_upload_bytes=int(args.max_upload_mb * 2**20), max_queue=args.max_queue,
        max_decoded_gib=args.max_decoded_gib, allow_urls=args.allow_urls, keep_hours=args.keep_hours,
        sync_timeout_s=args.sync_timeout, shutdown_grace_s=args.shutdown_grace, url_timeout_s=args.url_timeout,
        allowed_hosts=args.allowed_host, bind_host=args.host,
    )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise FastRemoverError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --host/--port") from None
    sock.listen(128)
    return sock


def serve(config, host: str, port: int, *, log_level: str = "info", workers=None) -> int:
    """Run until SIGTERM/SIGINT; prints `fastremover serve: listening on http://HOST:PORT` once bound."""
    try:
        import uvicorn

        from fastremover.serve.app import create_app
    except ImportError as e:
        raise FastRemoverError(f"the service needs the serve extra ({e.name} is missing): "
                               f"{install_hint('serve')}") from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config, workers=workers)
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"fastremover serve: listening on http://{shown}:{actual} (data in {config.data_dir})", flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM/SIGINT: the service learns it before requests drain
            app.state.service.begin_stop()
            super().handle_exit(sig, frame)

    # Open requests get the grace plus a margin: a sync request answers its 503 at the grace itself (begin_stop).
    server = Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=config.shutdown_grace_s + 5,
                                   access_log=log_level == "debug"))
    # uvicorn shuts down gracefully on SIGTERM/SIGINT (stop accepting, finish requests, lifespan shutdown: the
    # running job finishes or is re-queued), then re-raises the signal to the handler that was set before it ran.
    # That handler ends the process with status 0 instead of dying by the signal.
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("fastremover serve: stopped", flush=True)
    return 0


class _Stopped(Exception):
    pass



def _stopped(sig, frame) -> None:
    raise _Stopped()


def cmd_serve(args) -> int:
    config = config_from_args(args)
    if args.insecure_public and config.api_key is None:
        print(f"fastremover serve: warning: --insecure-public without --api-key: anyone who can reach {args.host} "
              "can run jobs and read or delete every job's inputs and results", file=sys.stderr, flush=True)
    return serve(config, args.host, args.port, log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastremover")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_serve(args)
    except FastRemoverError as e:
        print(f"fastremover: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
