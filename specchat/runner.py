"""What every generating command does the same way: turn the shared options into a checked RunOptions,
load the pair behind a spinner, read the prompt. User mistakes raise UserError (one line, exit 2)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console

from .backend import BackendError
from .config import PROMPT_LOOKUP, Config, ConfigError
from .loader import LoadOptions, Selection, load, select
from .sampling import SamplingParams
from .sources import SourceError
from .template import TemplateError


DRAFT_MAX = 64  # --draft-max's default: the policy decides below it; long lookup matches use it


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


USER_ERRORS = (UserError, BackendError, ConfigError, SourceError, TemplateError)


@dataclass
class RunOptions:
    """Everything a generating command needs, gathered from the shared options."""

    selection: Selection
    load: LoadOptions
    params: SamplingParams
    draft_max: int
    draft_fixed: int | None
    max_tokens: int


def sampling_params(**kw) -> SamplingParams:
    params = SamplingParams(**kw)
    try:
        params.check()
    except ValueError as e:
        raise UserError(str(e)) from None
    return params


def run_options(
    config: Config,
    *,
    target, draft, pair, no_spec, max_tokens, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
    frequency_penalty, presence_penalty, seed, draft_max, draft_min, draft_p_min, draft_fixed, lookup_min,
    lookup_max, lookup_history=True, hybrid=None, ctx_size, ngl, ngld, threads, cross_vocab="auto", rpc=None,
) -> RunOptions:
    if lookup_min > lookup_max:
        raise UserError(f"--lookup-min ({lookup_min}) must not exceed --lookup-max ({lookup_max})")
    draft_max = DRAFT_MAX if draft_max is None else draft_max
    if draft_min > draft_max:
        raise UserError(f"--draft-min ({draft_min}) must not exceed --draft-max ({draft_max})")
    from .crossvocab import check_rule

    try:
        cross_vocab = check_rule(cross_vocab)
    except ValueError as e:
        raise UserError(str(e)) from None
    params = sampling_params(
        temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, seed=seed,
    )
    selection = select(config, pair=pair, target=target, draft=draft, no_spec=no_spec or draft_max == 0, hybrid=hybrid)
    if hybrid and selection.draft == PROMPT_LOOKUP:
        raise UserError("--hybrid needs a draft model (-md MODEL or a pair with one) to fall back on")
    load_opts = LoadOptions(
        n_ctx=ctx_size, n_gpu_layers=ngl, n_gpu_layers_draft=ngld, n_threads=threads,
        draft_p_min=draft_p_min, draft_min=draft_min, lookup_min=lookup_min, lookup_max=lookup_max,
        lookup_history=lookup_history,
        cross_vocab=cross_vocab,
        rpc=rpc_endpoints(rpc),
    )
    return RunOptions(selection, load_opts, params, draft_max, draft_fixed, max_tokens)


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
    try:
        yield loaded
    finally:
        loaded.close()


def read_prompt(text: str) -> str:
    if text == "-":
        text = sys.stdin.read()
    if not text.strip():
        raise UserError("empty prompt: give some text, or - to read it from stdin")
    return text

