"""Record llama.cpp's own rendering of every vendored chat template, for tests/test_templates.py.

llama.cpp is the reference for how a chat becomes a prompt (issue 53). This script asks a real llama-server
(--jinja --chat-template-file T, POST /apply-template) for the prompt of a few short conversations under
every template the vendored llama.cpp ships (vendor/llama.cpp/models/templates/*.jinja in the
llama-cpp-python sdist), with thinking on, off and left to llama.cpp's default, and writes what it answered
(the prompt, or its error) to tests/reference/llamacpp_prompts.MODEL.json. The templates are copied beside it
(tests/reference/templates/, MIT, from llama.cpp's repository), so the suite checks specchat against
llama.cpp's output without building or running llama.cpp.

It lives here, next to the data it writes, rather than in benchmarks/ (scripts that measure speed): it is
how the test data is made, and the first place to look when a test says specchat and llama.cpp disagree.

Rerun it after llama-cpp-python (and so the vendored llama.cpp) changes:

    PYTHONPATH=. python3 tests/reference/record_templates.py            # builds llama-server once (~15 min)
    PYTHONPATH=. python3 tests/reference/record_templates.py --server PATH/llama-server --templates DIR

The model only supplies the BOS / EOS texts the templates see and whether its tokenizer adds BOS itself
(llama.cpp then cuts the template's own leading BOS from the prompt): models.toml's smollm2-135m (BOS not
added) and gemma-3-270m (added), each recorded with the data. Every server is bound to 127.0.0.1 and
stopped before the next starts.

For later use (parsing thoughts out of replies), with SmolLM2 only: llama-server's split of a few given
replies into reasoning_content and content. The split happens on generated text (/v1/chat/completions), so
the reply is forced with a grammar that allows only its exact text: no reasoning model is needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: the benchmark tool's harness builds llama-server

from benchmarks import harness  # noqa: E402

MODELS = ("smollm2-135m", "gemma-3-270m")


def data_file(model: str) -> Path:
    return HERE / f"llamacpp_prompts.{model}.json"

TEMPLATES = HERE / "templates"

# The conversations: issue 53's three, one user message; a system prompt with two turns; a history whose
# assistant turn carries a thought (reasoning_content, as llama-server takes it).
CONVERSATIONS = {
    "one_user": [
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "system_two_turns": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another one?"},
    ],
    "thought_in_history": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    # beyond issue 53's three: text a template might mangle (quotes, braces, unicode, edge whitespace) and
    # thoughts in two earlier turns
    "awkward_text": [
        {"role": "system", "content": "  Answer in \"quotes\" {like} <this>; ünïcödé ✓\n"},
        {"role": "user", "content": "Line one\n\nline 'two'  "},
        {"role": "assistant", "reasoning_content": "First thought.", "content": "\nReply one."},
        {"role": "user", "content": "[INST] not a tag [/INST]"},
        {"role": "assistant", "reasoning_content": "Second\nthought.", "content": "Reply two"},
        {"role": "user", "content": "Done?"},
    ],
    # a history that ends with the assistant's reply, rendered without a generation prompt: what specchat
    # renders when it resumes a transcript (llama-server runs with --no-prefill-assistant, so the last reply
    # is a whole message, not one to continue)
    "ended_history": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "reasoning_content": "Seven is prime.", "content": "Seven."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Eleven."},
    ],
}
NO_GENERATION_PROMPT = ("ended_history",)
# replies whose split into reasoning_content / content llama-server records (after CONVERSATIONS["one_user"])
REPLIES = {
    "tagged": "<think>I should recall it.</think>The capital is Paris.",
    "closed_only": "I should recall it.</think>The capital is Paris.",
    "plain": "The capital is Paris.",
}
SPLIT_MODES = ("default", "off")


def exact_grammar(text: str) -> str:
    """A GBNF grammar whose only sentence is `text`."""
    return 'root ::= "' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def split_reply(port: int, reply: str, kwargs: dict) -> dict:
    status, answer = post(port, "/v1/chat/completions", {
        "messages": CONVERSATIONS["one_user"], "chat_template_kwargs": kwargs, "grammar": exact_grammar(reply),
        "temperature": 0, "max_tokens": 64, "seed": 0}, timeout=120)
    if status != 200 or "choices" not in answer:
        error = answer.get("error", {})
        return {"error": (error.get("message") if isinstance(error, dict) else str(error)) or f"HTTP {status}"}
    message = answer["choices"][0]["message"]
    return {"content": message.get("content") or "", "reasoning_content": message.get("reasoning_content") or ""}
# thinking mode -> the chat_template_kwargs sent ("default": none, llama.cpp decides)
THINKING = {"default": {}, "on": {"enable_thinking": True}, "off": {"enable_thinking": False}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}


class Server:
    """One llama-server on a loopback port with one chat template; always stopped on exit."""

    def __init__(self, binary: Path, model: Path, template: Path, log: Path):
        self.port = free_port()
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [str(binary), "-m", str(model), "--jinja", "--chat-template-file", str(template),
                 "--host", "127.0.0.1", "--port", str(self.port), "-c", "512", "-np", "1", "-t", "1",
                 "--no-webui", "--no-prefill-assistant"],
                stdout=out, stderr=subprocess.STDOUT,
            )

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        harness.stop(self.process)

    def wait_ready(self, timeout: float = 120) -> str | None:
        """None once /health answers 200, else why it never will (the server's last log line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
                errors = [line for line in lines if "error" in line.lower() or "exception" in line.lower()]
                return (errors or lines or ["exited"])[-1].strip()
            try:
                status, _ = post(self.port, "/health", timeout=5)
                if status == 200:
                    return None
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        return "did not start in time"


def sdist_templates() -> Path:
    """vendor/llama.cpp/models/templates of the llama.cpp build the benchmark tool makes (benchmarks/harness.py)."""
    return harness.work_dir() / "llama.cpp" / "models" / "templates"


def build_server() -> Path:
    return harness.build(2, "llama-server")


def model_path(name: str) -> Path:
    from specchat.config import load_config
    from specchat.sources import resolve

    return Path(resolve(load_config().model(name)))


def record(binary: Path, model: Path, templates: Path, only: list[str] | None = None, name: str = "",
           split: bool = False) -> dict:
    names = sorted(p.stem for p in templates.glob("*.jinja"))
    if only:
        names = [n for n in names if n in only]
    results: dict[str, dict] = {}
    splits: dict[str, dict] = {}
    props: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, template in enumerate(names, 1):
            print(f"[{i}/{len(names)}] {template}", flush=True)
            with Server(binary, model, templates / f"{template}.jinja", Path(tmp) / "server.log") as server:
                failed = server.wait_ready()
                if failed is not None:
                    results[template] = {"server_error": failed}
                    continue
                if not props:
                    _, props = post(server.port, "/props")
                per_template = {}
                for conv, messages in CONVERSATIONS.items():
                    for mode, kwargs in THINKING.items():
                        status, answer = post(server.port, "/apply-template", {
                            "messages": messages, "chat_template_kwargs": kwargs,
                            "add_generation_prompt": conv not in NO_GENERATION_PROMPT})
                        if status == 200 and "prompt" in answer:
                            per_template[f"{conv}/{mode}"] = {"prompt": answer["prompt"]}
                        else:
                            error = answer.get("error", {})
                            message = error.get("message") if isinstance(error, dict) else str(error)
                            per_template[f"{conv}/{mode}"] = {"error": message or f"HTTP {status}"}
                results[template] = per_template
                if split:
                    splits[template] = {f"{reply}/{mode}": split_reply(server.port, text, THINKING[mode])
                                        for reply, text in REPLIES.items() for mode in SPLIT_MODES}
    return {
        "about": "llama-server's /apply-template prompts for every vendored template; written by record_templates.py",
        "llama_cpp_python": _llama_cpp_version(),
        "server_build": props.get("build_info", ""),
        "model": name or model.name,
        "model_file": model.name,
        "bos_token": props.get("bos_token", ""),
        "eos_token": props.get("eos_token", ""),
        "add_bos": _adds_specials(model)[0],
        "add_eos": _adds_specials(model)[1],
        "date": datetime.date.today().isoformat(),
        "conversations": CONVERSATIONS,
        "no_generation_prompt": list(NO_GENERATION_PROMPT),
        "thinking": THINKING,
        "results": results,
        **({"replies": REPLIES, "reasoning_split": splits} if split else {}),
    }


def _llama_cpp_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("llama-cpp-python")


def _adds_specials(model: Path) -> tuple[bool, bool]:
    """Whether the model's tokenizer adds BOS / EOS itself (llama.cpp then cuts the template's copies)."""
    from specchat.vocab import VocabFile

    with VocabFile(model) as vocab_file:
        return vocab_file.vocab.add_bos, vocab_file.vocab.add_eos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", type=Path, help="a llama-server binary (default: build the vendored one)")
    parser.add_argument("--templates", type=Path, help="the templates folder (default: the vendored one)")
    parser.add_argument("--model", action="append", help=f"a models.toml name whose BOS/EOS the templates see "
                        f"(repeatable; default: {', '.join(MODELS)})")
    parser.add_argument("--only", nargs="*", help="record only these templates (by file stem), keeping the rest")
    args = parser.parse_args()

    binary = args.server or build_server()
    templates = args.templates or sdist_templates()
    for name in args.model or MODELS:
        out = data_file(name)
        data = record(binary, model_path(name), templates, args.only, name, split=name == MODELS[0])
        if args.only and out.exists():
            old = json.loads(out.read_text())
            for key in ("results", "reasoning_split"):
                if key in data:
                    old.setdefault(key, {}).update(data[key])
                    data[key] = old[key]
        TEMPLATES.mkdir(exist_ok=True)
        for template in data["results"]:
            shutil.copyfile(templates / f"{template}.jinja", TEMPLATES / f"{template}.jinja")
        license_file = templates.parents[1] / "LICENSE"
        if license_file.exists():
            shutil.copyfile(license_file, TEMPLATES / "LICENSE")
        out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        counts = {"prompt": 0, "error": 0}
        for per_template in data["results"].values():
            for answer in per_template.values():
                if isinstance(answer, dict):
                    counts["prompt" if "prompt" in answer else "error"] += 1
        print(f"wrote {out}: {len(data['results'])} templates, {counts['prompt']} prompts, {counts['error']} errors")


if __name__ == "__main__":
    main()
