"""What evaluating a batch of n tokens costs on this machine: timed once per model file (a calibration,
cached in the cache dir), then followed online by what the steps really take. The policy prices every
draft with these (policy.py); --reproducible uses fixed reference costs instead."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import Backend

# Batch sizes timed at calibration, and the only sizes the adaptive policy sends (see CostModel.measured):
# on a CPU llama.cpp's matrix kernels work on tiles of rows, so a batch of 16 can cost less than one of
# 15 or 17 (gemma-3-270m, 2 threads: 8 tokens 38 ms, 7 tokens 57 ms; 16 tokens 56 ms, 17 tokens 69 ms).
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
# The sizes up to this one are always timed; bigger ones only within CALIBRATION_BUDGET seconds, so the
# first run on a slow machine measures for a few seconds, not a minute (see CostModel.measure).
REQUIRED_SIZE = 8
CALIBRATION_BUDGET = 4.0
# Each size is timed twice and the faster timing kept: on a shared machine a timing is only ever slowed
# down (another process, a page fault), and one slow timing of a big batch decided every long draft. With
# one timing per big size, gemma-3-270m's per-token cost read 5.3 ms at 48 and 4.2 at 64 one day; timed
# 4 x 3 times it is 3.0-3.2 and 2.9, and falls steadily with the batch size. Entries timed otherwise
# (an older specchat's, without this version) are timed again.
CALIBRATION_REPS = 2
CALIBRATION_VERSION = 2


@dataclass
class CostModel:
    """Seconds to evaluate a batch of n tokens, from calibration points, times an online scale factor
    that follows what the machine is doing now (other load, a growing context), learned from one-token
    steps, and for batches of 2 or more a second factor learned from the batches actually sent: a
    calibration is a few timings at one moment of a noisy machine, and if its batches came out cheap
    relative to one token (25.8 ms for 8 on SmolLM2-135M, against 28-29 ms in the loop later) every
    marginal draft looks like a gain.

    `measured`: the costs are known only at `sizes` (a calibration), and a size in between may cost far
    more than the line between its neighbours (see CALIBRATION_SIZES), so `best_length` sends only
    batches of those sizes. A hand-made model (measured False) is a curve: every size may be sent."""

    sizes: list[int]
    seconds: list[float]
    scale: float = 1.0
    measured: bool = False
    batch: float = 1.0  # what batches of 2+ cost relative to calibration x scale, as observed

    def __post_init__(self) -> None:
        # base cost of every batch size up to 64, computed once: the policy asks for them every step
        n = np.arange(65, dtype=np.float64)
        table = np.interp(n, self.sizes, self.seconds)
        if len(self.sizes) > 1:  # past the last calibrated size, extend with the last slope
            slope = (self.seconds[-1] - self.seconds[-2]) / (self.sizes[-1] - self.sizes[-2])
            beyond = n > self.sizes[-1]
            table[beyond] = self.seconds[-1] + slope * (n[beyond] - self.sizes[-1])
        table[0] = 0.0
        self._table = table
        # batch sizes 0..64 best_length may send (0: no batch at all, never chosen)
        self._sendable = np.ones(65, dtype=bool)
        if self.measured:
            self._sendable[:] = False
            self._sendable[[n for n in self.sizes if n < 65]] = True
        # the same as Python lists: the policy reads a few entries every step, right after a decode,
        # when each numpy call costs several microseconds (see best_length)
        self._table_list: list[float] = table.tolist()
        self._sendable_list: list[bool] = self._sendable.tolist()
        self._timed = (self.sizes[0], min(self.sizes[-1], 64))  # where the table is the calibration's line

    def sendable(self, n_max: int) -> np.ndarray:
        """For batch sizes 0..n_max: may the policy send a batch of that size?"""
        if n_max < len(self._sendable):
            return self._sendable[: n_max + 1]
        beyond = not self.measured  # past the table: only an unmeasured curve extends
        return np.concatenate([self._sendable, np.full(n_max + 1 - len(self._sendable), beyond)])

    def __call__(self, n: int) -> float:
        if n <= 0:
            return 0.0
        base = self._table_list[n] if n < len(self._table_list) else self._extend(n)
        return base * self.scale * (self.batch if n > 1 else 1.0)

    def seconds_list(self, n_max: int) -> list[float]:
        """What `costs(n_max)` says, as a list: the policy reads these every step, right after a decode,
        when a Python list is cheaper than any numpy call."""
        if n_max >= len(self._table_list):
            return self.costs(n_max).tolist()
        one, batch = self.scale, self.scale * self.batch
        table = self._table_list
        return [0.0, table[1] * one] + [table[n] * batch for n in range(2, n_max + 1)] if n_max >= 1 else [0.0]

    def sendable_list(self, n_max: int) -> list[bool]:
        """What `sendable(n_max)` says, as a list."""
        if n_max >= len(self._sendable_list):
            return self.sendable(n_max).tolist()
        return self._sendable_list[: n_max + 1]

    def cheapest_batch(self, low: int, high: int) -> int | None:
        """The sendable batch size in low..high that costs the least per token (None if there is none)."""
        table, sendable = self.seconds_list(high), self.sendable_list(high)
        sizes = [n for n in range(max(low, 1), high + 1) if sendable[n]]
        return min(sizes, key=lambda n: table[n] / n) if sizes else None

    def costs(self, n_max: int) -> np.ndarray:
        """Seconds for batch sizes 0..n_max (index = size)."""
        if n_max < len(self._table):
            out = self._table[: n_max + 1] * self.scale
        else:
            out = np.array([self._extend(m) for m in range(n_max + 1)]) * self.scale
        out[2:] *= self.batch
        return out

    def _extend(self, n: int) -> float:
        if n < len(self._table):
            return float(self._table[n])
        slope = self._table[-1] - self._table[-2]
        return float(self._table[-1] + slope * (n - len(self._table) + 1))

    BATCH_WEIGHT = 0.2  # batches are rarer than single steps, and each says more about drafting

    def update(self, n: int, seconds: float, weight: float = 0.1) -> None:
        """Learn from one evaluation of n tokens: the machine's pace from single tokens, the batches'
        cost relative to it from batches."""
        low, high = self._timed
        # inside the calibrated range the table is that interpolation, already computed
        expected = self._table_list[n] if low <= n <= high else float(np.interp(n, self.sizes, self.seconds))
        if expected <= 0 or seconds <= 0:
            return
        if n == 1 or len(self.sizes) == 1:
            ratio = min(max(seconds / expected, 0.25), 4.0)  # one stall must not swing the model
            self.scale = (1 - weight) * self.scale + weight * ratio
        else:
            ratio = min(max(seconds / (expected * self.scale), 0.5), 2.0)
            self.batch = (1 - self.BATCH_WEIGHT) * self.batch + self.BATCH_WEIGHT * ratio

    @classmethod
    def measure(cls, backend, sizes: Sequence[int] = CALIBRATION_SIZES, reps: int = CALIBRATION_REPS,
                notify: Callable[[float], None] | None = None, budget: float | None = None) -> CostModel:
        """Time real evaluations of each batch size after what the cache holds, then roll them back.

        The sizes up to REQUIRED_SIZE are always timed; bigger ones only while the calibration has taken
        less than `budget` seconds (CALIBRATION_BUDGET): on a GPU every size takes milliseconds, on two CPU
        cores a batch of 64 can take half a second and long batches rarely pay there anyway. `notify`
        gets the estimated seconds of the whole calibration once the first timings are in, before the
        bulk of it (the chat shows "measuring this machine once (about N s)")."""
        budget = CALIBRATION_BUDGET if budget is None else budget
        keep = len(backend.tokens)
        if keep:
            backend.checkpoint()  # a recurrent model comes back to `keep` from its copy
        room = backend.n_ctx - keep
        sizes = [n for n in sizes if n <= room] or [1]
        filler = [backend.tokens[-1] if backend.tokens else 1]

        def timed(n: int) -> float:
            t0 = time.perf_counter()
            backend.eval(filler * n, range(n))
            elapsed = time.perf_counter() - t0
            backend.truncate(keep)
            return elapsed

        started = time.perf_counter()
        timed(1)  # warm-up: the first decode allocates compute buffers
        if notify is not None:
            one = timed(1)
            required = [n for n in sizes if n <= REQUIRED_SIZE]
            # a batch of n costs about 1 + 0.35 (n - 1) single steps on two CPU cores (SmolLM2, gemma-3-270m)
            estimate = sum(one * (1 + 0.35 * (n - 1)) * reps for n in required)
            notify(max(estimate, budget if len(required) < len(sizes) else 0.0))
        seconds = []
        measured = []
        for n in sizes:
            if n > REQUIRED_SIZE:
                # the next size's timings, predicted from the last one's: stop before the budget, not after
                predicted = seconds[-1] * n / measured[-1] * reps
                if time.perf_counter() - started + predicted > budget:
                    break
            seconds.append(min(timed(n) for _ in range(max(1, reps))))
            measured.append(n)
        # not made monotone: a bigger batch can really cost less (whole tiles; see CALIBRATION_SIZES)
        return cls(measured, seconds, measured=True)


def cost_cache_key(backend: Backend) -> str:
    path = Path(backend.path or backend.name)
    try:
        st = path.stat()
        ident = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    except OSError:
        ident = str(path)
    ident += f"|threads={backend.n_threads}|ngl={backend.n_gpu_layers}"
    ident += getattr(backend, "cost_tag", "")  # a drafting head on the target's own file ("|mtp")
    if backend.rpc:
        # layers on RPC workers cost round trips: calibrated per endpoint set
        ident += "|rpc=" + ",".join(sorted(backend.rpc))
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def cached_cost_model(backend, cache_file: Path | None,
                      notify: Callable[[str, float], None] | None = None) -> CostModel:
    """The backend's cost model from the cache file, measuring (a few seconds, once per model file and
    thread count) on a miss. `notify(model name, estimated seconds)` is called before a measurement.
    The cache file is replaced atomically: an interrupted run never leaves half a file."""
    key = cost_cache_key(backend)
    table = {}
    if cache_file is not None and cache_file.exists():
        try:
            table = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            table = {}
        if not isinstance(table, dict):
            table = {}
    entry = table.get(key)
    # an entry timed at other sizes (an older specchat), or short of the sizes every calibration times,
    # is measured again: the policy sends only the sizes it has timed
    sizes = entry.get("sizes") if isinstance(entry, dict) else None
    need = min(REQUIRED_SIZE, max(1, backend.n_ctx // 2))
    # one that stopped short of the last size under a smaller budget than today's is measured again too:
    # long lookup drafts are sent only at sizes that were timed
    complete = bool(sizes) and (sizes[-1] == CALIBRATION_SIZES[-1] or entry.get("budget", 0.0) >= CALIBRATION_BUDGET)
    current = isinstance(entry, dict) and entry.get("version") == CALIBRATION_VERSION  # timed as today's is
    if (sizes and current and sizes == list(CALIBRATION_SIZES[: len(sizes)]) and sizes[-1] >= need and complete
            and len(entry.get("seconds", ())) == len(sizes)):
        return CostModel(entry["sizes"], entry["seconds"], measured=True)
    model = CostModel.measure(backend, notify=(lambda s: notify(backend.name, s)) if notify is not None else None)
    if cache_file is not None:
        table[key] = {"name": backend.name, "sizes": model.sizes, "seconds": model.seconds, "measured": time.time(),
                      "budget": CALIBRATION_BUDGET, "version": CALIBRATION_VERSION}
        write_atomic(cache_file, json.dumps(table, indent=1))
    return model


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename it into place; a read-only cache only costs a re-measure
    (or the priors) next time, so failures are silent."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # another process reading never sees half a file
    except BaseException as e:  # OSError, or Ctrl-C in the middle: no temporary file left behind
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if not isinstance(e, OSError):
            raise



def reference_cost_model(one_step: float = 0.02) -> CostModel:
    """Fixed costs for --reproducible: a batch of n tokens costs 1 + 0.35 (n - 1) one-token steps (about
    what two CPU cores measure), at the sizes up to 16. No clock involved."""
    sizes = [n for n in CALIBRATION_SIZES if n <= 16]
    return CostModel(sizes, [one_step * (1 + 0.35 * (n - 1)) for n in sizes], measured=True)
