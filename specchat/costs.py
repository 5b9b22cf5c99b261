"""What evaluating a batch of n tokens costs on this machine: timed once per model file (a calibration,
cached in the cache dir), then followed online by what the steps really take. The policy prices every
draft with these (policy.py); --reproducible uses fixed reference costs instead.

The calibration is a prior, not the last word: it is a few timings at one moment, and taken while the
machine was busy it reads high for good, and every later run drafts too little (docs/decisions.md,
"Calibration is a prior"). Every verify a run times is kept per batch size (the
latest OBSERVED_WINDOW of them, saved back into the cache file when a generation ends: CostModel.save),
and the next process's costs combine the calibration with them (see combine); a calibration the
observations contradict is measured again at the next load (see verdict, STALE_RATIO)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .backend import Backend

# Batch sizes timed at calibration, and the only sizes the adaptive policy sends (see CostModel.measured):
# on a CPU llama.cpp's matrix kernels work on tiles of rows, so a batch of 16 can cost less than one of
# 15 or 17 (docs/decisions.md, "Batch sizes on a CPU").
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
# The sizes up to this one are always timed; bigger ones only within CALIBRATION_BUDGET seconds, so the
# first run on a slow machine measures for a few seconds, not a minute (see CostModel.measure).
REQUIRED_SIZE = 8
CALIBRATION_BUDGET = 4.0
# Each size is timed twice and the faster timing kept: on a shared machine a timing is only ever slowed
# down (another process, a page fault). Entries timed otherwise (an older version's) are timed again.
# How it was chosen: docs/benchmarks.md, "Tuning constants".
CALIBRATION_REPS = 2
CALIBRATION_VERSION = 2

# What a run observes. A timing is only ever slowed down by other load, so what a batch size costs, as
# observed, is the lower quartile of its latest OBSERVED_WINDOW timings (the calibration keeps the faster
# of two timings for the same reason): three in four of them can be stalls before it moves. Within one
# process CostModel.scale and .batch follow the current load; these are what the next process starts from.
OBSERVED_WINDOW = 64
OBSERVED_QUANTILE = 0.25
# The calibration counts as this many observations of each size: observations win as they accumulate.
PRIOR_WEIGHT = 8.0
# A calibration is contradicted (and measured again at the next load) when a size's observed cost is
# below STALE_RATIO of its calibrated cost over at least STALE_STEPS one-token steps, or STALE_BATCHES
# batches of one size: a run's step only ever costs more than the calibration's bare decode, so a clear
# shortfall means the calibration read high (taken while the machine was busy), and its batch-to-token
# ratio would keep drafts short. Redone at the next load, not between turns (the user is waiting); a redo
# keeps the faster reading of each size; at most MAX_REDOS in a row, then the observations alone decide.
# How it was chosen: docs/benchmarks.md, "Tuning constants".
STALE_RATIO = 0.95
STALE_STEPS = 32
STALE_BATCHES = 8
MAX_REDOS = 2


@dataclass
class CostModel:
    """Seconds to evaluate a batch of n tokens, from calibration points, times an online scale factor
    that follows what the machine is doing now (other load, a growing context), learned from one-token
    steps, and for batches of 2 or more a second factor learned from the batches actually sent: a
    calibration is a few timings at one moment of a noisy machine, and if its batches came out cheap
    relative to one token every marginal draft looks like a gain.

    `measured`: the costs are known only at `sizes` (a calibration), and a size in between may cost far
    more than the line between its neighbours (see CALIBRATION_SIZES), so `best_length` sends only
    batches of those sizes. A hand-made model (measured False) is a curve: every size may be sent.

    Read from the cache file (cached_cost_model), `seconds` are the calibration (`prior`) combined with
    what earlier runs observed, and every timing `update` gets is kept for `save` to write back (`cache`:
    the file and the entry's key)."""

    sizes: list[int]
    seconds: list[float]
    scale: float = 1.0
    measured: bool = False
    batch: float = 1.0  # what batches of 2+ cost relative to calibration x scale, as observed
    prior: list[float] | None = field(default=None, repr=False)  # the calibration alone, when combined
    cache: tuple[Path, str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # timings not yet saved, per batch size: only the timed sizes (those the file keeps)
        self._pending: dict[int, deque[float]] = {}
        self._observable = frozenset(self.sizes)
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
        if n == 1:
            return base * self.scale
        # a batch does at least one token's work: never priced below it (see seconds_list)
        return max(base * self.scale * self.batch, self._table_list[1] * self.scale)

    def seconds_list(self, n_max: int) -> list[float]:
        """What `costs(n_max)` says, as a list: the policy reads these every step, right after a decode,
        when a Python list is cheaper than any numpy call."""
        if n_max >= len(self._table_list):
            return self.costs(n_max).tolist()
        if n_max < 1:
            return [0.0]
        batch = self.scale * self.batch
        table = self._table_list
        # A batch costs at least what one token does. Timings can say otherwise (a cheap calibration of 2
        # against one-token steps observed on a busy machine, a batch factor learned low): priced below one
        # token, a one-token draft would look cheaper than no draft whatever its acceptance, and be sent
        # every step.
        one = table[1] * self.scale
        return [0.0, one] + [max(table[n] * batch, one) for n in range(2, n_max + 1)]

    def sendable_list(self, n_max: int) -> list[bool]:
        """What `sendable(n_max)` says, as a list."""
        if n_max >= len(self._sendable_list):
            return self.sendable(n_max).tolist()
        return self._sendable_list[: n_max + 1]

    def costs(self, n_max: int) -> np.ndarray:
        """Seconds for batch sizes 0..n_max (index = size)."""
        if n_max < len(self._table):
            out = self._table[: n_max + 1] * self.scale
        else:
            out = np.array([self._extend(m) for m in range(n_max + 1)]) * self.scale
        out[2:] = np.maximum(out[2:] * self.batch, out[1] if n_max >= 1 else 0.0)
        return out

    def _extend(self, n: int) -> float:
        if n < len(self._table):
            return float(self._table[n])
        slope = self._table[-1] - self._table[-2]
        return float(self._table[-1] + slope * (n - len(self._table) + 1))

    BATCH_WEIGHT = 0.2  # batches are rarer than single steps, and each says more about drafting

    def update(self, n: int, seconds: float, weight: float = 0.1) -> None:
        """Learn from one evaluation of n tokens: the machine's pace from single tokens, the batches'
        cost relative to it from batches. A model read from the cache file also keeps the timing for
        `save` (the next process's costs start from them)."""
        if self.cache is not None and seconds > 0 and n in self._observable:
            pending = self._pending.get(n)
            if pending is None:
                pending = self._pending[n] = deque(maxlen=OBSERVED_WINDOW)
            pending.append(seconds)
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

    def save(self, *others: CostModel | None) -> None:
        """Write the timings this model, and each of `others` (the draft's cost; None is skipped),
        observed since the last save into the cache entries they were read from, in one atomic
        replacement per file: the next process starts from them (see combine). A model not read from a
        cache file (--reproducible's fixed costs, a hand-made one) or that observed nothing (a policy
        that learns no costs) writes nothing."""
        due: dict[Path, list[CostModel]] = {}
        for model in (self, *others):
            if model is None or model.cache is None or not model._pending:
                continue
            group = due.setdefault(model.cache[0], [])
            if all(model is not m for m in group):
                group.append(model)
        for path, models in due.items():
            table = read_table(path)
            if any([model._merge_into(table) for model in models]):  # (a list: every model's merged)
                write_atomic(path, json.dumps(table, indent=1))

    def _merge_into(self, table: dict) -> bool:
        pending, self._pending = self._pending, {}
        entry = table.get(self.cache[1])
        if not isinstance(entry, dict) or not isinstance(entry.get("sizes"), list):
            return False  # the entry is gone (the cache was cleared): the next run measures again
        observed = observations(entry)
        for n, values in pending.items():
            observed[n] = (observed.get(n, []) + [round(v, 7) for v in values])[-OBSERVED_WINDOW:]
        entry["observed"] = {str(n): values for n, values in sorted(observed.items())}
        if entry.get("redone") and verdict(entry) is False:
            del entry["redone"]  # the last redo holds: a later contradiction may be redone again
        return True

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
    if getattr(backend, "flash_attn_used", None) == "off":  # another attention kernel, other costs
        ident += "|fa=off"
    ident += getattr(backend, "cost_tag", "")  # a drafting head on the target's own file ("|mtp")
    if backend.rpc:
        # layers on RPC workers cost round trips: calibrated per endpoint set
        ident += "|rpc=" + ",".join(sorted(backend.rpc))
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def read_table(cache_file: Path) -> dict:
    """The cost cache file's entries by key ({} for a missing, unreadable or foreign file)."""
    try:
        table = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def observations(entry: dict) -> dict[int, list[float]]:
    """An entry's observed timings per batch size (what CostModel.save wrote); anything malformed is
    left out."""
    saved = entry.get("observed")
    out: dict[int, list[float]] = {}
    if not isinstance(saved, dict):
        return out
    for size, values in saved.items():
        try:
            n = int(size)
        except (TypeError, ValueError):
            continue
        if n < 1 or not isinstance(values, list):
            continue
        good = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
        if good:
            out[n] = good[-OBSERVED_WINDOW:]
    return out


def observed_cost(values: Sequence[float]) -> float:
    """What a batch size costs, from its observed timings: their lower quartile (see OBSERVED_QUANTILE)."""
    return float(np.quantile(values, OBSERVED_QUANTILE))


def combine(sizes: Sequence[int], seconds: Sequence[float], observed: dict[int, list[float]]) -> list[float]:
    """The costs a process starts from: the calibration (`seconds` at `sizes`) moved toward what runs
    observed. In logs, for each size n with m_n observations, x_n = log(observed cost / calibrated cost),
    weighted w_n = m_n / (m_n + PRIOR_WEIGHT). The one-token steps, which every run times, give the
    machine's pace p = w_1 x_1, and every size moves with it: a calibration under load read them all high.
    How much more the batches are off, y_n = x_n - p, is pooled over the batch sizes sent into b (shrunk
    toward 0 by PRIOR_WEIGHT) for the sizes never sent, and each size sent goes its own way as its
    observations accumulate:

        log cost_n = log calibrated_n + p + b + w_n (y_n - b)    (n >= 2; for n = 1: + p)

    A busy calibration's batches, which the policy then sends rarely, come down with the one-token pace
    at once; what is left of their error (the batch/one-token ratio it read) comes down with each batch
    sent, and with a redo (see STALE_RATIO)."""
    calibrated = dict(zip(sizes, seconds))
    x = {n: math.log(observed_cost(v) / calibrated[n]) for n, v in observed.items()
         if n in calibrated and calibrated[n] > 0}
    if not x:
        return list(seconds)
    count = {n: len(observed[n]) for n in x}
    weight = {n: m / (m + PRIOR_WEIGHT) for n, m in count.items()}
    pace = weight[1] * x[1] if 1 in x else 0.0
    batch_sizes = [n for n in x if n >= 2]
    pooled = (sum(count[n] * (x[n] - pace) for n in batch_sizes)
              / (sum(count[n] for n in batch_sizes) + PRIOR_WEIGHT)) if batch_sizes else 0.0
    out = []
    for n, c in zip(sizes, seconds):
        if n == 1:
            delta = pace
        else:
            own = weight[n] * (x[n] - pace - pooled) if n in x else 0.0
            delta = pace + pooled + own
        out.append(c * math.exp(delta))
    return out


def verdict(entry: dict) -> bool | None:
    """Whether the observations contradict the entry's calibration (True: measure it again; see
    STALE_RATIO), hold it (False), or are too few to say (None)."""
    calibrated = dict(zip(entry.get("sizes", ()), entry.get("seconds", ())))
    judged = False
    for n, values in observations(entry).items():
        if n not in calibrated or len(values) < (STALE_STEPS if n == 1 else STALE_BATCHES):
            continue
        judged = True
        if observed_cost(values) < STALE_RATIO * calibrated[n]:
            return True
    return False if judged else None


def _from_entry(entry: dict, cache_file: Path | None, key: str) -> CostModel:
    sizes, seconds = list(entry["sizes"]), list(entry["seconds"])
    return CostModel(sizes, combine(sizes, seconds, observations(entry)), measured=True, prior=seconds,
                     cache=(cache_file, key) if cache_file is not None else None)


def _calibration(backend, model: CostModel) -> dict:
    return {"name": backend.name, "sizes": model.sizes, "seconds": model.seconds, "measured": time.time(),
            "budget": CALIBRATION_BUDGET, "version": CALIBRATION_VERSION}


# why a saved calibration is measured again (the notice before it says so; a first one has no reason)
AGAIN_CONTRADICTED = "runs here have been faster than its saved costs"
AGAIN_OUTDATED = "its saved costs were timed by another version of specchat"
AGAIN_ASKED = "as asked (--recalibrate)"


def cached_cost_model(backend, cache_file: Path | None,
                      notify: Callable[[str, float, str], None] | None = None) -> CostModel:
    """The backend's cost model from the cache file, measuring (a few seconds, once per model file and
    thread count) on a miss, or again when what runs observed contradicts the calibration (see
    STALE_RATIO). `notify(model name, estimated seconds, again)` is called before a measurement, `again`
    '' for the first one, else why the saved one is measured again (AGAIN_*).
    The cache file is replaced atomically: an interrupted run never leaves half a file."""
    key = cost_cache_key(backend)
    table = read_table(cache_file) if cache_file is not None and cache_file.exists() else {}
    entry = table.get(key)
    # an entry timed at other sizes (an older specchat), or short of the sizes every calibration times,
    # is measured again: the policy sends only the sizes it has timed
    sizes = entry.get("sizes") if isinstance(entry, dict) else None
    need = min(REQUIRED_SIZE, max(1, backend.n_ctx // 2))
    # one that stopped short of the last size under a smaller budget than today's is measured again too:
    # long lookup drafts are sent only at sizes that were timed
    complete = bool(sizes) and (sizes[-1] == CALIBRATION_SIZES[-1] or entry.get("budget", 0.0) >= CALIBRATION_BUDGET)
    current = isinstance(entry, dict) and entry.get("version") == CALIBRATION_VERSION  # timed as today's is
    usable = bool(sizes and current and sizes == list(CALIBRATION_SIZES[: len(sizes)]) and sizes[-1] >= need
                  and complete and len(entry.get("seconds", ())) == len(sizes))
    redone = entry.get("redone", 0) if usable else 0
    redo = usable and verdict(entry) is True and isinstance(redone, int) and redone < MAX_REDOS
    if usable and not redo:
        return _from_entry(entry, cache_file, key)
    again = AGAIN_CONTRADICTED if redo else AGAIN_OUTDATED if isinstance(entry, dict) else ""
    model = CostModel.measure(backend, notify=(lambda s: notify(backend.name, s, again)) if notify is not None else None)
    if cache_file is None:
        return model
    fresh = _calibration(backend, model)
    if redo:
        # contradicted (see STALE_RATIO): of each size the faster reading, the old or the new one, and
        # the observations kept, so a redo on a busy machine again loses nothing
        old = dict(zip(sizes, entry["seconds"]))
        merged = dict(old)
        merged.update({n: min(s, old.get(n, s)) for n, s in zip(model.sizes, model.seconds)})
        longer = sizes if len(sizes) > len(model.sizes) else model.sizes
        fresh["sizes"], fresh["seconds"] = list(longer), [merged[n] for n in longer]
        fresh["observed"] = {str(n): v for n, v in sorted(observations(entry).items())}
        fresh["redone"] = redone + 1
    table[key] = fresh
    write_atomic(cache_file, json.dumps(table, indent=1))
    return _from_entry(fresh, cache_file, key)


def recalibrate(backend, cache_file: Path, notify: Callable[[str, float, str], None] | None = None) -> CostModel:
    """Measure the backend again and replace its cache entry, what runs observed included: a fresh
    start (`specchat report --recalibrate`)."""
    key = cost_cache_key(backend)
    model = CostModel.measure(backend, notify=(lambda s: notify(backend.name, s, AGAIN_ASKED)) if notify is not None else None)
    table = read_table(cache_file)
    table[key] = _calibration(backend, model)
    write_atomic(cache_file, json.dumps(table, indent=1))
    return _from_entry(table[key], cache_file, key)


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
