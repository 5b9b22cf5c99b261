"""`specchat rpc-server`: a llama.cpp RPC worker from this install (no separate build)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from . import ui
from .loader import default_threads
from .paths import cache_dir
from .rpc import DEFAULT_PORT, RpcError, check_port_free, serve_devices, start_server_thread

WARNING = (
    "WARNING: listening on {host}, not loopback. llama.cpp's RPC protocol has no authentication and no "
    "encryption: anyone who can reach this port can run code-sized workloads and read what it holds. "
    "Never expose it on an open network."
)


def rpc_server_command(
    host: Annotated[str, typer.Option("--host", "-H", help="Address to listen on (default loopback only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="TCP port.")] = DEFAULT_PORT,
    threads: Annotated[int | None, typer.Option("-t", "--threads", min=1, help="CPU threads (default: as for chat).")] = None,
    cache: Annotated[bool, typer.Option("--cache", help="Keep received tensors in a local file cache (faster reloads of the same model).")] = False,
) -> None:
    """Run an RPC worker: clients started with `--rpc HOST:PORT` put their target's layers here.

    It serves one client at a time and runs until Ctrl-C or SIGTERM. Loopback unless --host says otherwise;
    the protocol has no authentication, so only ever listen on a network you trust.
    """
    err = ui.make_console(stderr=True)

    def say(text: str, style: str = "") -> None:
        err.print(text, style=style, markup=False, soft_wrap=True)

    if host not in ("127.0.0.1", "localhost", "::1"):
        say(WARNING.format(host=host), "bold red")
    check_port_free(host, port)
    folder = None
    if cache:
        path = cache_dir() / "rpc"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RpcError(f"cannot create the RPC cache folder {path}: {e.strerror}") from None
        folder = str(path)
    n_threads = threads or default_threads()
    endpoint = f"{host}:{port}"
    devices = serve_devices()

    stop = []

    def on_signal(signum, frame):
        stop.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread = start_server_thread(endpoint, folder, n_threads)
        say(f"specchat rpc-server listening on {endpoint} · {len(devices)} device(s) · {n_threads} threads"
            + (f" · cache {folder}" if folder else "") + " · Ctrl-C stops")
        while not stop:
            thread.join(0.2)
            if not thread.is_alive():
                raise RpcError(f"the RPC worker could not start on {endpoint} (see the message above)")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    say("specchat rpc-server: stopped")
    sys.stdout.flush()
    sys.stderr.flush()
    # the server thread sits in accept()/recv() inside C and cannot be unwound: end the process here
    os._exit(0)
