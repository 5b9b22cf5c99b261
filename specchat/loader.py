"""From what the user typed (-m / -md / --pair) to a loaded target backend and drafter."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from . import rpc as rpc_workers  # (`rpc` is a list of endpoints)
from .backend import Backend, BackendError, LlamaCppBackend
from .config import MTP, PROMPT_LOOKUP, Config, ModelSpec
from .drafters import DraftModel, Drafter, HeadDrafter, HybridDrafter, IncompatibleDraft, PromptLookup
from .gguf_header import gguf_arch
from .heads import Eagle3Head, MtpHead
from .memory import MAX_SNAPSHOTS
from .sources import resolve


def default_threads() -> int:
    """llama-cpp-python defaults to cpu_count // 2 (1 thread on a 2-core machine, half speed there);
    llama.cpp's own tools use the physical cores. Use them all on small machines, half on big SMT ones."""
    n = os.cpu_count() or 1
    return n if n <= 4 else n // 2


@dataclass
class LoadOptions:
    n_ctx: int = 4096
    n_gpu_layers: int | None = None  # None = all when this llama.cpp can offload, else 0
    n_gpu_layers_draft: int | None = None
    n_threads: int | None = None
    draft_p_min: float = 0.75
    draft_min: int = 0
    lookup_min: int = 1
    lookup_max: int = 32
    lookup_history: bool = True  # prompt lookup also searches earlier replies (history.py)
    cross_vocab: str = "auto"  # rule for a draft with another tokenizer: auto | slem | tli
    rpc: tuple[str, ...] | None = None  # --rpc: workers for the target's layers (None = models.toml's)
    flash_attn: str = "auto"  # -fa: auto | on | off, for both models
    # --draft-max: a recurrent target keeps this many state snapshots (at most MAX_SNAPSHOTS) where its
    # architecture supports them, so a verify batch of up to that many drafts is cut back without a copy
    draft_max: int = MAX_SNAPSHOTS


@dataclass
class Loaded:
    target: Backend
    drafter: Drafter | None
    target_spec: ModelSpec
    draft_spec: ModelSpec | None  # None for prompt lookup, the target's MTP layers and no drafter
    drafter_label: str  # "prompt-lookup", "mtp", a draft model name, "prompt-lookup + NAME" (hybrid), or "none"
    # why drafting is off although a drafter was asked for (one line for the user), or None
    drafting_off: str | None = None

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` in the target's chat template (or the fallback for base models)."""
        from .template import render

        return render(self.target, messages).token_ids

    def policy(self, draft_max: int | None = None, draft_fixed: int | None = None):
        """The draft-length policy the CLI would use (adaptive unless draft_fixed is given; draft_max
        defaults to --draft-max's default)."""
        from .policy import DRAFT_MAX, make_policy

        return make_policy(self, DRAFT_MAX if draft_max is None else draft_max, draft_fixed)

    def memory_line(self) -> str | None:
        """How each model's cache is cut after a rejected draft, when one is recurrent (None otherwise):
        the chat header and `prompt --stats` show it."""
        backends = [("target", self.target)]
        if self.drafter is not None and self.drafter.backend is not None:
            backends.append(("draft", self.drafter.backend))
        if not any(b.memory.recurrent for _, b in backends):
            return None
        line = "memory: " + " · ".join(f"{role} {b.memory.describe()}" for role, b in backends)
        return line + (f" · {self.drafting_off}" if self.drafting_off else "")

    def target_here(self) -> Backend:
        """`/rpc off`: load the target again on this machine and let go of the one on the RPC workers,
        abandoned (never freed) when a worker was already gone: freeing its buffers there would abort."""
        remote = self.target
        gone = rpc_workers.unreachable(remote.rpc)
        local = LlamaCppBackend(remote.path, n_ctx=remote.n_ctx, n_threads=remote.n_threads, name=remote.name,
                                snapshots=remote.memory.snapshots, outputs=remote.outputs)
        if gone:
            rpc_workers.abandon(remote)
        else:
            remote.close()
        self.target = local
        return local

    def close(self) -> None:
        # the drafter first: an MTP head's context lives on the target's weights
        for backend in (self.drafter.backend if self.drafter is not None else None, self.target):
            if backend is not None:
                backend.close()


@dataclass(frozen=True)
class Selection:
    target: str
    draft: str | None  # model ref, PROMPT_LOOKUP, or None (no speculation)
    rpc: tuple[str, ...] = ()  # the pair's `rpc` workers, when the pair picked the target
    hybrid: bool = False  # prompt lookup first, the draft model when lookup has nothing better
    eagle3: bool = False  # --spec-type draft-eagle3: the draft must be an EAGLE-3 head


def select(config: Config, *, pair: str | None, target: str | None, draft: str | None, no_spec: bool,
           hybrid: bool | None = None, eagle3: bool = False) -> Selection:
    """--pair picks both; -m / -md override either part. -m alone drafts with prompt lookup, which needs
    no second model; --no-spec drops the drafter. --hybrid / --no-hybrid override a pair's `lookup`."""
    rpc: tuple[str, ...] = ()
    pair_hybrid = False
    if pair is not None or target is None:
        chosen = config.pair(pair or "default")
        rpc = chosen.rpc if target is None else ()
        target = target or chosen.target
        draft = draft or chosen.draft
        pair_hybrid = chosen.lookup
    draft = draft or PROMPT_LOOKUP
    use_hybrid = (pair_hybrid if hybrid is None else hybrid) and draft != PROMPT_LOOKUP
    return Selection(target=target, draft=None if no_spec else draft, rpc=rpc, hybrid=use_hybrid and not no_spec,
                     eagle3=eagle3)


def load(
    config: Config,
    selection: Selection,
    opts: LoadOptions,
    status: Callable[[str], None] = lambda message: None,
) -> Loaded:
    """Resolve files (downloading hub refs), load the target, then the drafter, checking compatibility
    before the draft's weights are loaded into a context."""
    threads = opts.n_threads or default_threads()
    target_spec = config.model(selection.target)
    status(f"locating {target_spec.name}")
    target_path = resolve(target_spec)
    # --rpc wins over the pair's `rpc`, which wins over the model's
    rpc = opts.rpc if opts.rpc is not None else (selection.rpc or target_spec.rpc)
    status(f"loading target {target_spec.name}" + (f" onto RPC {','.join(rpc)}" if rpc else ""))
    target = LlamaCppBackend(
        target_path, n_ctx=opts.n_ctx, n_gpu_layers=opts.n_gpu_layers, n_threads=threads, name=target_spec.name,
        rpc=rpc, flash_attn=opts.flash_attn, snapshots=min(max(opts.draft_max, 0), MAX_SNAPSHOTS),
        mtp=selection.draft == MTP, outputs=max(opts.draft_max, 0) + 1 if selection.draft is not None else 1,
    )
    try:
        if selection.draft is None:
            return Loaded(target, None, target_spec, None, "none")
        if target.memory.kind == "none":  # every rejected draft would re-read the conversation
            return Loaded(target, None, target_spec, None, "none", drafting_off=_cannot_cut(target))
        history = None
        if opts.lookup_history and (selection.draft == PROMPT_LOOKUP or selection.hybrid):
            from .history import reply_history

            history = reply_history(target)
        lookup = PromptLookup(opts.lookup_min, opts.lookup_max, draft_min=opts.draft_min, history=history)
        if selection.draft == PROMPT_LOOKUP:
            return Loaded(target, lookup, target_spec, None, PROMPT_LOOKUP)
        if selection.draft == MTP:
            status(f"creating the MTP context of {target_spec.name}")
            head = HeadDrafter(MtpHead(target), target, p_min=opts.draft_p_min, draft_min=opts.draft_min)
            if selection.hybrid:
                return Loaded(target, HybridDrafter(lookup, head), target_spec, None, f"{PROMPT_LOOKUP} + {MTP}")
            return Loaded(target, head, target_spec, None, MTP)
        draft_spec = config.model(selection.draft)
        status(f"locating draft {draft_spec.name}")
        draft_path = resolve(draft_spec)
        if gguf_arch(draft_path) == "eagle3":  # a head trained for this target: it reads the target's layers
            status(f"loading EAGLE-3 head {draft_spec.name}")
            eagle = Eagle3Head(target, draft_path, n_gpu_layers=opts.n_gpu_layers_draft)
            try:
                head = HeadDrafter(eagle, target, p_min=opts.draft_p_min, draft_min=opts.draft_min)
            except BaseException:
                eagle.close()
                raise
            if selection.hybrid:
                return Loaded(target, HybridDrafter(lookup, head), target_spec, draft_spec,
                              f"{PROMPT_LOOKUP} + {draft_spec.name}")
            return Loaded(target, head, target_spec, draft_spec, draft_spec.name)
        if selection.eagle3:
            raise BackendError(f"--spec-type draft-eagle3: {draft_spec.name} is a {gguf_arch(draft_path)} model, "
                               "not an EAGLE-3 head")
        status(f"loading draft {draft_spec.name}")
        draft_backend = LlamaCppBackend(
            draft_path,
            n_ctx=opts.n_ctx,
            n_gpu_layers=opts.n_gpu_layers_draft,
            n_threads=threads,
            name=draft_spec.name,
            flash_attn=opts.flash_attn,
            snapshots=0,  # drafts are evaluated one token a batch: snapshots of a batch cannot undo them
        )
        try:
            try:
                drafter = DraftModel.checked(draft_backend, target, p_min=opts.draft_p_min, draft_min=opts.draft_min)
            except IncompatibleDraft:
                # another tokenizer: draft in the draft's own tokens, verify re-tokenised (crossvocab.py)
                from .crossvocab import CrossVocabDrafter

                status(f"mapping {draft_spec.name}'s vocabulary to {target_spec.name}'s")
                drafter = CrossVocabDrafter(draft_backend, target, rule=opts.cross_vocab, p_min=opts.draft_p_min,
                                            draft_min=opts.draft_min)
        except BackendError:
            draft_backend.close()
            raise
        if drafter.backend.memory.kind == "none":
            if not selection.hybrid:
                draft_backend.close()
                return Loaded(target, None, target_spec, None, "none", drafting_off=_cannot_cut(drafter.backend))
            draft_backend.close()  # the hybrid keeps its free half: prompt lookup
            return Loaded(target, lookup, target_spec, None, PROMPT_LOOKUP, drafting_off=_cannot_cut(drafter.backend)
                          .replace("drafting off", "the draft model is off; prompt lookup drafts"))
        if selection.hybrid:
            return Loaded(target, HybridDrafter(lookup, drafter), target_spec, draft_spec,
                          f"{PROMPT_LOOKUP} + {draft_spec.name}")
        return Loaded(target, drafter, target_spec, draft_spec, draft_spec.name)
    except BaseException:
        target.close()
        raise


def _cannot_cut(backend: Backend) -> str:
    return (f"drafting off: {backend.name}'s recurrent state ({backend.memory.arch}) can be neither cut back nor "
            "copied by this llama.cpp, so every rejected draft would re-read the whole conversation")
