"""What every generating command does the same way: turn its RunArgs into a checked RunOptions, load the
pair behind a spinner, read the prompt. User mistakes raise errors.UserError (one line, exit 2)."""

from __future__ import annotations

import dataclasses
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.errors import MissingStyle

from .backend import FLASH_ATTN, Backend
from . import kinds
from .config import Config
from .crossvocab import check_rule
from .errors import UserError
from .kinds import DrafterKind
from .loader import LoadOptions, Selection, load, make_policy, select
from .tree_drafts import check_draft_tree, tree_policy
from .options import MAX_THREADS, RunArgs
from .reasoning import FORMATS, ReasoningOptions
from .rpc import parse_endpoints
from .sampling import SamplingParams
from .template import parse_kwargs, template_from_file, template_from_text


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: handled like Ctrl-C (a reply in progress is cut and saved), then the command
    ends with exit code 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


# What the command is doing while it cannot answer: a Ctrl-C there is reported with it ("interrupted
# while measuring this machine; nothing was saved"). Set through `activity`.
_activity: list[str] = []


@contextmanager
def activity(what: str):
    """While the block runs, `what` is what the command is doing. An exception leaves it in place, for
    the handler in cli.main to report (cli.main clears it when a command starts)."""
    depth = len(_activity)
    _activity.append(what)
    yield
    del _activity[depth:]


def clear_activity() -> None:
    """Forget what an earlier command in this process was doing (cli.main, as a command starts)."""
    _activity.clear()


def current_activity() -> str | None:
    return _activity[-1] if _activity else None


@dataclass
class RunOptions:
    """Everything a generating command needs, checked and built from its RunArgs."""

    selection: Selection
    load: LoadOptions
    params: SamplingParams
    draft_max: int
    draft_fixed: int | None
    max_tokens: int
    stop: list[str] = field(default_factory=list)  # the user's --stop strings (the template adds its own)
    ignore_eos: bool = False
    reproducible: bool = False  # --reproducible: draft lengths from the tokens only (see loader.make_policy)
    reasoning: ReasoningOptions = field(default_factory=ReasoningOptions)  # --reasoning-format / -budget
    draft_tree: int = 0  # --draft-tree: most nodes of a draft tree (0 = chains only)

    def policy(self, loaded, *, notify=None, draft_max: int | None = None):
        """The draft-length policy for this run (make_policy with this run's flags)."""
        draft_max = self.draft_max if draft_max is None else draft_max
        fixed = None if self.draft_fixed is None else min(self.draft_fixed, draft_max)
        policy = make_policy(loaded, draft_max, fixed, reproducible=self.reproducible, notify=notify)
        return tree_policy(policy, self.draft_tree) if draft_max and loaded.drafter is not None else policy

    def for_target(self, target: Backend) -> SamplingParams:
        """The sampling parameters for this target: --ignore-eos bans its end-of-generation ids."""
        if self.ignore_eos:
            self.params = dataclasses.replace(self.params, banned=target.eog_tokens())
        return self.params


def sampling_params(**kw) -> SamplingParams:
    params = SamplingParams(**kw)
    try:
        params.check()
    except ValueError as e:
        raise UserError(str(e)) from None
    return params


def check_text(text: str, what: str) -> str:
    """Text from the command line or stdin must be UTF-8: Python keeps undecodable bytes as lone
    surrogates, which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
        detail = f"byte 0x{byte:02x}" if byte is not None else "a lone surrogate"
        raise UserError(f"{what} is not valid UTF-8 ({detail} at character {e.start + 1}); "
                        "check the terminal's or file's encoding") from None
    return text


def run_options(config: Config, args: RunArgs) -> RunOptions:
    if args.lookup_min > args.lookup_max:
        raise UserError(f"--lookup-min ({args.lookup_min}) must not exceed --lookup-max ({args.lookup_max})")
    if args.draft_min > args.draft_max:
        raise UserError(f"--draft-min ({args.draft_min}) must not exceed --draft-max ({args.draft_max})")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise UserError(f"-t/--threads {args.threads}: the supported range is 1..{MAX_THREADS} "
                        "(ggml's GGML_MAX_N_THREADS; more can crash llama.cpp)")
    if args.no_spec and args.draft_fixed is not None:
        raise UserError(f"--draft-fixed {args.draft_fixed} drafts, --no-spec does not: give one of them")
    check_draft_tree(args.draft_tree, args.draft_fixed, args.no_spec)
    if args.no_spec and args.hybrid:
        raise UserError("--hybrid drafts, --no-spec does not: give one of them")
    stops = list(args.stop or [])
    for stop in stops:
        if not stop:
            raise UserError("--stop: an empty stop string would end every reply before it starts; give some text")
        check_text(stop, "--stop")
    flash_attn = args.flash_attn.strip().lower()
    if flash_attn not in FLASH_ATTN:
        raise UserError(f"-fa/--flash-attn must be one of {', '.join(FLASH_ATTN)}, got {args.flash_attn!r}")
    try:
        cross_vocab = check_rule(args.cross_vocab)
    except ValueError as e:
        raise UserError(str(e)) from None
    params = sampling_params(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        # a reproducible run needs a seed: 0 unless given
        seed=0 if args.reproducible and args.seed is None else args.seed,
    )
    chat_template, chat_template_kwargs = template_options(args)
    chain = spec_types(args.spec_type, args.draft)
    selection = select(config, pair=args.pair, target=args.target, draft=args.draft,
                       no_spec=args.no_spec or args.draft_max == 0, hybrid=args.hybrid, spec_types=chain)
    if args.hybrid and selection.drafts == (kinds.HYBRID_FRONT.word,):
        raise UserError("--hybrid needs another drafter (-md MODEL, -md mtp, or a pair with one) to fall back on")
    load_opts = LoadOptions(
        n_ctx=args.ctx_size, n_gpu_layers=args.ngl, n_gpu_layers_draft=args.ngld, n_threads=args.threads,
        draft_p_min=args.draft_p_min, draft_min=args.draft_min, lookup_min=args.lookup_min,
        lookup_max=args.lookup_max, lookup_history=args.lookup_history, cross_vocab=cross_vocab,
        rpc=rpc_endpoints(args.rpc), flash_attn=flash_attn, draft_max=args.draft_max, draft_tree=args.draft_tree,
        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
    )

    if args.reproducible:  # earlier replies change what lookup drafts from run to run
        load_opts.lookup_history = False
    reasoning = ReasoningOptions(args.reasoning_format.strip().lower(), args.reasoning_budget,
                                 args.reasoning_budget_message)
    return RunOptions(selection, load_opts, params, args.draft_max, args.draft_fixed, args.max_tokens,
                      stop=stops, ignore_eos=args.ignore_eos, reproducible=args.reproducible, reasoning=reasoning,
                      draft_tree=args.draft_tree)


def template_options(args: RunArgs):
    """--chat-template / --chat-template-file (one of them) and --chat-template-kwargs, read and checked
    before any model loads: a mistake is one line."""
    if args.chat_template is not None and args.chat_template_file is not None:
        raise UserError("give --chat-template or --chat-template-file, not both")
    chosen = None
    if args.chat_template is not None:
        if not args.chat_template.strip():
            raise UserError("--chat-template: empty; give a built-in name (chatml, llama3, ...) or Jinja text")
        chosen = template_from_text(check_text(args.chat_template, "--chat-template"))
    elif args.chat_template_file is not None:
        chosen = template_from_file(args.chat_template_file)
    kwargs = reasoning_kwargs(args)
    if args.chat_template_kwargs is not None:  # key by key over the reasoning flags', as llama-server's are
        kwargs = {**(kwargs or {}), **parse_kwargs(check_text(args.chat_template_kwargs, "--chat-template-kwargs"))}
    return chosen, kwargs


REASONING = {"on": True, "off": False, "auto": None}


def reasoning_kwargs(args: RunArgs) -> dict | None:
    """-rea / --reasoning-effort / --reasoning-preserve as the template variables llama.cpp sets for them
    (common/arg.cpp: enable_thinking, reasoning_effort, preserve_reasoning); None when none is given."""
    word = args.reasoning.strip().lower()
    if word not in REASONING:
        raise UserError(f"-rea/--reasoning must be one of on, off, auto, got {args.reasoning!r}")
    if args.reasoning_format.strip().lower() not in FORMATS:
        raise UserError(f"--reasoning-format must be one of {', '.join(FORMATS)}, got {args.reasoning_format!r}")
    if args.reasoning_budget_message is not None:
        check_text(args.reasoning_budget_message, "--reasoning-budget-message")
    kwargs: dict = {}
    if REASONING[word] is not None:
        kwargs["enable_thinking"] = REASONING[word]
    if args.reasoning_effort is not None:
        effort = check_text(args.reasoning_effort, "--reasoning-effort").strip()
        if not effort:
            raise UserError("--reasoning-effort: empty; give a level (low, medium, high, ...) or `default`")
        if effort != "default":
            kwargs["reasoning_effort"] = effort
    if args.reasoning_preserve and args.no_reasoning_preserve:
        raise UserError("give --reasoning-preserve or --no-reasoning-preserve, not both")
    if args.reasoning_preserve or args.no_reasoning_preserve:
        kwargs["preserve_reasoning"] = args.reasoning_preserve
    return kwargs or None


def spec_types(text: str | None, draft: str | None) -> tuple[DrafterKind, ...]:
    """--spec-type as llama.cpp spells it, one type or a chain (`draft-mtp,ngram-simple`), checked against
    -md; a mistake or a contradiction is a one-line error."""
    if text is None:
        return ()
    names = [name.strip().lower() for name in text.split(",")]
    chain: list[DrafterKind] = []
    for name in names:
        kind = kinds.by_spec_type(name)
        if kind is None:
            raise UserError(f"--spec-type {text!r}: {name!r} is not one of {', '.join(kinds.spec_types())} "
                            "(several, comma-separated, make a chain)")
        if kind not in chain:
            chain.append(kind)
    files = [k for k in chain if k.needs_file]
    if len(files) > 1:
        raise UserError(f"--spec-type {text}: {' and '.join(k.spec_types[0] for k in files)} both draft from -md; "
                        "a chain takes one drafter from a file")
    named = kinds.by_word(draft) if draft is not None else None
    if files and named is not None:
        raise UserError(f"--spec-type {files[0].spec_types[0]} needs a model file as -md, not {draft}")
    if files and draft is None and files[0].reads_target:  # a head is trained for one target: no pair has it
        raise UserError(f"--spec-type {files[0].spec_types[0]} needs the {files[0].label}: -md FILE")
    if draft is not None and not files and named not in chain:
        words = ", ".join(k.word or k.spec_types[0] for k in chain)
        raise UserError(f"--spec-type {text} drafts with {words}, without a model file: drop -md {draft}")
    return tuple(chain)


def rpc_endpoints(text: str | None) -> tuple[str, ...] | None:
    """--rpc as given: None (not given: models.toml decides), () for `off`, else checked endpoints."""
    if text is None:
        return None
    if text.strip().lower() in ("off", "none", "local", ""):
        return ()
    return parse_endpoints(text)


@contextmanager
def loading(config: Config, run: RunOptions, console: Console):
    """Load the pair behind a spinner (on a terminal) and always free it."""
    depth = len(_activity)
    _activity.append("loading the models")  # what a Ctrl-C stops until they are loaded
    if console.is_terminal:
        with console.status("loading models…") as spinner:
            loaded = load(config, run.selection, run.load, status=lambda m: spinner.update(m + "…"))
    else:
        loaded = load(config, run.selection, run.load)
    if loaded.drafting_off:
        console.print(loaded.drafting_off, style="yellow")
    try:
        del _activity[depth:]
        yield loaded
    finally:
        loaded.close()


def measuring_notice(console: Console):
    """The `notify` for make_policy: one visible line before a calibration (the first run on a machine,
    or a saved one measured again, with why), and the activity a Ctrl-C then reports."""
    try:
        style = console.get_style("spec.notice")  # the chat's theme; a plain console has no such style
    except MissingStyle:
        style = "dim"

    def notify(model: str, seconds: float, again: str = "") -> None:
        about = f"about {max(1, round(seconds))} s"
        if again:  # nothing is written until the measuring ends: an interrupted one keeps the saved costs
            _activity.append(f"measuring this machine again ({model}); its saved costs were kept")
            console.print(f"measuring this machine again for {model} ({about}): {again}…", style=style,
                          highlight=False)
            return
        _activity.append(f"measuring this machine ({model}); nothing was saved, it measures again next time")
        console.print(f"measuring this machine once for {model} ({about}; saved for next time)…", style=style,
                      highlight=False)

    return notify


@contextmanager
def measuring(console: Console):
    """Around make_policy: measuring_notice's activity ends with it."""
    depth = len(_activity)
    yield measuring_notice(console)
    del _activity[depth:]  # not on an exception: cli.main reports what was being measured


def read_prompt(text: str) -> str:
    if text == "-":
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at byte {e.start + 1}); "
                            "check the file's encoding") from None
        # `echo TEXT | specchat prompt -` and a file ending in a newline: the one newline the shell or
        # editor adds is not part of the prompt, so stdin and an argument give the same tokens
        text = text.removesuffix("\r\n") if text.endswith("\r\n") else text.removesuffix("\n")
    check_text(text, "the prompt")
    if not text.strip():
        raise UserError("empty prompt: give some text, or - to read it from stdin")
    return text
