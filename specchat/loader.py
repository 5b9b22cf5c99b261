"""From what the user typed (-m / -md / --spec-type / --pair) to a loaded target backend, its drafter (or
chain of drafters, each built by its kind's factory: kinds.py) and the policy that prices their drafts."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from . import kinds
from . import rpc as rpc_workers  # (`rpc` is a list of endpoints)
from .backend import Backend, BackendError, LlamaCppBackend
from .config import Config, ModelSpec
from .costs import CostModel, cached_cost_model, cost_cache_key, reference_cost_model
from .drafters import Chain, Drafter, Retargetable, SelfTimed, is_free, members, own_backends
from .gguf_header import gguf_arch
from .kinds import DrafterKind
from .memory import MAX_SNAPSHOTS
from .paths import cache_dir
from .policy import DRAFT_MAX, AcceptanceStore, AdaptivePolicy, FixedPolicy, Policy
from .sources import resolve
from .template import ChatFormat, choose_format, render, template_from_file, template_from_text


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
    draft_tree: int = 0  # --draft-tree: the target's context holds one sequence per leaf (n_seq_max)
    # --chat-template / --chat-template-file (None: models.toml's, else the GGUF's) and --chat-template-kwargs
    chat_template: ChatFormat | None = None
    chat_template_kwargs: dict | None = None


@dataclass
class Loaded:
    target: Backend
    drafter: Drafter | Chain | None
    target_spec: ModelSpec
    draft_spec: ModelSpec | None  # the -md file's, where a drafter is built from one
    drafter_label: str  # "prompt-lookup", "mtp", a draft model's name, "prompt-lookup + NAME" (a chain), or "none"
    # why drafting is off although a drafter was asked for (one line for the user), or None
    drafting_off: str | None = None
    # how each drafter (each chain member, in order) was built, to build it again on another target
    # (/rpc off); empty where a caller made the drafter itself
    builds: tuple[Build, ...] = ()
    opts: LoadOptions | None = None

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` in the target's chat template (or the fallback for base models)."""
        return render(self.target, messages).token_ids

    def policy(self, draft_max: int | None = None, draft_fixed: int | None = None):
        """The draft-length policy the CLI would use (adaptive unless draft_fixed is given; draft_max
        defaults to --draft-max's default)."""
        return make_policy(self, DRAFT_MAX if draft_max is None else draft_max, draft_fixed)

    def memory_line(self) -> str | None:
        """How each model's cache is cut after a rejected draft, when one is recurrent (None otherwise):
        the chat header and `prompt --stats` show it."""
        backends = [("target", self.target)] + [("draft", b) for b in own_backends(self.drafter)]
        if not any(b.memory.recurrent for _, b in backends):
            return None
        line = "memory: " + " · ".join(f"{role} {b.memory.describe()}" for role, b in backends)
        return line + (f" · {self.drafting_off}" if self.drafting_off else "")

    def target_here(self) -> Backend:
        """`/rpc off`: load the target again on this machine, with the options it was loaded with (-c, -ngl
        as given, -fa, its MTP layers), and let go of the one on the RPC workers, abandoned (never freed)
        when a worker was already gone: freeing its buffers there would abort. A drafter that reads the
        target's context (a head) is built again on the new target by its kind's factory; the others
        keep their own model and are pointed at the new target (`retarget`)."""
        remote = self.target
        opts = self.opts or LoadOptions()
        gone = rpc_workers.unreachable(remote.rpc)
        local = LlamaCppBackend(remote.path, n_ctx=remote.n_ctx, n_gpu_layers=opts.n_gpu_layers,
                                n_threads=remote.n_threads, name=remote.name, flash_attn=remote.flash_attn,
                                snapshots=remote.memory.snapshots, mtp=remote.mtp_loaded, outputs=remote.outputs)
        try:
            drafters = list(members(self.drafter)) if self.drafter is not None else []
            rebuilt = []
            for i, drafter in enumerate(drafters):
                if drafter.kind.reads_target:
                    if i >= len(self.builds):
                        raise BackendError(f"cannot move the {drafter.kind.label} off the RPC workers: "
                                           "restart without --rpc")
                    rebuilt.append((i, drafter.kind.build(replace(self.builds[i], target=local))))
        except BaseException:
            local.close()
            raise
        for i, drafter in rebuilt:
            old = drafters[i]
            if gone:  # its context lives on the dead worker's weights
                rpc_workers.abandon(old.backend)
            else:
                old.backend.close()
            drafters[i] = drafter
        for drafter in drafters:
            if isinstance(drafter, Retargetable):
                drafter.retarget(local)
        local.chat_format = getattr(remote, "chat_format", None)
        if gone:
            rpc_workers.abandon(remote)
        else:
            remote.close()
        self.target = local
        self.builds = tuple(replace(b, target=local) for b in self.builds)
        if drafters:
            self.drafter = drafters[0] if len(drafters) == 1 else Chain(drafters)
        return local

    def close(self) -> None:
        # the drafters first: an MTP head's context lives on the target's weights
        for backend in (*own_backends(self.drafter), self.target):
            backend.close()




@dataclass(frozen=True)
class Selection:
    target: str
    # the drafter's ref (a model name, path or hub ref, or a kind's word: prompt-lookup, mtp), several for a
    # chain (in the order a fixed draft length asks them), or None (no speculation)
    draft: str | tuple[str, ...] | None
    rpc: tuple[str, ...] = ()  # the pair's `rpc` workers, when the pair picked the target
    # the kind the -md file must be (--spec-type draft-eagle3: an EAGLE-3 head), or None: any
    file_kind: DrafterKind | None = None

    @property
    def drafts(self) -> tuple[str, ...]:
        if self.draft is None:
            return ()
        return (self.draft,) if isinstance(self.draft, str) else tuple(self.draft)


def select(config: Config, *, pair: str | None, target: str | None, draft: str | None, no_spec: bool,
           hybrid: bool | None = None, spec_types: tuple[DrafterKind, ...] = ()) -> Selection:
    """--pair picks both; -m / -md override either part. -m alone drafts with prompt lookup, which needs
    no second model; --no-spec drops the drafter. --hybrid / --no-hybrid put prompt lookup in front of a
    draft model or take it out (a pair's `lookup`). `spec_types` (--spec-type, llama.cpp's names, checked
    by the runner) make the chain: each kind in order, a file kind drafting with -md (or the pair's model)."""
    rpc: tuple[str, ...] = ()
    pair_drafts: tuple[str, ...] = ()
    if pair is not None or target is None:
        chosen = config.pair(pair or "default")
        rpc = chosen.rpc if target is None else ()
        target = target or chosen.target
        pair_drafts = chosen.drafts
    front = kinds.HYBRID_FRONT.word
    file_kind = next((k for k in spec_types if k.needs_file), None)
    if spec_types:
        model = draft or next((d for d in pair_drafts if kinds.by_word(d) is None), None)
        drafts = tuple(dict.fromkeys(model if k.needs_file else k.word for k in spec_types))
    elif draft is not None:
        drafts = (draft,)
    else:
        drafts = pair_drafts or (kinds.DEFAULT.word,)
    if hybrid is not None and any(d != front for d in drafts):
        drafts = ((front,) if hybrid else ()) + tuple(d for d in drafts if d != front)
    if no_spec or not drafts:
        return Selection(target, None, rpc)
    return Selection(target, drafts[0] if len(drafts) == 1 else drafts, rpc, file_kind)


@dataclass
class Build:
    """What a kind's factory (kinds.DrafterKind.factory) gets: the target, the options, a status line, and
    for a kind built from a file (-md), its spec and path."""

    target: LlamaCppBackend
    target_spec: ModelSpec
    opts: LoadOptions
    threads: int
    status: Callable[[str], None]
    spec: ModelSpec | None = None
    path: Path | None = None


def load(
    config: Config,
    selection: Selection,
    opts: LoadOptions,
    status: Callable[[str], None] = lambda message: None,
) -> Loaded:
    """Resolve files (downloading hub refs), load the target, then each drafter of the selection, checking
    compatibility before a draft's weights are loaded into a context."""
    threads = opts.n_threads or default_threads()
    target_spec = config.model(selection.target)
    status(f"locating {target_spec.name}")
    target_path = resolve(target_spec)
    # which kind each drafter is: a word names one, a file is a draft model or what its architecture says
    planned: list[tuple[DrafterKind, ModelSpec | None, Path | None]] = []
    for ref in selection.drafts:
        kind = kinds.by_word(ref)
        if kind is not None:
            planned.append((kind, None, None))
            continue
        spec = config.model(ref)
        status(f"locating draft {spec.name}")
        path = resolve(spec)
        kind = kinds.for_suffix(path.name) or kinds.for_file(gguf_arch(path))
        if selection.file_kind is not None and kind is not selection.file_kind:
            what = kind.label if kind.suffixes else f"{gguf_arch(path)} model"
            raise BackendError(f"--spec-type {selection.file_kind.spec_types[0]}: {spec.name} is a "
                               f"{what}, not {'an' if selection.file_kind.label[0] in 'AEIOU' else 'a'} "
                               f"{selection.file_kind.label}")
        planned.append((kind, spec, path))
    # --rpc wins over the pair's `rpc`, which wins over the model's
    rpc = opts.rpc if opts.rpc is not None else (selection.rpc or target_spec.rpc)
    status(f"loading target {target_spec.name}" + (f" onto RPC {','.join(rpc)}" if rpc else ""))
    target_options = {key: value for kind, _, _ in planned for key, value in kind.target_options.items()}
    target = LlamaCppBackend(
        target_path, n_ctx=opts.n_ctx, n_gpu_layers=opts.n_gpu_layers, n_threads=threads, name=target_spec.name,
        rpc=rpc, flash_attn=opts.flash_attn, snapshots=min(max(opts.draft_max, 0), MAX_SNAPSHOTS),
        outputs=max(opts.draft_max, opts.draft_tree, 0) + 1 if planned else 1, **target_options,
    )
    target.chat_format = target_format(target, target_spec, opts)
    built: list[tuple[Drafter, str]] = []
    try:
        if not planned:
            return Loaded(target, None, target_spec, None, "none", opts=opts)
        if target.memory.kind == "none":  # every rejected draft would re-read the conversation
            return Loaded(target, None, target_spec, None, "none", drafting_off=_cannot_cut(target))
        draft_spec = next((spec for _, spec, _ in planned if spec is not None), None)
        off: list[str] = []
        builds: list[Build] = []
        for kind, spec, path in planned:
            build = Build(target, target_spec, opts, threads, lambda message: None, spec, path)
            drafter = kind.build(replace(build, status=status))
            if drafter.backend is not None and drafter.backend.memory.kind == "none":
                off.append(_cannot_cut(drafter.backend))
                drafter.backend.close()
                continue
            built.append((drafter, spec.name if spec is not None else (kind.word or kind.name)))
            builds.append(build)
        if not built:
            return Loaded(target, None, target_spec, None, "none", drafting_off=off[0] if off else None)
        note = None
        if off:  # the rest of the chain drafts: say which drafter is off
            note = off[0].replace("drafting off", f"that drafter is off; {' + '.join(n for _, n in built)} drafts")
        drafter = built[0][0] if len(built) == 1 else Chain([d for d, _ in built])
        return Loaded(target, drafter, target_spec, draft_spec, " + ".join(n for _, n in built), drafting_off=note,
                      builds=tuple(builds), opts=opts)
    except BaseException:
        for drafter, _ in built:
            if drafter.backend is not None:
                drafter.backend.close()
        target.close()
        raise


def target_format(target: Backend, spec: ModelSpec, opts: LoadOptions) -> ChatFormat:
    """The flags' chat template, else the model's in models.toml, else the GGUF's; kwargs likewise (the
    flag's over the file's, key by key)."""
    configured = None
    if opts.chat_template is None:  # models.toml's is read only when it is used
        where = f"{spec.origin} [models.{spec.name}]"
        if spec.chat_template_file:
            configured = template_from_file(spec.chat_template_file, f"{where} chat_template_file")
        elif spec.chat_template:
            configured = template_from_text(spec.chat_template, f"{where} chat_template")
    return choose_format(target.chat_template, chosen=opts.chat_template, configured=configured,
                         kwargs=opts.chat_template_kwargs, configured_kwargs=spec.chat_template_kwargs)


def _cannot_cut(backend: Backend) -> str:
    return (f"drafting off: {backend.name}'s recurrent state ({backend.memory.arch}) can be neither cut back nor "
            "copied by this llama.cpp, so every rejected draft would re-read the whole conversation")


# -- the policy ---------------------------------------------------------------------------------------


def _file_size(backend) -> int | None:
    try:
        return Path(backend.path).stat().st_size if backend.path else None
    except OSError:
        return None


def _reference_draft_cost(drafter: Drafter, target: Backend, verify: CostModel) -> CostModel | None:
    """--reproducible: what a draft token costs, from no clock: a head is one or a few layers on the
    target's weights; a draft model costs its file's size relative to the target's."""
    if is_free(drafter):
        return None
    if drafter.kind.cost in ("head", "block"):  # (a block: one forward of a head-sized model)
        return CostModel([1], [verify(1) * 0.1], measured=True)
    sizes = _file_size(drafter.backend), _file_size(target)
    ratio = min(1.0, max(0.02, sizes[0] / sizes[1])) if all(sizes) else 0.25
    return CostModel([1], [verify(1) * ratio], measured=True)


def make_policy(loaded: Loaded, draft_max: int, draft_fixed: int | None, *, remember: bool = True,
                reproducible: bool = False, notify: Callable[[str, float, str], None] | None = None) -> Policy:
    """The policy a command runs with: none without a drafter, fixed with --draft-fixed, else adaptive,
    each drafter starting from the estimates earlier runs saved for this target and it (unless
    remember=False).

    reproducible (--reproducible): adaptive, but its draft lengths depend only on the tokens: fixed
    reference costs instead of timings (nothing measured, nothing learned from the clock) and no
    estimates read from or saved for other runs. `notify(model, seconds, again)` is called before a
    calibration (the first run on a machine, or a saved one measured again: costs.cached_cost_model)."""
    if loaded.drafter is None or draft_max == 0:
        return FixedPolicy(0)
    if draft_fixed is not None:
        return FixedPolicy(draft_fixed)
    drafters = members(loaded.drafter)
    if reproducible:
        verify = reference_cost_model()
        costs = [_reference_draft_cost(d, loaded.target, verify) for d in drafters]
        return AdaptivePolicy(loaded.drafter, verify, draft_max=draft_max, draft_costs=costs, learn_costs=False)
    cache_file = cache_dir() / "costs.json"
    verify = cached_cost_model(loaded.target, cache_file, notify)
    costs: list[CostModel | None] = []
    stores: list[AcceptanceStore | None] = []
    for drafter in drafters:
        timed = drafter.backend is not None and not is_free(drafter)
        if isinstance(drafter, SelfTimed):
            costs.append(drafter.draft_cost())
        else:
            costs.append(cached_cost_model(drafter.backend, cache_file, notify) if timed else None)
        store = None
        if remember and drafter.carried():  # (lookup carries nothing over: the file is not even read)
            drafter_id = drafter.kind.name + (f":{cost_cache_key(drafter.backend)}" if drafter.backend is not None else "")
            label = f"{loaded.target.name} + {drafter.kind.name}" + (f" {drafter.backend.name}" if drafter.backend else "")
            store = AcceptanceStore(cache_dir() / "acceptance.json", f"{cost_cache_key(loaded.target)}|{drafter_id}", label)
        stores.append(store)
    return AdaptivePolicy(loaded.drafter, verify, draft_max=draft_max, draft_costs=costs, stores=stores)
