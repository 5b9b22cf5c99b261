"""llama.cpp's RPC backend from the installed llama-cpp-python: workers that hold some of a target's
layers, and the client side that registers them before a model loads.

Everything goes through ggml's own exports (`ggml/include/ggml-rpc.h`, `ggml-backend.h`) by ctypes, from
the libraries llama-cpp-python installs when it is built with `-DGGML_RPC=on`:

- worker: `ggml_backend_rpc_start_server(endpoint, cache_dir, n_threads, n_devices, devices)` serves one
  client at a time and never returns while it listens;
- client: `ggml_backend_rpc_add_server(endpoint)` returns a registry `RPC[host:port]` whose devices
  (`RPC0`, `RPC1`, ...) are registered with `ggml_backend_register` and named explicitly in
  `llama_model_params.devices`: with the default (NULL) list every layer stayed on the CPU.

ggml's client aborts the process when a worker cannot be reached or stops answering (GGML_ABORT). So
endpoints are probed from Python first (connect + the protocol's HELLO, with a timeout), and an abort
callback turns a worker lost mid-evaluation into one line and exit code 2 instead of a core dump.

A worker that is there but silent (stopped, wedged, its host asleep) is another matter: ggml's calls
block on its socket without a deadline, and a signal's Python handler waits for them to return. So every
decode on workers runs inside `waiting_on` (see Watchdog): past a deadline, or on Ctrl-C / SIGTERM /
SIGHUP, a thread of ours says which workers and ends the process, and what chat saved stays saved.
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import compat
from .errors import BackendError

DEFAULT_PORT = 50052
PROBE_TIMEOUT = 3.0
REINSTALL = (
    'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir --no-deps --no-binary llama-cpp-python '
    '"llama-cpp-python>=0.3.36,<0.4" (add -DGGML_CUDA=on to CMAKE_ARGS for CUDA; ~8 min to compile)'
)
# the HELLO request of the installed protocol (v7): cmd byte 14, u64 size, 24 capability bytes
_HELLO_CMD = 14
_HELLO_CAPS = 24
_GPU_TYPES = (1, 2)  # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU


class RpcError(BackendError):
    """An RPC endpoint, worker or build problem; one line for the user (exit 2)."""


# -- endpoints -------------------------------------------------------------------------------------


def parse_endpoints(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """`HOST:PORT[,HOST:PORT...]` (or a list of them) -> normalised endpoints; () for none."""
    if text is None:
        return ()
    parts = text.split(",") if isinstance(text, str) else [p for item in text for p in str(item).split(",")]
    endpoints: list[str] = []
    for raw in parts:
        item = raw.strip()
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
            raise RpcError(f"bad RPC endpoint {raw.strip()!r}: expected HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:{DEFAULT_PORT}")
        endpoint = f"{host}:{int(port)}"
        if endpoint in endpoints:
            raise RpcError(f"RPC endpoint {endpoint} is given twice")
        endpoints.append(endpoint)
    return tuple(endpoints)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT) -> None:
    """Raise RpcError unless a worker answers HELLO at `endpoint` within `timeout` seconds (ggml's own
    client would abort the process, or wait forever on a worker busy with another client)."""
    host, port = split_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise RpcError(f"RPC worker {endpoint} is unreachable (no answer within {timeout:g} s)") from None
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise RpcError(
            f"RPC worker {endpoint} is unreachable ({why.lower()}): start one there with "
            f"`specchat rpc-server --host {host} --port {port}`"
        ) from None
    try:
        sock.settimeout(timeout)
        sock.sendall(struct.pack("<BQ", _HELLO_CMD, _HELLO_CAPS) + bytes(_HELLO_CAPS))
        head = _recv(sock, 8)
        size = struct.unpack("<Q", head)[0]
        body = _recv(sock, min(size, 64))
    except socket.timeout:
        raise RpcError(
            f"RPC worker {endpoint} accepted the connection but did not answer within {timeout:g} s "
            "(a worker serves one client at a time: is another client using it?)"
        ) from None
    except (OSError, EOFError):
        raise RpcError(f"RPC worker {endpoint} closed the connection during the handshake (not a llama.cpp RPC worker, or another version)") from None
    finally:
        sock.close()
    major = body[0] if body else -1
    if major != protocol_major():
        raise RpcError(f"RPC worker {endpoint} speaks protocol v{major}, this llama.cpp v{protocol_major()}: install the same llama-cpp-python on both")


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def protocol_major() -> int:
    """RPC_PROTO_MAJOR_VERSION of the installed ggml-rpc.h (7 for llama-cpp-python 0.3.36)."""
    header = Path(lib_dir()).parent.parent / "include" / "ggml-rpc.h"
    try:
        for line in header.read_text().splitlines():
            if line.startswith("#define RPC_PROTO_MAJOR_VERSION"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return 7


# -- the libraries ---------------------------------------------------------------------------------


def lib_dir() -> str:
    import llama_cpp  # start-up: llama_cpp takes 0.4 s to import

    return os.path.join(os.path.dirname(llama_cpp.__file__), "lib")


class _Libs:
    def __init__(self):
        import llama_cpp  # start-up: llama_cpp takes 0.4 s to import

        if not llama_cpp.llama_supports_rpc():
            raise RpcError(f"this llama-cpp-python was built without RPC; reinstall it: {REINSTALL}")
        folder = lib_dir()
        try:
            self.ggml = ctypes.CDLL(_loaded_copy(folder, "libggml"))
            self.base = ctypes.CDLL(_loaded_copy(folder, "libggml-base"))
            self.rpc = ctypes.CDLL(_loaded_copy(folder, "libggml-rpc"))
        except OSError as e:
            raise RpcError(f"cannot load ggml's RPC library from {folder} ({e}); reinstall: {REINSTALL}") from None
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for lib, name, args, res in (
            (self.rpc, "ggml_backend_rpc_start_server", [cp, cp, sz, sz, ctypes.POINTER(vp)], None),
            (self.rpc, "ggml_backend_rpc_add_server", [cp], vp),
            (self.ggml, "ggml_backend_register", [vp], None),
            (self.ggml, "ggml_backend_dev_count", [], sz),
            (self.ggml, "ggml_backend_dev_get", [sz], vp),
            (self.ggml, "ggml_backend_dev_by_type", [ctypes.c_int], vp),
            (self.base, "ggml_backend_reg_dev_count", [vp], sz),
            (self.base, "ggml_backend_reg_dev_get", [vp, sz], vp),
            (self.base, "ggml_backend_reg_name", [vp], cp),
            (self.base, "ggml_backend_dev_name", [vp], cp),
            (self.base, "ggml_backend_dev_type", [vp], ctypes.c_int),
            (self.base, "ggml_backend_dev_backend_reg", [vp], vp),
            (self.base, "ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
            (self.base, "ggml_set_abort_callback", [vp], vp),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res


def _loaded_copy(folder: str, stem: str) -> str:
    """The file of `stem` that libllama already loaded. The wheel holds `libggml-base.so` and
    `libggml-base.so.0` as separate copies: opening the other one would give a second ggml, with its
    own backend registry and abort callback."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.count("/") else ""
                name = os.path.basename(path)
                if path.startswith(folder) and (name == f"{stem}.so" or name.startswith(f"{stem}.so.")):
                    return path
    except OSError:
        pass
    for name in (f"{stem}.so.0", f"{stem}.so", f"{stem}.dylib", f"{stem}.0.dylib"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return os.path.join(folder, f"{stem}.so")


_libs: _Libs | None = None


def libs() -> _Libs:
    global _libs
    if _libs is None:
        _libs = _Libs()
    return _libs


# -- the client side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RpcDevice:
    name: str  # RPC0, RPC1, ...
    endpoint: str
    handle: int  # ggml_backend_dev_t


_registered: dict[str, list[RpcDevice]] = {}
abort_hint = ""  # appended to the one line printed when a worker is lost (chat sets the transcript path)


def register(endpoints: Sequence[str]) -> list[RpcDevice]:
    """Probe each worker, add it to ggml's registry once per process, and return its devices in order."""
    lib = libs()
    _install_abort_handler()
    devices: list[RpcDevice] = []
    for endpoint in endpoints:
        probe(endpoint)
        if endpoint not in _registered:
            reg = lib.rpc.ggml_backend_rpc_add_server(endpoint.encode())
            if not reg:
                raise RpcError(f"RPC worker {endpoint} offers no devices")
            lib.ggml.ggml_backend_register(reg)
            found = []
            for i in range(lib.base.ggml_backend_reg_dev_count(reg)):
                dev = lib.base.ggml_backend_reg_dev_get(reg, i)
                found.append(RpcDevice(lib.base.ggml_backend_dev_name(dev).decode(), endpoint, dev))
            _registered[endpoint] = found
        devices.extend(_registered[endpoint])
    return devices


def any_registered() -> bool:
    return bool(_registered)


def local_gpu_devices() -> list[int]:
    """This machine's GPU devices (never an RPC one), for a device list named explicitly."""
    lib = libs()
    out = []
    for i in range(lib.ggml.ggml_backend_dev_count()):
        dev = lib.ggml.ggml_backend_dev_get(i)
        reg = lib.base.ggml_backend_dev_backend_reg(dev)
        if reg and lib.base.ggml_backend_reg_name(reg) == b"RPC":
            continue
        if lib.base.ggml_backend_dev_type(dev) in _GPU_TYPES:
            out.append(dev)
    return out


def devices_here() -> list[int] | None:
    """The device list for a model that must stay on this machine: None (llama.cpp's default) until a worker
    is registered in this process, after which the default list would include the workers."""
    return local_gpu_devices() if _registered else None


def device_memory(device: RpcDevice) -> tuple[int, int]:
    """(free, total) bytes the worker reports for its device."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    libs().base.ggml_backend_dev_memory(device.handle, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def last_line(line: str, code: int, exit: Callable[[int], None] = os._exit) -> None:
    """End the process from inside a C call or another thread (nothing can be unwound): the one line on
    stderr, with how to go on (`abort_hint`), then `code`."""
    if abort_hint:
        line += f"; {abort_hint}"
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os.write(2, (" ".join(line.split()) + "\n").encode())
    exit(code)


_ABORT_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_abort_cb = None


def _install_abort_handler() -> None:
    """ggml aborts when an RPC worker stops answering; say so in one line and exit 2 instead (the C
    caller cannot be unwound, so the process ends here; what chat saved stays saved)."""
    global _abort_cb
    if _abort_cb is not None:
        return

    def on_abort(message: bytes | None) -> None:
        text = (message or b"").decode("utf-8", "replace").strip()
        text = text.split(": ", 1)[-1] if ".cpp:" in text.split(": ", 1)[0] else text
        if "RPC" in text or "rpc" in text:
            where = ", ".join(sorted(_registered)) or "?"
            line = f"specchat: error: lost the RPC worker ({where}): {text}"
        else:
            line = f"specchat: error: llama.cpp aborted: {text}"
        last_line(line, 2)

    _abort_cb = _ABORT_TYPE(on_abort)
    libs().base.ggml_set_abort_callback(ctypes.cast(_abort_cb, ctypes.c_void_p))


# -- a worker that stops answering ------------------------------------------------------------------

# A decode on workers may take this much longer than the slowest one seen (per token, for its size) before
# the worker is called silent: generous, since a network has hiccups and a worker's first batch of a
# new size builds its graph; short beside "forever".
DEADLINE_SLACK = 10.0
DEADLINE_FACTOR = 3.0


class Watchdog:
    """Watches the decodes that wait on RPC workers, from a thread of its own (the main thread is inside
    ggml then, and a Python signal handler cannot run until ggml returns).

    - Past `deadline(n)` seconds in one decode: one line naming the workers that stopped answering,
      `on_stop` callbacks (chat saves the reply so far), exit code 2.
    - Ctrl-C, SIGTERM or SIGHUP during such a decode: the same at once, exit code 128 + the signal. Signals
      reach the thread through `signal.set_wakeup_fd`, which the C-level handler writes to even while
      the main thread is blocked; outside a decode they are left to the usual Python handlers."""

    def __init__(self, exit: Callable[[int], None] = os._exit):
        self._exit = exit
        self._reader, self._writer = socket.socketpair()
        for sock in (self._reader, self._writer):
            sock.setblocking(False)
        self._lock = threading.Lock()
        self._call: tuple[float, int, tuple[str, ...]] | None = None  # (started, tokens, endpoints)
        self.slowest = 0.0  # seconds of the slowest decode seen
        self.slowest_per_token = 0.0
        self.on_stop: list[Callable[[str], None]] = []
        threading.Thread(target=self._watch, name="specchat-rpc-watchdog", daemon=True).start()

    def deadline(self, n_tokens: int) -> float:
        expected = max(self.slowest if n_tokens <= 1 else 0.0, self.slowest_per_token * n_tokens)
        return DEADLINE_SLACK + DEADLINE_FACTOR * expected

    @contextmanager
    def waiting_on(self, endpoints: Sequence[str], n_tokens: int) -> Iterator[None]:
        if self._call is not None:  # inside another (a checkpoint's own eval): that one is timed
            yield
            return
        try:  # (asyncio, under prompt-toolkit, sets its own wakeup fd while the chat waits for input)
            previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread: signals cannot be seen here
            previous = None
        started = time.monotonic()
        with self._lock:
            self._call = (started, max(1, n_tokens), tuple(endpoints))
        try:
            yield
        finally:
            with self._lock:
                self._call = None
            if previous is not None:
                signal.set_wakeup_fd(previous)
            seconds = time.monotonic() - started
            self.slowest = max(self.slowest, seconds)
            self.slowest_per_token = max(self.slowest_per_token, seconds / max(1, n_tokens))

    def _watch(self) -> None:
        while True:
            readable, _, _ = select.select([self._reader], [], [], 0.25)
            signals = self._reader.recv(64) if readable else b""
            with self._lock:
                call = self._call
            if call is None:
                continue
            started, n_tokens, endpoints = call
            waited = time.monotonic() - started
            if signals:
                signum = signals[-1]
                # (only signals with a Python handler write the byte: SIGINT, SIGTERM, SIGHUP)
                how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
                self._stop(f"specchat: {how} while waiting {waited:.0f} s for RPC worker "
                           f"{', '.join(endpoints)}", 128 + signum)
            elif waited > self.deadline(n_tokens):
                gone = unreachable(endpoints, timeout=0.5)
                if gone:
                    what = f"lost the RPC worker {', '.join(gone)} (nothing listens there any more)"
                else:
                    what = (f"RPC worker {', '.join(endpoints)} stopped answering: no reply in {waited:.0f} s "
                            f"(the slowest step so far took {self.slowest:.1f} s)")
                self._stop(f"specchat: error: {what}", 2)

    def _stop(self, line: str, code: int) -> None:
        for callback in list(self.on_stop):
            try:
                callback(line)
            except Exception:  # the process ends either way: saving is best effort
                pass
        last_line(line, code, self._exit)


@functools.cache
def watchdog() -> Watchdog:
    """The process's one watchdog, started with the first decode on workers."""
    return Watchdog()


# -- the worker ------------------------------------------------------------------------------------


def cpu_device() -> int:
    dev = libs().ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        raise RpcError("no CPU device in this llama.cpp build")
    return dev


def serve_devices() -> list[int]:
    """What the worker serves, as llama.cpp's rpc-server picks it: its GPUs, else the CPU."""
    return local_gpu_devices() or [cpu_device()]


def check_port_free(host: str, port: int) -> None:
    """Bind the port as ggml's server would (SO_REUSEADDR) and let go, so a busy port is one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RpcError(f"cannot listen on {host}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise RpcError(f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()} (another rpc-server?); pick another --port") from None
    finally:
        sock.close()


def start_server_thread(endpoint: str, cache_dir: str | None, n_threads: int) -> threading.Thread:
    """Run ggml_backend_rpc_start_server in a daemon thread (it blocks for as long as it serves); the
    thread ends only if the server could not start."""
    lib = libs()
    devices = serve_devices()
    array = (ctypes.c_void_p * len(devices))(*devices)
    args = (endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads, len(devices), array)
    thread = threading.Thread(target=lib.rpc.ggml_backend_rpc_start_server, args=args, daemon=True, name="rpc-server")
    thread._specchat_keep = array  # the device array must outlive the call
    thread.start()
    return thread


# -- loading a model onto the workers --------------------------------------------------------------


def placement(n_layer: int, n_gpu_layers: int, devices: Sequence[RpcDevice], n_gpus: int = 0) -> str:
    """Where the layers went, counted as llama.cpp counts them: n_layer repeating layers + the output
    layer; -ngl N offloads the last N of those (the output layer first) to the devices named (RPC
    workers first, then local GPUs); the rest stay on this machine's CPU."""
    total = n_layer + 1
    remote = total if n_gpu_layers < 0 else min(n_gpu_layers, total)
    where = ", ".join(f"{d.name} {d.endpoint}" for d in devices)
    gpus = f" + {n_gpus} local GPU(s)" if n_gpus else ""
    if remote == 0:
        return f"all {total} layers on this CPU (-ngl 0)"
    local = f", {total - remote} on this CPU" if remote < total else ""
    return f"{remote}/{total} layers on RPC ({where}){gpus}{local}"


def load_failure(path, size: int, devices: Sequence[RpcDevice], reason: str) -> RpcError:
    """The one line for a model that did not load onto its workers: almost always a worker that could
    not allocate its share (llama.cpp says only 'Failed to load model')."""
    parts = []
    for d in devices:
        try:
            free, _ = device_memory(d)
            parts.append(f"{d.endpoint} reports {free / 2**20:.0f} MiB free")
        except Exception:  # pragma: no cover - the worker went away while we asked
            parts.append(f"{d.endpoint} did not answer")
    return RpcError(
        f"llama.cpp could not load {Path(path).name} ({size / 2**20:.1f} MiB) onto the RPC workers: a worker "
        f"could not allocate its share (too little memory?) or the file is bad ({'; '.join(parts)}); "
        f"lower -ngl to keep more layers here, or add workers ({reason.splitlines()[0] if reason else 'no detail'})"
    )


def unreachable(endpoints: Sequence[str], timeout: float = 1.0) -> list[str]:
    """The endpoints where nothing listens any more. A TCP connect only: a worker serves one client at
    a time, so while it serves us a HELLO would wait; its listening socket still takes the connection."""
    gone = []
    for endpoint in endpoints:
        try:
            socket.create_connection(split_endpoint(endpoint), timeout=timeout).close()
        except OSError:
            gone.append(endpoint)
    return gone


_abandoned: list = []


def abandon(backend) -> None:
    """Keep a backend whose worker is gone referenced and never freed: freeing its buffers would send
    RPC commands to the dead worker, and ggml aborts on that."""
    _abandoned.append(backend)
    llm = getattr(backend, "llm", None)
    if llm is not None:
        compat.never_free(llm)
    backend.close = lambda: None
