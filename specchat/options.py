"""Command-line options shared by `prompt`, `chat` and `report`, named like llama.cpp's where it has one.

Each is an Annotated type so a command declares `temp: Temp = 0.8` and gets the flag, help text, range
check and help panel in one place.
"""

from __future__ import annotations

from typing import Annotated

import typer

MODELS = "Models"
SAMPLING = "Sampling"
SPEC = "Speculation"
HARDWARE = "Hardware"
OUTPUT = "Output"

Target = Annotated[
    str | None,
    typer.Option("-m", "--target", "--model", help="Target model: name from `specchat models`, .gguf path, or owner/repo:file-or-quant.", rich_help_panel=MODELS),
]
Draft = Annotated[
    str | None,
    typer.Option("-md", "--draft", "--model-draft", help="Drafter: a model (name, path or hub ref) or `prompt-lookup`. Default: the pair's, else prompt-lookup.", rich_help_panel=MODELS),
]
Pair = Annotated[
    str | None,
    typer.Option("--pair", help="A target+draft pair from models.toml (default: `default`).", rich_help_panel=MODELS),
]
NoSpec = Annotated[
    bool,
    typer.Option("--no-spec", help="Target-only decoding through the same code path (the baseline).", rich_help_panel=SPEC),
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
    int | None, typer.Option("-s", "--seed", min=0, help="Seed; the same seed reproduces a run exactly.", rich_help_panel=SAMPLING)
]
Stop = Annotated[
    list[str] | None, typer.Option("--stop", help="Stop string (repeatable).", rich_help_panel=SAMPLING)
]
DraftMax = Annotated[
    int | None,
    typer.Option("--draft-max", "--draft-n", min=0, help="Most tokens drafted per step (0 = no drafting). Default 64, the policy picks k up to it.", rich_help_panel=SPEC),
]
DraftMin = Annotated[
    int, typer.Option("--draft-min", min=0, help="Drop drafts shorter than this.", rich_help_panel=SPEC)
]
DraftPMin = Annotated[
    float,
    typer.Option("--draft-p-min", min=0.0, max=1.0, help="Draft model stops when its top probability falls below this.", rich_help_panel=SPEC),
]
DraftFixed = Annotated[
    int | None,
    typer.Option("--draft-fixed", min=0, help="Always draft exactly N tokens (disables the adaptive policy; for experiments).", rich_help_panel=SPEC),
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
    typer.Option("--hybrid/--no-hybrid", help="Prompt lookup where it has a match, the draft model otherwise, chosen per step (default: the pair's `lookup` key).", rich_help_panel=SPEC, show_default=False),
]
Ctx = Annotated[int, typer.Option("-c", "--ctx-size", min=16, help="Context size in tokens.", rich_help_panel=HARDWARE)]
Ngl = Annotated[
    int | None,
    typer.Option("-ngl", "--gpu-layers", min=-1, help="Target layers on the GPU (-1 = all; default: all if this build can offload, else 0).", rich_help_panel=HARDWARE),
]
Ngld = Annotated[
    int | None,
    typer.Option("-ngld", "--gpu-layers-draft", min=-1, help="Draft model layers on the GPU (same default).", rich_help_panel=HARDWARE),
]
Rpc = Annotated[
    str | None,
    typer.Option("--rpc", help="RPC workers for the target's layers: HOST:PORT[,HOST:PORT...] (`specchat rpc-server` there); -ngl counts the layers placed on them (default all). `off` = local.", rich_help_panel=HARDWARE),
]
Threads = Annotated[
    int | None, typer.Option("-t", "--threads", min=1, help="CPU threads (default: all cores up to 4, else half).", rich_help_panel=HARDWARE)
]
NoColor = Annotated[bool, typer.Option("--no-color", help="No colour (also when NO_COLOR is set).", rich_help_panel=OUTPUT)]
IgnoreEos = Annotated[
    bool,
    typer.Option("--ignore-eos", help="Never end at an end-of-generation token (benchmarks: fixed lengths).", rich_help_panel=SAMPLING),
]
