"""Command-line options shared by `prompt`, `chat` and `report`, named like llama.cpp's where it has one
(its current `--spec-draft-*` spellings and the older ones both).

Each flag is an Annotated type: the flag, its help text, range check and help panel in one place.
`RunArgs` gathers the generation flags into one value and `run_args` attaches all of them to a command,
which then receives `run: RunArgs`. Defaults come from the library's own dataclasses (SamplingParams,
LoadOptions), so each is written once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from copy import copy
from dataclasses import dataclass
from typing import Annotated, get_args, get_type_hints

import typer

from . import kinds
from .engine import MAX_TOKENS
from .loader import LoadOptions
from .policy import DRAFT_MAX
from .sampling import SamplingParams

# ggml's per-thread state is sized GGML_MAX_N_THREADS (512); far more threads crash llama.cpp (-t 100000)
MAX_THREADS = 512

MODELS = "Models"
SAMPLING = "Sampling"
SPEC = "Speculation"
HARDWARE = "Hardware"
OUTPUT = "Output"
REASONING = "Reasoning"  # a thinking model's flags, as llama.cpp spells them

Target = Annotated[
    str | None,
    typer.Option("-m", "--target", "--model", help="Target model: name from `specchat models`, .gguf path, or owner/repo:file-or-quant.", rich_help_panel=MODELS),
]
Draft = Annotated[
    str | None,
    typer.Option("-md", "--draft", "--model-draft", "--spec-draft-model", help="Drafter: a model or a head file trained for the target (name, path or hub ref), `prompt-lookup`, or `mtp` (the target's own MTP layers); with --spec-type, the file its kind reads. Default: the pair's, else prompt-lookup.", rich_help_panel=MODELS),
]
SpecType = Annotated[
    str | None,
    typer.Option("--spec-type", help=f"llama.cpp's spelling of the drafter, or a chain of them separated by commas, no spaces: {kinds.spec_type_help()}. A chain is priced each step and the best draft sent.", rich_help_panel=SPEC),
]
Pair = Annotated[
    str | None,
    typer.Option("--pair", help="A target+draft pair from models.toml (default: `default`).", rich_help_panel=MODELS),
]
NoSpec = Annotated[
    bool,
    typer.Option("--no-spec", help="Target-only decoding through the same code path (the baseline).", rich_help_panel=SPEC),
]
ChatTemplate = Annotated[
    str | None,
    typer.Option("--chat-template", help="The target's chat template instead of its own: one of llama.cpp's built-in names (chatml, llama3, gemma, ...) or Jinja text.", rich_help_panel=MODELS, show_default=False),
]
ChatTemplateFile = Annotated[
    str | None,
    typer.Option("--chat-template-file", help="The target's chat template from a Jinja file (e.g. llama.cpp's models/templates/*.jinja).", rich_help_panel=MODELS, show_default=False),
]
ChatTemplateKwargs = Annotated[
    str | None,
    typer.Option("--chat-template-kwargs", help="""Variables for the chat template, a JSON object, as llama.cpp takes them: '{"enable_thinking": false}' turns a thinking model's thinking off.""", rich_help_panel=MODELS, show_default=False),
]
Reasoning = Annotated[
    str,
    typer.Option("-rea", "--reasoning", help="Thinking, for a reasoning model: on, off, or auto (the template's default). Sets the template's enable_thinking, as llama.cpp does.", rich_help_panel=REASONING),
]
ReasoningFormat = Annotated[
    str,
    typer.Option("--reasoning-format", help="How a thought is returned: auto or deepseek (apart from the answer, and in --json a field of its own), deepseek-legacy (apart, and left in the text too), none (left in the text).", rich_help_panel=REASONING),
]
ReasoningBudget = Annotated[
    int,
    typer.Option("--reasoning-budget", min=-1, help="Most tokens a thought may take before its end is forced (-1: no limit, 0: end it at once). The budget constrains the target's own distribution, and speculation stays lossless for it.", rich_help_panel=REASONING),
]
ReasoningBudgetMessage = Annotated[
    str | None,
    typer.Option("--reasoning-budget-message", help="Text written before the forced end of a thought whose budget ran out.", rich_help_panel=REASONING, show_default=False),
]
ReasoningEffort = Annotated[
    str | None,
    typer.Option("--reasoning-effort", help="Effort level given to templates that read one (gpt-oss: low, medium, high); `default` keeps the template's.", rich_help_panel=REASONING, show_default=False),
]
ReasoningPreserve = Annotated[
    bool,
    typer.Option("--reasoning-preserve", help="Keep earlier turns' thoughts in the prompt where the template can (it reads preserve_reasoning). Default: the template's.", rich_help_panel=REASONING),
]
NoReasoningPreserve = Annotated[
    bool,
    typer.Option("--no-reasoning-preserve", help="Drop earlier turns' thoughts from the prompt where the template can.", rich_help_panel=REASONING),
]
MaxTokens = Annotated[
    int,
    typer.Option("-n", "--max-tokens", "--n-predict", min=1, help="Most tokens to generate.", rich_help_panel=SAMPLING),
]
Temp = Annotated[
    float,
    typer.Option("--temp", "--temperature", min=0.0, help="Temperature; 0 = greedy.", rich_help_panel=SAMPLING),
]
TopK = Annotated[int, typer.Option("--top-k", min=0, help="Top-k (0 = off).", rich_help_panel=SAMPLING)]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Top-p nucleus (1.0 = off).", rich_help_panel=SAMPLING)]
MinP = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p (0 = off).", rich_help_panel=SAMPLING)]
RepeatPenalty = Annotated[
    float, typer.Option("--repeat-penalty", min=0.0, help="Repetition penalty (1.0 = off).", rich_help_panel=SAMPLING)
]
RepeatLastN = Annotated[
    int, typer.Option("--repeat-last-n", min=-1, help="Tokens the penalties look back over (-1 = all).", rich_help_panel=SAMPLING)
]
FrequencyPenalty = Annotated[
    float, typer.Option("--frequency-penalty", help="Frequency penalty (0 = off).", rich_help_panel=SAMPLING)
]
PresencePenalty = Annotated[
    float, typer.Option("--presence-penalty", help="Presence penalty (0 = off).", rich_help_panel=SAMPLING)
]
Seed = Annotated[
    int | None,
    typer.Option("-s", "--seed", min=0, help="Seed of the sampling. The same seed gives the same text only with --reproducible: otherwise draft lengths follow this machine's timings and earlier runs, which can change the text where two tokens are nearly tied.", rich_help_panel=SAMPLING),
]
Reproducible = Annotated[
    bool,
    typer.Option("--reproducible", help="Same command and seed, same text token for token: draft lengths from the tokens alone (fixed costs, no timing, nothing learned from earlier runs or replies); seed 0 unless -s.", rich_help_panel=SPEC),
]
Stop = Annotated[
    list[str] | None, typer.Option("--stop", help="Stop string (repeatable).", rich_help_panel=SAMPLING)
]
DraftMax = Annotated[
    int,
    typer.Option("--draft-max", "--draft-n", "--spec-draft-n-max", min=0, help="Most tokens drafted per step (0 = no drafting); the policy picks k up to it.", rich_help_panel=SPEC),
]
DraftMin = Annotated[
    int, typer.Option("--draft-min", "--spec-draft-n-min", min=0, help="Drop drafts shorter than this.", rich_help_panel=SPEC)
]
DraftPMin = Annotated[
    float,
    typer.Option("--draft-p-min", "--spec-draft-p-min", min=0.0, max=1.0, help="Draft model stops when its top probability falls below this.", rich_help_panel=SPEC),
]
DraftFixed = Annotated[
    int | None,
    typer.Option("--draft-fixed", min=0, help="Always draft exactly N tokens (disables the adaptive policy; for experiments).", rich_help_panel=SPEC),
]
DraftTreeNodes = Annotated[
    int,
    typer.Option("--draft-tree", help="Most nodes a draft tree may have (0 = chains only): prompt lookup's chain is widened with the other continuations that followed the same text before, all verified in one target batch. With --draft-fixed K, a tree of at most N nodes, K deep, every step (for experiments).", rich_help_panel=SPEC),
]
CrossVocab = Annotated[
    str,
    typer.Option("--cross-vocab", help="Rule for a draft model with another tokenizer: slem (exact match of the re-tokenised text), tli (draft restricted to the shared vocabulary, min(1, p/q)), or auto (tli at temperature > 0 when the vocabularies share enough, else slem).", rich_help_panel=SPEC),
]
LookupMin = Annotated[int, typer.Option("--lookup-min", min=1, help="Prompt lookup: shortest n-gram to match.", rich_help_panel=SPEC)]
LookupMax = Annotated[int, typer.Option("--lookup-max", min=1, max=1024, help="Prompt lookup: longest n-gram to match (a longer match predicts a longer accepted draft).", rich_help_panel=SPEC)]
LookupHistory = Annotated[
    bool,
    typer.Option("--lookup-history/--no-lookup-history", help="Prompt lookup also matches your earlier replies (chat transcripts, report runs).", rich_help_panel=SPEC),
]
Hybrid = Annotated[
    bool | None,
    typer.Option("--hybrid/--no-hybrid", help="Add prompt lookup to the drafter (a chain: the draft that pays best each step), or --no-hybrid to take it out (default: the pair's).", rich_help_panel=SPEC, show_default=False),
]
Ctx = Annotated[int, typer.Option("-c", "--ctx-size", min=16, help="Context size in tokens.", rich_help_panel=HARDWARE)]
Ngl = Annotated[
    int | None,
    typer.Option("-ngl", "--gpu-layers", min=-1, help="Target layers on the GPU (-1 = all; default: all if this build can offload, else 0).", rich_help_panel=HARDWARE),
]
Ngld = Annotated[
    int | None,
    typer.Option("-ngld", "--gpu-layers-draft", "--spec-draft-ngl", min=-1, help="Draft model layers on the GPU (same default).", rich_help_panel=HARDWARE),
]
Rpc = Annotated[
    str | None,
    typer.Option("--rpc", help="RPC workers for the target's layers: HOST:PORT[,HOST:PORT...] (`specchat rpc-server` there); -ngl counts the layers placed on them (default all). `off` = local.", rich_help_panel=HARDWARE),
]
Threads = Annotated[
    int | None, typer.Option("-t", "--threads", min=1, help=f"CPU threads, 1..{MAX_THREADS} (default: all cores up to 4, else half).", rich_help_panel=HARDWARE)
]
FlashAttn = Annotated[
    str,
    typer.Option("-fa", "--flash-attn", help="Flash attention: on, off, or auto (llama.cpp's choice where layers run on a GPU or an RPC worker; off on the CPU alone, where it slows verify batches).", rich_help_panel=HARDWARE),
]
NoColor = Annotated[bool, typer.Option("--no-color", help="No colour (also when NO_COLOR is set).", rich_help_panel=OUTPUT)]
IgnoreEos = Annotated[
    bool,
    typer.Option("--ignore-eos", help="Never end at an end-of-generation token (benchmarks: fixed lengths).", rich_help_panel=SAMPLING),
]


_SAMPLING, _LOAD = SamplingParams(), LoadOptions()


@dataclass
class RunArgs:
    """The generation flags of `prompt`, `chat` and `report`, as typed: one value per command run.
    Each field's annotation is its flag; each default is the library's."""

    target: Target = None
    draft: Draft = None
    spec_type: SpecType = None
    pair: Pair = None
    no_spec: NoSpec = False
    chat_template: ChatTemplate = None
    chat_template_file: ChatTemplateFile = None
    chat_template_kwargs: ChatTemplateKwargs = None
    reasoning: Reasoning = "auto"
    reasoning_format: ReasoningFormat = "auto"
    reasoning_budget: ReasoningBudget = -1
    reasoning_budget_message: ReasoningBudgetMessage = None
    reasoning_effort: ReasoningEffort = None
    reasoning_preserve: ReasoningPreserve = False
    no_reasoning_preserve: NoReasoningPreserve = False
    max_tokens: MaxTokens = MAX_TOKENS
    temp: Temp = _SAMPLING.temperature
    top_k: TopK = _SAMPLING.top_k
    top_p: TopP = _SAMPLING.top_p
    min_p: MinP = _SAMPLING.min_p
    repeat_penalty: RepeatPenalty = _SAMPLING.repeat_penalty
    repeat_last_n: RepeatLastN = _SAMPLING.repeat_last_n
    frequency_penalty: FrequencyPenalty = _SAMPLING.frequency_penalty
    presence_penalty: PresencePenalty = _SAMPLING.presence_penalty
    seed: Seed = _SAMPLING.seed
    stop: Stop = None
    ignore_eos: IgnoreEos = False
    draft_max: DraftMax = DRAFT_MAX
    draft_min: DraftMin = _LOAD.draft_min
    draft_p_min: DraftPMin = _LOAD.draft_p_min
    draft_fixed: DraftFixed = None
    draft_tree: DraftTreeNodes = 0
    reproducible: Reproducible = False
    lookup_min: LookupMin = _LOAD.lookup_min
    lookup_max: LookupMax = _LOAD.lookup_max
    lookup_history: LookupHistory = _LOAD.lookup_history
    hybrid: Hybrid = None
    cross_vocab: CrossVocab = _LOAD.cross_vocab
    ctx_size: Ctx = _LOAD.n_ctx
    ngl: Ngl = _LOAD.n_gpu_layers
    ngld: Ngld = _LOAD.n_gpu_layers_draft
    threads: Threads = _LOAD.n_threads
    rpc: Rpc = None
    flash_attn: FlashAttn = _LOAD.flash_attn


def _with_help(annotation, text: str):
    """The same flag with another help text (a command whose default means something else)."""
    base, info = get_args(annotation)
    info = copy(info)
    info.help = text
    return Annotated[base, info]


def run_args(*, defaults: Mapping[str, object] | None = None, help: Mapping[str, str] | None = None,
             exclude: tuple[str, ...] = ()) -> Callable:
    """Give a Typer command every RunArgs flag; it receives them as one `run: RunArgs` parameter.

    What differs per command is said here and nowhere else: `defaults` (report: greedy, seed 0, -n 128),
    `help` texts for those, and `exclude` (flags that make no sense for the command; they keep their
    default in the RunArgs it receives)."""
    defaults, help = dict(defaults or {}), dict(help or {})
    hints = get_type_hints(RunArgs, include_extras=True)
    names = [f.name for f in dataclasses.fields(RunArgs)]
    unknown = set(defaults) | set(help) | set(exclude)
    assert unknown <= set(names), unknown - set(names)

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "run"]
        shared = []
        for field in dataclasses.fields(RunArgs):
            if field.name in exclude:
                continue
            annotation = hints[field.name]
            if field.name in help:
                annotation = _with_help(annotation, help[field.name])
            shared.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                            default=defaults.get(field.name, field.default)))
        positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p not in positional]
        params = positional + shared + keyword

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            given = {name: kwargs.pop(name) for name in names if name in kwargs}
            run = RunArgs(**{**defaults, **given})
            return command(*args, run=run, **kwargs)

        del wrapper.__wrapped__  # Typer must read the signature below, not the command's
        wrapper.__signature__ = signature.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate
