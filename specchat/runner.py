"""What every generating command does the same way: turn its RunArgs into a checked RunOptions, load the
pair behind a spinner, read the prompt. User mistakes raise UserError (one line, exit 2)."""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console

from .backend import FLASH_ATTN, Backend, BackendError
from .config import MTP, PROMPT_LOOKUP, Config, ConfigError
from .loader import LoadOptions, Selection, load, select
from .options import MAX_THREADS, RunArgs
from .sampling import SamplingParams
from .sources import SourceError
from .template import TemplateError


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


USER_ERRORS = (UserError, BackendError, ConfigError, SourceError, TemplateError)


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
    stops = list(args.stop or [])
    for stop in stops:
        if not stop:
            raise UserError("--stop: an empty stop string would end every reply before it starts; give some text")
        check_text(stop, "--stop")
    flash_attn = args.flash_attn.strip().lower()
    if flash_attn not in FLASH_ATTN:
        raise UserError(f"-fa/--flash-attn must be one of {', '.join(FLASH_ATTN)}, got {args.flash_attn!r}")
    from .crossvocab import check_rule

    try:
        cross_vocab = check_rule(args.cross_vocab)
    except ValueError as e:
        raise UserError(str(e)) from None
    params = sampling_params(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
    )
    selection = select(config, pair=args.pair, target=args.target, draft=spec_type_draft(args.spec_type, args.draft),
                       no_spec=args.no_spec or args.draft_max == 0, hybrid=args.hybrid,
                       eagle3=(args.spec_type or "").strip().lower() == "draft-eagle3")
    if args.hybrid and selection.draft == PROMPT_LOOKUP:
        raise UserError("--hybrid needs a draft model (-md MODEL or a pair with one) to fall back on")
    load_opts = LoadOptions(
        n_ctx=args.ctx_size, n_gpu_layers=args.ngl, n_gpu_layers_draft=args.ngld, n_threads=args.threads,
        draft_p_min=args.draft_p_min, draft_min=args.draft_min, lookup_min=args.lookup_min,
        lookup_max=args.lookup_max, lookup_history=args.lookup_history, cross_vocab=cross_vocab,
        rpc=rpc_endpoints(args.rpc), flash_attn=flash_attn, draft_max=args.draft_max,
    )
    return RunOptions(selection, load_opts, params, args.draft_max, args.draft_fixed, args.max_tokens,
                      stop=stops, ignore_eos=args.ignore_eos)


SPEC_TYPES = ("draft-mtp", "draft-eagle3", "draft-simple", "ngram-simple")  # llama.cpp's --spec-type values we take


def spec_type_draft(spec_type: str | None, draft: str | None) -> str | None:
    """-md as --spec-type (llama.cpp's spelling) implies it; a contradiction is a one-line error."""
    if spec_type is None:
        return draft
    kind = spec_type.strip().lower()
    if kind not in SPEC_TYPES:
        raise UserError(f"--spec-type {spec_type!r}: one of {', '.join(SPEC_TYPES)}")
    if kind == "draft-mtp":
        if draft not in (None, MTP):
            raise UserError(f"--spec-type draft-mtp drafts with the target's own MTP layers: drop -md {draft}")
        return MTP
    if kind == "ngram-simple":
        if draft not in (None, PROMPT_LOOKUP):
            raise UserError(f"--spec-type ngram-simple is prompt lookup: drop -md {draft}")
        return PROMPT_LOOKUP
    if draft in (MTP, PROMPT_LOOKUP):
        raise UserError(f"--spec-type {kind} needs a model file as -md, not {draft}")
    if kind == "draft-eagle3" and draft is None:
        raise UserError("--spec-type draft-eagle3 needs the EAGLE-3 head: -md FILE")
    return draft


def rpc_endpoints(text: str | None) -> tuple[str, ...] | None:
    """--rpc as given: None (not given: models.toml decides), () for `off`, else checked endpoints."""
    if text is None:
        return None
    if text.strip().lower() in ("off", "none", "local", ""):
        return ()
    from .rpc import parse_endpoints

    return parse_endpoints(text)


@contextmanager
def loading(config: Config, run: RunOptions, console: Console):
    """Load the pair behind a spinner (on a terminal) and always free it."""
    if console.is_terminal:
        with console.status("loading models…") as spinner:
            loaded = load(config, run.selection, run.load, status=lambda m: spinner.update(m + "…"))
    else:
        loaded = load(config, run.selection, run.load)
    if loaded.drafting_off:
        console.print(loaded.drafting_off, style="yellow")
    try:
        yield loaded
    finally:
        loaded.close()


def read_prompt(text: str) -> str:
    if text == "-":
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at byte {e.start + 1}); "
                            "check the file's encoding") from None
    check_text(text, "the prompt")
    if not text.strip():
        raise UserError("empty prompt: give some text, or - to read it from stdin")
    return text
