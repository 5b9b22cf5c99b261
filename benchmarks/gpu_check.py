"""The GPU check in one command: build llama.cpp, write real-shaped models, print every speed ratio.

    python3 benchmarks/gpu_check.py --dry-run   # here: prepare what travels, print it, the command and its time
    python3 benchmarks/gpu_check.py             # on the lent GPU machine, from the repository root
    python3 benchmarks/gpu_check.py --cpu       # here: the same pipeline on the CPU (2 threads, smaller shapes)
    python3 benchmarks/gpu_check.py --configure-only  # here, and in the test suite: cmake's configure step of the
                                                # trimmed tree with the GPU build's flags (seconds, nothing built)

What it does, in one process tree:
1. build: the vendored llama.cpp of llama-cpp-python (carried as a trimmed tarball) with cmake + ninja, shared
   libs, on the GPU `-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90`: libllama, llama-bench and
   llama-speculative-simple from the same tree (benchmarks/harness.build). specchat loads that libllama
   through llama-cpp-python's LLAMA_CPP_LIB_PATH (its pure-Python part travels too), so both sides run the
   very same kernels. The build time is printed. Where the CUDA toolkit has only nvcc and the runtime (this
   project's CUDA image assembles it from pip wheels), cuBLAS comes from PyTorch's nvidia-cublas wheel.
   Build and models stay in .gpu-check/gpu (ignored), so a second command on the warm machine reuses them.
2. models, written while the build runs (benchmarks/gpu_models.py): a Qwen2.5-1.5B-shaped target, a
   0.5B-shaped draft (same tokenizer) and a qwen35 hybrid with an MTP block, random weights built like
   tests/tiny_models.py's so that drafts are mostly accepted (the acceptance is printed beside each figure).
3. tables, each printed as one table (and saved under $OUT, else the folder it prints):
   plain    specchat --no-spec vs llama-bench tg (temp 0 and 0.8)
   verify   one eval of k = 1 .. 32 tokens, ms (target, draft, hybrid)
   draft    draft model at k = 4 and with the policy vs llama-speculative-simple --spec-type draft-simple
   mtp      the hybrid's MTP layer vs --spec-type draft-mtp
   lookup   prompt lookup vs --spec-type ngram-simple
   host     ms per step outside llama_decode (target-only, lookup, draft model) vs the decode's ms per step
   ckpt     the hybrid's recurrent state: snapshots, checkpoint copies in host memory, and copies kept on the
            device (LLAMA_STATE_SEQ_FLAGS_ON_DEVICE)
The tables run in that order within --budget seconds: one that would not finish in time is skipped, and
said so, so a 10-minute command limit still brings back every table done before it.

Greedy runs use --ignore-eos and the models' own text as the prompt (64 tokens of the bigram cycle). The
figures are medians of --reps processes. specchat is driven through its CLI (`prompt --json`) where it
can be, and in-process through specchat.backend.LlamaCppBackend (eval, truncate, rollback_seconds,
rollback_recoveries, memory), specchat.engine.generate, specchat.policy.FixedPolicy, specchat.loader and
specchat.SamplingParams (see the `--child` parts; harness.host_run for the host table). The copies
kept on the device are specchat's own checkpoint path with its state flags (specchat.backend.STATE_PARTIAL)
set to PARTIAL_ONLY | ON_DEVICE in that child process: specchat has no option for it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT))  # run as a script: the benchmark tool's package

from benchmarks import harness  # noqa: E402
from benchmarks.harness import median, rate  # noqa: E402
CARRY = ROOT / ".gpu-check" / "carry"  # the ignored folder that travels with the GPU command
LOCAL = ROOT / ".gpu-check"  # everything else of this script here (sdist, CPU build, CPU models), ignored
CARRY_LIMIT_MIB = 64
COMMAND = "python3 benchmarks/gpu_check.py"

# what the GPU machine lacks for specchat and llama-cpp-python (its image has numpy, rich's dependencies,
# jinja2, huggingface-hub, matplotlib, pyyaml, tqdm): carried as wheels, at the versions installed here
WHEELS = ("typer", "annotated-doc", "rich", "prompt-toolkit", "wcwidth", "diskcache", "pydantic", "pydantic-core",
          "annotated-types", "typing-inspection", "typing-extensions")
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# the vendored llama.cpp, trimmed to what the three targets need (25 MB of sources, ~4 MB as .tar.xz)
SOURCE_TOP = {"CMakeLists.txt", "LICENSE", "cmake", "common", "examples", "ggml", "gguf-py", "include", "licenses",
              "pocs", "src", "tools", "vendor", "app"}
SOURCE_DROP = ("tools/ui/", "tools/server/public/", "tools/server/webui/")
BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-blas", "ggml-rpc"}
TARGETS = ("llama-speculative-simple", "llama-bench", "llama")
# LLAMA_BUILD_SERVER=OFF: the server's CMakeLists add tools/ui, which the trimmed tree drops (SOURCE_DROP), and
# no table needs a server; `--configure-only` (run by the test suite) configures the trimmed tree with these
CMAKE_COMMON = ("-G", "Ninja", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF",
                "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF")
CMAKE_CUDA = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90")

PARTS = ("plain", "verify", "draft", "mtp", "lookup", "host", "ckpt")
# rough seconds of each part on the GPU machine at -n 128: (once, per rep); ~4 s a process (Python, CUDA, the
# model from the page cache) and a second or two of decoding. Not measured yet: the first GPU run's
# "(part: N s)" lines are what to put here.
PART_SECONDS = {"plain": (10, 12), "verify": (20, 0), "draft": (5, 20), "mtp": (5, 20), "lookup": (5, 15),
                "host": (40, 0), "ckpt": (30, 0)}
BUILD_SECONDS_GPU = 300  # ggml-cuda for one architecture (no FA variants for all quant types) on 16 cores
MODEL_SECONDS_GPU = 60  # the three models, in parallel with the build
VERIFY_K = (1, 2, 4, 8, 16, 32)


def part_seconds(part: str, reps: int) -> int:
    once, per_rep = PART_SECONDS[part]
    return once + per_rep * reps


class Usage(Exception):
    """A bad option value: one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown option, -n abc) as one line too, not usage + message."""

    def error(self, message: str):
        raise Usage(message)


# --------------------------------------------------------------------------------------------- output


class Report:
    """Prints and keeps every line in OUT/gpu-check.txt; figures go to OUT/results.json as they come."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.text = (out / "gpu-check.txt").open("w")
        self.results: dict = {}

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.text.write(line + "\n")
        self.text.flush()

    def keep(self, key: str, value) -> None:
        self.results[key] = value
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))


# --------------------------------------------------------------------------------------------- prepare (here)


def _keep_source(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] not in SOURCE_TOP or any(rel.startswith(d) for d in SOURCE_DROP):
        return False
    # ggml's other backends (Vulkan, SYCL, Metal, ...): only added to the build when switched on
    return not (parts[:2] == ["ggml", "src"] and len(parts) > 3 and parts[2].startswith("ggml-")
                and parts[2] not in BACKENDS)


def prepare_source(log=print) -> str:
    """The trimmed llama.cpp source and llama-cpp-python's pure-Python part (with its version metadata) in
    .gpu-check/carry, from the sdist; kept where they are there already. Returns the version."""
    version = harness.llama_cpp_version()
    CARRY.mkdir(parents=True, exist_ok=True)
    source = CARRY / "llama.cpp.tar.xz"
    python = CARRY / "python"
    if not source.exists() or not (python / "llama_cpp").exists():
        sdist = harness.sdist(LOCAL / "sdist")  # downloaded once, never carried
        log(f"prepare: trimming {sdist.name} into {_shown(source)} and {_shown(python)}/")
        top = f"llama_cpp_python-{version}/"
        tmp = source.with_suffix(".tmp")
        with tarfile.open(sdist) as tar, tarfile.open(tmp, "w:xz") as out:
            for member in tar:
                if not member.isfile():
                    continue
                name = member.name[len(top):] if member.name.startswith(top) else None
                if name and name.startswith("vendor/llama.cpp/") and _keep_source(name[len("vendor/llama.cpp/"):]):
                    # a new entry: the sdist's own keeps a long path in its pax header, which would win over
                    # a renamed .name; same size, mode and mtime (a re-extraction rebuilds nothing)
                    entry = tarfile.TarInfo("llama.cpp/" + name[len("vendor/llama.cpp/"):])
                    entry.size, entry.mode, entry.mtime = member.size, member.mode, member.mtime
                    out.addfile(entry, tar.extractfile(member))
                elif name and name.startswith("llama_cpp/") and not name.startswith("llama_cpp/server/"):
                    target = python / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
        tmp.rename(source)
        info = python / f"llama_cpp_python-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n")
    return version


def prepare(log=print) -> dict:
    """Fill .gpu-check/carry (the trimmed llama.cpp source, llama-cpp-python's pure-Python part with its version
    metadata, the wheels, the tokenizer) from this machine; what is there already is kept."""
    version = prepare_source(log)
    wheels = CARRY / "wheels"
    wanted = {name: importlib.metadata.version(name) for name in WHEELS}
    have = {p.name.split("-")[0].lower().replace("_", "-") for p in wheels.glob("*.whl")}
    missing = [f"{n}=={v}" for n, v in wanted.items() if n.lower() not in have]
    if missing:
        log(f"prepare: downloading {len(missing)} wheels for Python 3.12 manylinux into {_shown(wheels)}/")
        plat = [x for p in WHEEL_PLATFORMS for x in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(wheels), *missing],
                       check=True)
    tokenizer = CARRY / "tokenizer.gguf"
    if not tokenizer.exists():
        sys.path.insert(0, str(BENCH))
        import gpu_models

        gpu_models.write_tokenizer(tokenizer)
    manifest = {"llama_cpp_python": version, "wheels": wanted}
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _shown(path: Path) -> str:
    """A path relative to the repository root where it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes() -> int:
    """The working tree that travels with every command (tracked and untracked, not ignored)."""
    try:
        names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                               capture_output=True, text=True, check=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the project's own folders
        names = [str(p.relative_to(ROOT)) for top in ("specchat", "benchmarks", "tests", "docs")
                 for p in (ROOT / top).rglob("*") if "__pycache__" not in p.parts]
        names += [p.name for p in ROOT.iterdir() if p.is_file()]
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def dry_run(a) -> None:
    manifest = prepare()
    mib = 2**20
    rows = [
        ("llama.cpp.tar.xz", f"vendored llama.cpp of llama-cpp-python {manifest['llama_cpp_python']}, trimmed "
                             "(no docs, models, tests, web UI, other GPU backends)"),
        ("python/", "llama-cpp-python's pure-Python part (+ its version metadata); libllama comes from the build"),
        ("wheels/", ", ".join(f"{k} {v}" for k, v in manifest["wheels"].items())),
        ("tokenizer.gguf", "SmolLM2's tokenizer keys, for the models written there"),
        ("manifest.json", "versions"),
    ]
    carry_bytes = _size(CARRY)
    tree = tree_bytes()
    print(f"carried: {_shown(CARRY)}/ (ignored), {carry_bytes / mib:.1f} MiB")
    for name, what in rows:
        print(f"  {name:<18}{_size(CARRY / name) / mib:6.1f} MiB  {what}")
    total = (carry_bytes + tree) / mib
    print(f"  + the working tree (specchat, benchmarks, tests, docs): {tree / mib:.1f} MiB")
    print(f"total {total:.1f} MiB of {CARRY_LIMIT_MIB} MiB" + ("" if total < CARRY_LIMIT_MIB else "  <- OVER THE LIMIT"))
    print(f"\nthe one command (repository root of the GPU machine): {COMMAND}")
    print(f"device tool call: run(command={COMMAND!r}, carry=[{_shown(CARRY)!r}], timeout_s=600)")
    tables = sum(part_seconds(p, a.reps) for p in a.parts)
    print(f"\nestimated time: build ~{BUILD_SECONDS_GPU // 60} min (models written alongside, ~{MODEL_SECONDS_GPU} s), "
          f"tables ~{tables / 60:.1f} min at --reps {a.reps} ({', '.join(f'{p} {part_seconds(p, a.reps)} s' for p in a.parts)}), "
          f"~{(BUILD_SECONDS_GPU + tables) / 60:.1f} min in all; --budget {a.budget:.0f} s skips what would not fit, "
          "and a rerun on the still-warm machine reuses the build and the models")
    sys.exit(0 if total < CARRY_LIMIT_MIB else 1)


# --------------------------------------------------------------------------------------------- setup (there)


class Setup:
    """Paths and environment of one check: build, models, the Python path of every specchat process."""

    def __init__(self, a):
        self.cpu = a.cpu
        self.work = a.work
        self.ngl = "0" if a.cpu else "99"
        self.threads = a.threads
        self.n = a.n
        self.reps = a.reps
        self.bin = self.work / "build" / "bin"
        self.models = self.work / "models"
        self.site = self.work / "site"
        self.home = self.work / "home"  # SPECCHAT_HOME: cost tables and estimates shared by this check's runs

    def python_path(self) -> list[str]:
        paths = [] if self.cpu else [str(self.site)]
        return paths + [str(CARRY / "python"), str(ROOT), str(self.work / "llama.cpp" / "gguf-py")]

    def env(self) -> dict:
        return {**os.environ, "PYTHONPATH": os.pathsep.join(self.python_path()), "LLAMA_CPP_LIB_PATH": str(self.bin),
                "SPECCHAT_HOME": str(self.home), "SPECCHAT_TOKENIZER_GGUF": str(CARRY / "tokenizer.gguf"),
                "NO_COLOR": "1"}

    def enter(self) -> None:
        """This process uses the same Python path and libllama as its children."""
        os.environ.update({k: v for k, v in self.env().items() if k != "PYTHONPATH"})
        for p in reversed(self.python_path()):
            sys.path.insert(0, p)
        sys.path.insert(0, str(BENCH))
        sys.path.insert(0, str(ROOT / "tests"))

    def gpu(self) -> list[str]:
        """llama.cpp tool arguments that put every layer of both models on the GPU (0 with --cpu), last."""
        return ["-ngl", self.ngl, "-ngld", self.ngl, "-t", str(self.threads), "-td", str(self.threads)]


def install_wheels(s: Setup, report: Report) -> None:
    wheels = sorted((CARRY / "wheels").glob("*.whl"))
    if s.cpu or (s.site / ".done").exists():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(s.site), *map(str, wheels)], check=True)
    (s.site / ".done").write_text("")
    report(f"installed {len(wheels)} wheels into {s.site}")


def extract_source(s: Setup) -> None:
    if not (s.work / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(CARRY / "llama.cpp.tar.xz") as tar:
            tar.extractall(s.work, filter="data")


def _link(links: Path, name: str, target: Path) -> Path:
    """An unversioned name (libX.so, what the linker asks for) for a versioned library."""
    links.mkdir(parents=True, exist_ok=True)
    link = links / name
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)
    return link


def cuda_args(s: Setup, report: Report, placeholder: bool = False) -> tuple[str, ...]:
    """What ggml-cuda links besides the runtime, where the CUDA toolkit lacks it (an image that assembles CUDA
    from pip wheels, as this project's do: nvcc and the runtime only):
    - cuBLAS: the nvidia-cublas wheel PyTorch installed (nvidia/cu13 or nvidia/cublas in this Python's
      site-packages): its headers, and its libraries behind unversioned links in WORK/cuda-links, which the
      build's RPATH then points at;
    - the driver library (for the VMM memory pool): the driver's libcuda.so.1 where the loader knows it,
      else -DGGML_CUDA_NO_VMM=ON (the pool of plain cudaMalloc blocks).
    `placeholder` (configure only, nothing linked): where no cuBLAS is found, empty files stand in for its
    libraries, passed the same way, so that cmake's configure step runs as it will there."""
    links = s.work / "cuda-links"
    args: list[str] = []
    nvcc = shutil.which("nvcc")
    roots = [r for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if r]
    roots += [str(Path(nvcc).resolve().parent.parent)] if nvcc else []
    if not any((Path(r) / "include" / "cublas_v2.h").exists() for r in roots):
        found = [(Path(e) / sub) for e in sys.path for sub in ("nvidia/cu13", "nvidia/cublas", "nvidia/cu12")
                 if (Path(e) / sub / "include" / "cublas_v2.h").exists() and list((Path(e) / sub / "lib").glob("libcublas.so.*"))]
        if not found and placeholder:
            links.mkdir(parents=True, exist_ok=True)
            for name in ("cublas", "cublasLt"):
                stand_in = links / f"lib{name}.so"
                stand_in.unlink(missing_ok=True)
                stand_in.write_bytes(b"")
                args.append(f"-DCUDA_{name}_LIBRARY={stand_in}")
            report("cuBLAS: none here; empty stand-ins for its libraries (configure links nothing; the GPU machine "
                   "takes PyTorch's nvidia-cublas)")
        elif not found:
            report("cuBLAS: in neither the CUDA toolkit nor this Python's nvidia packages; the build will fail")
        else:
            include, lib = found[0] / "include", found[0] / "lib"
            args += [f"-DCMAKE_CUDA_FLAGS=-I{include}", f"-DCMAKE_CXX_FLAGS=-I{include}"]
            for name in ("cublas", "cublasLt"):
                target = sorted(lib.glob(f"lib{name}.so.*"))[0]
                args.append(f"-DCUDA_{name}_LIBRARY={_link(links, f'lib{name}.so', target)}")
            report(f"cuBLAS: not in the CUDA toolkit; using {found[0]} (pip's nvidia-cublas)")
    if not any(list(Path(r).glob("lib*/libcuda.so")) + list(Path(r).glob("lib*/stubs/libcuda.so")) for r in roots):
        ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout if shutil.which("ldconfig") else ""
        driver = [line.split("=>")[-1].strip() for line in ldconfig.splitlines() if "libcuda.so.1 " in line]
        driver += [str(p) for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
                                    "/usr/lib64") for p in Path(d).glob("libcuda.so.1")]
        if driver:
            args.append(f"-DCUDA_cuda_driver_LIBRARY={_link(links, 'libcuda.so', Path(driver[0]))}")
            report(f"CUDA driver library: {driver[0]}")
        else:
            args.append("-DGGML_CUDA_NO_VMM=ON")
            report("CUDA driver library: none found; building with -DGGML_CUDA_NO_VMM=ON")
    return tuple(args)


def cmake_args(s: Setup, report: Report, placeholder: bool = False) -> tuple[str, ...]:
    """This check's cmake flags (after harness.CMAKE_BASE): the CUDA backend's too unless --cpu."""
    return CMAKE_COMMON + (() if s.cpu else CMAKE_CUDA + cuda_args(s, report, placeholder))


def build(s: Setup, a, report: Report) -> float:
    """harness.build into WORK/build with this check's flags; seconds taken (0 when it was there)."""
    cmake_args_ = cmake_args(s, report)
    start = time.perf_counter()
    log = s.work / "build.log"
    with output_to(log):  # cmake's output goes to the log, not between the tables
        harness.build(a.jobs, TARGETS[0], "build", cmake_args_, work=s.work, also=TARGETS[1:])
    seconds = time.perf_counter() - start
    report(f"build: {'reused' if seconds < 5 else f'{seconds:.0f} s'} ({' '.join(cmake_args_)}, -j{a.jobs}; "
           f"log {log})")
    report.keep("build_seconds", round(seconds, 1))
    return seconds


def start_models(s: Setup) -> subprocess.Popen | None:
    if (s.models / "models.json").exists():
        return None
    s.models.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(BENCH / "gpu_models.py"), str(s.models), "--preset",
                             "cpu" if s.cpu else "gpu"], env=s.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def device_line(s: Setup) -> str:
    if s.cpu:
        return f"CPU: {harness.machine()} (--cpu)"
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        return "GPU: " + out.stdout.strip()
    return "GPU: (no nvidia-smi)"


def configure_check(a) -> int:
    """cmake's configure step on the carried, trimmed tree with the flags `build` gives it (seconds, no
    compiling): a tree trimmed too far, or a flag that no longer fits the vendored CMakeLists, fails here and
    not on a GPU machine lent once. Without --cpu the CUDA backend is configured too where nvcc exists (cuBLAS
    stood in for where it is missing, see cuda_args); where it does not (cmake's CUDA language check needs the
    toolkit) the CUDA flags are left out, and the files that backend builds from must be in the tree.
    Returns the exit status."""
    prepare_source()
    s = Setup(a)
    report = Report(a.out)
    extract_source(s)
    cuda = not s.cpu and shutil.which("nvcc") is not None
    if not s.cpu and not cuda:
        s.cpu = True  # the same flags less CMAKE_CUDA and cuda_args
        missing = [d for d in ("ggml/src/ggml-cuda/CMakeLists.txt", "ggml/src/ggml-cuda/ggml-cuda.cu")
                   if not (s.work / "llama.cpp" / d).exists()]
        if missing:
            report(f"configure: FAILED: the trimmed tree lacks {', '.join(missing)}, which the CUDA build needs")
            return 1
        report("configure: no nvcc here, so the CUDA backend's flags are left out (its sources are in the tree)")
    flags = cmake_args(s, report, placeholder=True)
    variant = "configure-check"
    shutil.rmtree(s.work / variant, ignore_errors=True)  # a fresh cache: configure every time, from nothing
    done = harness.configure(s.work, variant, flags, capture=True)
    if done.returncode != 0:
        report(f"configure: FAILED (cmake exit {done.returncode}) with {' '.join(harness.CMAKE_BASE + flags)}:\n"
               f"{(done.stdout + done.stderr)[-3000:]}")
        return 1
    report(f"configure: ok, the trimmed tree ({_shown(CARRY / 'llama.cpp.tar.xz')}) with {' '.join(harness.CMAKE_BASE + flags)}")
    return 0


# --------------------------------------------------------------------------------------------- the runs


@contextlib.contextmanager
def output_to(log: Path):
    """The process's own stdout and stderr (file descriptors, so child processes and C libraries too) into
    `log` for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with log.open("a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def own_text(s: Setup) -> str:
    with output_to(s.work / "llama.log"):  # llama.cpp's load messages
        return harness.own_text(s.models / "target.gguf", 64)


def specchat(s: Setup, model: Path, prompt: str, extra: list[str], temp: float = 0.0) -> dict:
    """One `specchat prompt --json` run (harness.run_specchat) with every layer on the GPU."""
    return harness.run_specchat(str(model), prompt, n=s.n, threads=s.threads, env=s.env(), ctx=2048,
                        extra=[*extra, "-ngl", s.ngl, "-ngld", s.ngl, "--temp", str(temp), "--seed", "1"])


def child(s: Setup, name: str, *args: str) -> dict:
    """This script's `--child NAME` in a process of its own; its last stdout line is JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--work", str(s.work), "-n", str(s.n),
           "-t", str(s.threads), *(["--cpu"] if s.cpu else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=s.env(), cwd=ROOT, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"--child {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def part_plain(s: Setup, r: Report, prompt: str) -> None:
    r(f"## plain decoding: specchat --no-spec vs llama-bench tg{s.n} (target, {s.n} tokens, median of {s.reps})")
    r(f"{'model':<26}{'llama-bench':>12}{'temp 0':>10}{'ratio':>7}{'temp 0.8':>10}{'ratio':>7}")
    for role in ("target", "hybrid"):
        model = s.models / f"{role}.gguf"
        bench = harness.llama_bench(s.bin / "llama-bench", model, s.n, s.threads, ngl=int(s.ngl), reps=max(2, s.reps))
        ours = {t: median([specchat(s, model, prompt, ["--no-spec"], t)["tps"] for _ in range(s.reps)])
                for t in (0.0, 0.8)}
        r(f"{role + ' (' + MODEL_NAMES[role] + ')':<26}{bench:>12.1f}{ours[0.0]:>10.1f}{ours[0.0] / bench:>6.2f}x"
          f"{ours[0.8]:>10.1f}{ours[0.8] / bench:>6.2f}x")
        r.keep(f"plain.{role}", {"llama_bench_tps": bench, "specchat_tps": ours})
        if role == "target":
            BASE["target"] = ours[0.0]
    r("(tok/s; llama-bench tg samples nothing, so one figure serves both temperatures)")


def part_verify(s: Setup, r: Report, prompt: str) -> None:
    got = child(s, "verify", prompt)
    r(f"## verify cost: one eval of k tokens, all k logits rows copied back (ms, median of {got['reps']})")
    r(f"{'k':>4}" + "".join(f"{role:>18}" for role in got["ms"]) + "   (x of k = 1)")
    for i, k in enumerate(VERIFY_K):
        cells = "".join(f"{ms[i]:>10.2f} ({ms[i] / ms[0]:4.1f}x)" for ms in got["ms"].values())
        r(f"{k:>4}{cells}")
    r.keep("verify_ms", got["ms"])


def _row(r: Report, label: str, runs: list[dict], base: float | None, ref: float | None) -> dict:
    tps = median([x["tps"] for x in runs])
    drafted = sum(x.get("drafted") or 0 for x in runs)
    accepted = sum(x.get("accepted") or 0 for x in runs)
    shown = rate(accepted, drafted)
    r(f"{label:<42}{tps:>9.1f}{shown:>10}"
      + (f"{tps / base:>9.2f}x" if base else f"{'':>10}") + (f"{tps / ref:>9.2f}x" if ref else f"{'':>10}"))
    return {"tps": tps, "drafted": drafted, "accepted": accepted}


def _header(r: Report, title: str) -> None:
    r(title)
    r(f"{'run':<42}{'tok/s':>9}{'accepted':>10}{'/target':>10}{'/llama':>10}   (accepted of drafted; - = none drafted)")


def _target_only(s: Setup, model: Path, prompt: str, role: str) -> float:
    if role not in BASE:
        BASE[role] = median([specchat(s, model, prompt, ["--no-spec"])["tps"] for _ in range(s.reps)])
    return BASE[role]


def part_draft(s: Setup, r: Report, prompt: str) -> None:
    target, draft = s.models / "target.gguf", s.models / "draft.gguf"
    base = _target_only(s, target, prompt, "target")
    theirs = [harness.run_llamacpp(s.bin / "llama-speculative-simple", target, prompt, n=s.n, threads=s.threads,
                                   spec_type="draft-simple", draft=draft, k=4, extra=s.gpu()) for _ in range(s.reps)]
    ref = median([x["tps"] for x in theirs])
    _header(r, f"## draft model ({MODEL_NAMES['draft']} for {MODEL_NAMES['target']}), greedy, {s.n} tokens, "
               f"median of {s.reps}")
    rows = {"llama.cpp draft-simple k=4 (p-min 0)": _row(r, "llama.cpp draft-simple k=4 (p-min 0)", theirs, base, None)}
    for label, extra in (("specchat k=4 (--draft-fixed 4, p-min 0)", ["--draft-fixed", "4", "--draft-p-min", "0"]),
                         ("specchat policy (defaults)", [])):
        runs = [specchat(s, target, prompt, ["-md", str(draft), *extra]) for _ in range(s.reps)]
        rows[label] = _row(r, label, runs, base, ref)
    r(f"{'specchat target-only (--no-spec)':<42}{base:>9.1f}")
    r.keep("draft", rows)


def part_mtp(s: Setup, r: Report, prompt: str) -> None:
    model = s.models / "hybrid.gguf"
    base = _target_only(s, model, prompt, "hybrid")
    theirs = [harness.run_llamacpp(s.bin / "llama-speculative-simple", model, prompt, n=s.n, threads=s.threads,
                                   spec_type="draft-mtp", k=3, extra=s.gpu()) for _ in range(s.reps)]
    ref = median([x["tps"] for x in theirs])
    _header(r, f"## MTP ({MODEL_NAMES['hybrid']}'s own MTP layer), greedy, {s.n} tokens, median of {s.reps}")
    rows = {"llama.cpp draft-mtp k=3": _row(r, "llama.cpp draft-mtp k=3 (p-min 0)", theirs, base, None)}
    for label, extra in (("specchat mtp k=3 (p-min 0)", ["--draft-fixed", "3", "--draft-p-min", "0"]),
                         ("specchat mtp policy (defaults)", [])):
        runs = [specchat(s, model, prompt, ["-md", "mtp", *extra]) for _ in range(s.reps)]
        rows[label] = _row(r, label, runs, base, ref)
    r(f"{'specchat target-only (--no-spec)':<42}{base:>9.1f}")
    r.keep("mtp", rows)


def part_lookup(s: Setup, r: Report, prompt: str) -> None:
    target = s.models / "target.gguf"
    base = _target_only(s, target, prompt, "target")
    theirs = [harness.run_llamacpp(s.bin / "llama-speculative-simple", target, prompt, n=s.n, threads=s.threads,
                                   spec_type="ngram-simple", extra=("-ngl", s.ngl)) for _ in range(s.reps)]
    ref = median([x["tps"] for x in theirs])
    _header(r, f"## prompt lookup ({MODEL_NAMES['target']}), greedy, {s.n} tokens, median of {s.reps}")
    rows = {"llama.cpp ngram-simple": _row(r, "llama.cpp ngram-simple (its defaults)", theirs, base, None)}
    for label, extra in (("specchat lookup k=4", ["--draft-fixed", "4"]), ("specchat lookup policy (defaults)", [])):
        runs = [specchat(s, target, prompt, ["-md", "prompt-lookup", "--no-lookup-history", *extra])
                for _ in range(s.reps)]
        rows[label] = _row(r, label, runs, base, ref)
    r(f"{'specchat target-only (--no-spec)':<42}{base:>9.1f}")
    r.keep("lookup", rows)


def part_host(s: Setup, r: Report, prompt: str) -> None:
    got = child(s, "host", prompt)
    r(f"## host time per step outside llama_decode, fixed k = 4 (best of 3 runs, {s.n} tokens)")
    r(f"{'drafter':<16}{'temp':>5}{'steps':>7}{'host ms/step':>14}{'decode ms/step':>16}{'host share':>12}"
      f"{'accepted':>10}")
    for row in got["rows"]:
        share = row["host_ms_step"] / (row["host_ms_step"] + row["decode_ms_step"])
        acc = "-" if row["accept"] is None else f"{row['accept']:.0%}"
        r(f"{row['drafter']:<16}{row['temp']:>5}{row['steps']:>7}{row['host_ms_step']:>14.3f}"
          f"{row['decode_ms_step']:>16.2f}{share:>11.1%}{acc:>10}")
    r.keep("host", got["rows"])


def part_ckpt(s: Setup, r: Report, prompt: str) -> None:
    rows = {v: child(s, "ckpt", prompt, v) for v in ("snapshots", "host", "device")}
    r(f"## recurrent state ({MODEL_NAMES['hybrid']}), its MTP layer drafting k=4 (p-min 0), greedy, {s.n} tokens, "
      "one fresh process each")
    r(f"{'state kept as':<34}{'tok/s':>8}{'steps':>7}{'ckpt ms/step':>14}{'re-reads':>10}{'accepted':>10}  same text")
    for v, label in (("snapshots", "snapshots (n_rs_seq, no copy)"), ("host", "checkpoints, copies in host memory"),
                     ("device", "checkpoints, copies on the device")):
        x = rows[v]
        if "error" in x:
            r(f"{label:<34}  n/a: {x['error']}")
            continue
        same = "yes" if x["text"] == rows["snapshots"].get("text") else "NO"
        r(f"{label:<34}{x['tps']:>8.1f}{x['steps']:>7}{x['ckpt_ms_step']:>14.3f}{x['rereads']:>10}"
          f"{rate(x['accepted'], x['drafted']):>10}  {same}   ({x['memory']})")
    r("(ckpt ms/step: time in checkpoint saves and restores (LlamaCppBackend.rollback_seconds) per verify step; "
      "'copies on the device' = specchat's checkpoint path with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | ON_DEVICE)")
    r.keep("ckpt", rows)


BASE: dict[str, float] = {}  # specchat target-only tok/s per model, shared by the tables
MODEL_NAMES: dict[str, str] = {}
RUNNERS = {"plain": part_plain, "verify": part_verify, "draft": part_draft, "mtp": part_mtp, "lookup": part_lookup,
           "host": part_host, "ckpt": part_ckpt}


# --------------------------------------------------------------------------------------------- in-process children


def _sampling(temp: float, target):
    import specchat

    params = getattr(specchat, "SamplingParams", None)
    if params is None:
        from specchat.sampling import SamplingParams as params
    return params(temperature=temp, seed=7, banned=target.eog_tokens())


def child_verify(s: Setup, prompt: str) -> dict:
    """ms of one eval of k tokens after the prompt (the cut back to the prompt is not timed)."""
    from specchat.backend import LlamaCppBackend

    tm = harness.tiny_models()
    reps = 9 if not s.cpu else 5
    chain = tm.bigram_chain(int(tm.cycle_tokens()[0]), 200)
    out = {}
    for role in ("target", "draft", "hybrid"):
        backend = LlamaCppBackend(s.models / f"{role}.gguf", n_ctx=2048, n_threads=s.threads, n_gpu_layers=int(s.ngl))
        ids = backend.tokenize(prompt, add_special=True)
        backend.eval(ids, [])
        ms = []
        for k in VERIFY_K:
            times = []
            for rep in range(reps + 1):
                backend.truncate(len(ids))
                t0 = time.perf_counter()
                backend.eval(chain[64 : 64 + k], range(k))
                if rep:  # the first of each k builds its graph
                    times.append(1e3 * (time.perf_counter() - t0))
            ms.append(median(times))
        backend.close()
        out[role] = ms
    return {"ms": out, "reps": reps}


def _load(s: Setup, target: Path, draft: str | None, **opts):
    from specchat.config import load_config
    from specchat.loader import LoadOptions, load, select

    config = load_config()
    selection = select(config, pair=None, target=str(target), draft=draft, no_spec=draft is None)
    options = LoadOptions(n_ctx=2048, n_gpu_layers=int(s.ngl), n_gpu_layers_draft=int(s.ngl), n_threads=s.threads,
                          draft_p_min=0.0, lookup_history=False, **opts)
    return load(config, selection, options)


def child_host(s: Setup, prompt: str) -> dict:
    """harness.host_run (llama_decode wrapped and timed) for each drafter, as loaded by specchat.loader."""
    timer = harness.DecodeTimer()
    rows = []
    for label, draft in (("target only", None), ("prompt lookup", "prompt-lookup"),
                         ("draft model", str(s.models / "draft.gguf"))):
        loaded = _load(s, s.models / "target.gguf", draft)
        ids = loaded.target.tokenize(prompt, add_special=True)
        for temp in (0.0, 0.8):
            row = harness.host_run(timer, loaded.target, loaded.drafter, ids, 4, s.n, temperature=temp)
            rows.append({"drafter": label, "temp": temp, **row})
        loaded.close()
    return {"rows": rows}


def child_ckpt(s: Setup, prompt: str, variant: str) -> dict:
    """The hybrid drafting with its MTP layer at k = 4 (a draft every step): snapshots (its default), or
    checkpoints (no snapshots), with the copies in host memory (specchat's path) or kept on the device (its
    state flags | ON_DEVICE). One run from a fresh process, no warm-up: a second run in the same process
    would start by cutting the first one's reply, which only a checkpoint survives."""
    from specchat import backend as backend_module
    from specchat.engine import generate
    from specchat.policy import FixedPolicy

    if variant == "device":
        if not hasattr(backend_module, "STATE_PARTIAL"):
            return {"error": "specchat.backend.STATE_PARTIAL is gone: this part needs a way to pass the state flags"}
        backend_module.STATE_PARTIAL = 1 | 2  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
    loaded = _load(s, s.models / "hybrid.gguf", "mtp", **({} if variant == "snapshots" else {"draft_max": 0}))
    target = loaded.target
    ids = target.tokenize(prompt, add_special=True)
    params = _sampling(0.0, target)
    before = target.rollback_seconds
    events = list(generate(target, loaded.drafter, ids, params, max_tokens=s.n, policy=FixedPolicy(4)))
    stats = events[-1].stats
    text = getattr(events[-1], "text", "")
    result = {"tps": stats.tokens_per_second, "steps": stats.steps, "drafted": stats.drafted,
              "accepted": stats.accepted, "ckpt_ms_step": 1e3 * (target.rollback_seconds - before) / stats.steps,
              "rereads": target.rollback_recoveries, "memory": target.memory.describe(), "text": text}
    loaded.close()
    return result


CHILDREN = {"verify": child_verify, "host": child_host, "ckpt": child_ckpt}


# --------------------------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="no CUDA: CPU build, smaller shapes, 2 threads (a proof here)")
    ap.add_argument("--dry-run", action="store_true", help="prepare the carried folder here, print it, the command "
                    "and its estimated time; run nothing else")
    ap.add_argument("--prepare", action="store_true", help="only fill .gpu-check/carry (sdist, wheels, tokenizer)")
    ap.add_argument("--configure-only", action="store_true", help="cmake's configure step of the carried, trimmed "
                    "tree with the build's flags (seconds; the CUDA flags where nvcc exists), nothing built")
    ap.add_argument("--work", type=Path, help="build, models and scratch (default: .gpu-check/gpu, ignored, so a "
                    "second command on the still-warm machine finds them; .gpu-check/cpu with --cpu); an existing "
                    "build and models are reused")
    ap.add_argument("--out", type=Path, help="where the tables and results.json go (default: $OUT, else WORK/out)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order: {','.join(PARTS)}")
    ap.add_argument("-n", type=int, help="tokens per run (default 128; 32 with --cpu)")
    ap.add_argument("--reps", type=int, help="processes per figure, median taken (default 1, so that the build "
                    "and every table fit one 10-minute command)")
    ap.add_argument("-t", "--threads", type=int, help="CPU threads of both sides (default 8; 2 with --cpu)")
    ap.add_argument("--jobs", type=int, help="build jobs (default: all cores)")
    ap.add_argument("--budget", type=float, help="seconds for the whole command: a table that would not finish in "
                    "time is skipped (default 540 on the GPU, none with --cpu)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("child_args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in a.parts if p not in PARTS]
    if bad or not a.parts:
        raise Usage(f"--parts: unknown part {', '.join(bad) or '(none given)'}; choose from {','.join(PARTS)}")
    for name, value, low in (("-n", a.n, 1), ("--reps", a.reps, 1), ("--threads", a.threads, 1), ("--jobs", a.jobs, 1)):
        if value is not None and value < low:
            raise Usage(f"{name} must be at least {low}, not {value}")
    if a.n is not None and a.n > 1024:
        raise Usage(f"-n must be at most 1024 (the runs use a 2048-token context), not {a.n}")
    if a.budget is not None and a.budget <= 0:
        raise Usage(f"--budget must be a positive number of seconds, not {a.budget:g}")
    if a.dry_run and a.cpu:
        raise Usage("--dry-run describes the GPU command; it takes no --cpu")
    if sum((a.dry_run, a.prepare, a.configure_only)) > 1:
        raise Usage("choose one of --dry-run, --prepare and --configure-only")
    a.n = a.n or (32 if a.cpu else 128)
    a.reps = a.reps or 1
    a.threads = a.threads or (2 if a.cpu else 8)
    a.jobs = a.jobs or (2 if a.cpu else os.cpu_count() or 2)
    a.budget = a.budget if a.budget is not None else (float("inf") if a.cpu else 540.0)
    a.work = (a.work or LOCAL / ("cpu" if a.cpu else "gpu")).resolve()
    if a.work.exists() and not a.work.is_dir():
        raise Usage(f"--work {a.work} is a file, not a folder")
    out = a.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else a.work / "out")
    if out.exists() and not out.is_dir():
        raise Usage(f"--out {out} is a file, not a folder")
    a.out = out.resolve()
    return a


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    try:
        a = parse(argv)
    except Usage as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        sys.exit(2)
    if a.child:
        s = Setup(a)
        s.enter()
        print(json.dumps(CHILDREN[a.child](s, *a.child_args)))
        return
    if a.dry_run:
        dry_run(a)
        return
    if a.prepare:
        print(json.dumps(prepare(), indent=1))
        return
    if a.configure_only:
        sys.exit(configure_check(a))
    if not (CARRY / "llama.cpp.tar.xz").exists():
        if a.cpu:
            prepare()
        else:
            sys.exit(f"gpu_check: no {CARRY / 'llama.cpp.tar.xz'}: run --dry-run on a machine with network first and "
                     f"carry {_shown(CARRY)}")
    s = Setup(a)
    s.work.mkdir(parents=True, exist_ok=True)
    report = Report(a.out)
    report(f"# specchat GPU check · {time.strftime('%Y-%m-%d %H:%M:%S')} · {device_line(s)}")
    report(f"llama-cpp-python {json.loads((CARRY / 'manifest.json').read_text())['llama_cpp_python']} (vendored "
           f"llama.cpp) · -n {s.n} · --reps {s.reps} · -t {s.threads} · -ngl {s.ngl} · work {s.work} · out {a.out}")
    install_wheels(s, report)
    extract_source(s)
    writer = start_models(s)
    s.enter()
    try:
        build(s, a, report)
    except subprocess.CalledProcessError:
        tail = (s.work / "build.log").read_text()[-4000:]
        report(f"build FAILED; the end of {s.work / 'build.log'}:\n{tail}")
        if writer:
            writer.kill()
        sys.exit(1)
    if writer is not None:
        out, _ = writer.communicate()
        if writer.returncode != 0:
            report(f"writing the models FAILED:\n{out[-3000:]}")
            sys.exit(1)
    models = json.loads((s.models / "models.json").read_text())
    report("models (random weights, Q8_0, tests/tiny_models.py's construction; benchmarks/gpu_models.py):")
    for m in models:
        MODEL_NAMES[m["role"]] = m["name"]
        report(f"  {m['role']:<7}{m['name']:<26}{m['arch']:<7}{m['parameters'] / 1e9:5.2f}B  {m['n_layer']} layers x "
               f"{m['n_embd']}, vocab {m['n_vocab']}, {m['mib']:.0f} MiB, context {m['context']:g}, "
               f"written in {m['seconds']:.0f} s")
    report.keep("models", models)
    report.keep("setup", {"device": device_line(s), "n": s.n, "reps": s.reps, "threads": s.threads, "ngl": s.ngl})
    prompt = own_text(s)
    for part in a.parts:
        left = a.budget - (time.perf_counter() - started)
        need = 0 if s.cpu else part_seconds(part, s.reps)
        if need > left:
            report(f"\n## {part}: skipped, {left:.0f} s left of --budget {a.budget:.0f} (needs ~{need} s); rerun with "
                   f"--parts {part} on the warm machine")
            continue
        report("")
        t0 = time.perf_counter()
        try:
            RUNNERS[part](s, report, prompt)
        except Exception as exc:  # one broken part must not cost the others
            report(f"## {part}: FAILED: {type(exc).__name__}: {str(exc)[-1500:]}")
        report(f"({part}: {time.perf_counter() - t0:.0f} s)")
    report(f"\ntotal {time.perf_counter() - started:.0f} s · tables in {a.out / 'gpu-check.txt'} · figures in "
           f"{a.out / 'results.json'}")


if __name__ == "__main__":
    main()
