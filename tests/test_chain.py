"""Drafters as plugins: chains of drafters chosen per step (llama.cpp's `--spec-type A,B` spelling), exact
whichever drafter wins a step, and a drafter kind registered from outside specchat/ that runs through
prompt, chat and report like the built-in ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_models
from fakes import ALPHA, Alternating, chi2_pvalue, detection_power, first_two_emitted, make_draft_model
from test_heads import SAMPLED, V, _target_logits, fake_pair

from specchat import kinds
from specchat.drafters import Chain, Draft, ModelDrafting
from specchat.engine import generate
from specchat.kinds import DrafterKind
from specchat.lookup import PromptLookup
from specchat.sampling import process

# -- losslessness: a chain of three, each token verified against its own drafter's q ---------------------------

PROMPT = [1, 3, 2, 4, 1, 3]  # "1 3" repeats: lookup has a match from the first step
DRAWS = 8_000
_noise = np.random.default_rng(5).normal(0, 0.9, (V, V)).astype(np.float32)


def _draft_logits(ctx: tuple[int, ...]) -> np.ndarray:
    """A stochastic draft model that guesses the second-order target roughly (first-order, with noise)."""
    return _target_logits(ctx) + _noise[ctx[-1]]


def expected_first_two() -> np.ndarray:
    p1 = np.asarray(process(_target_logits(tuple(PROMPT)), SAMPLED, PROMPT))
    joint = np.zeros((V, V))
    for a in range(V):
        ctx = PROMPT + [a]
        joint[a] = p1[a] * np.asarray(process(_target_logits(tuple(ctx)), SAMPLED, ctx))
    return joint


class ModelAsLookup(Alternating):
    """The control: every step goes to the draft model, whose tokens are then verified against the head's
    q at the same positions, i.e. against another drafter's q. (Verifying them as lookup's, q one-hot,
    would be no control: a proposal verified that way is exact however it was chosen.)"""

    def draft(self, drafter, context, limit, params, rng):
        head, model = drafter.members[1], drafter.members[-1]
        draft = model.propose(context, min(self.k, limit), params, rng)
        draft.drafter = model
        other = head.propose(context, len(draft.tokens), params, rng)
        draft.q = list(other.q) + [None] * (len(draft.tokens) - len(other.q))
        return draft


def chain_counts(policy_class, draws: int) -> tuple[np.ndarray, dict[str, int]]:
    """Sampled runs of a chain of lookup, a head (the target's own distribution) and a stochastic draft
    model, each run's first step handed to the next member in turn: the first two emitted tokens, and
    how many tokens each drafter drafted (counted as the policy hands the drafts over: the run stops
    reading events after two tokens, before the step's own StepEvent)."""
    rng = np.random.default_rng(17)
    counts = np.zeros((V, V), dtype=np.int64)
    drafted: dict[str, int] = {}

    class Counting(policy_class):
        def draft(self, drafter, context, limit, params, rng):
            draft = super().draft(drafter, context, limit, params, rng)
            if draft.tokens:
                drafted[draft.source] = drafted.get(draft.source, 0) + len(draft.tokens)
            return draft

    for i in range(draws):
        target, head = fake_pair()
        model, _ = make_draft_model(_draft_logits, V)
        chain = Chain([PromptLookup(1, 8), head, model])
        events = generate(target, chain, PROMPT, SAMPLED, max_tokens=4, policy=Counting(2, start=i), rng=rng)
        a, b = first_two_emitted(events)
        counts[a, b] += 1
    return counts, drafted


def test_a_chain_of_three_drafters_is_lossless():
    expected = expected_first_two()
    assert detection_power(DRAWS, expected, delta=0.03) >= 0.8
    counts, drafted = chain_counts(Alternating, DRAWS)
    assert set(drafted) == {"prompt-lookup", "mtp", "draft-model"}  # every member drafted first steps
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\n{counts / DRAWS}\n{expected}"


def test_the_chain_check_fails_a_token_verified_against_another_drafters_q():
    counts, _ = chain_counts(ModelAsLookup, 4_000)
    assert chi2_pvalue(counts, expected_first_two()) < 1e-6


# -- a chain on real llama.cpp files: the target's own text, greedy ----------------------------------------------


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory):
    """A hybrid target (qwen35) with an MTP layer, and a draft with its tokenizer (the same shapes, no MTP)."""
    directory = tmp_path_factory.mktemp("tiny-chain")
    context = tiny_models.TARGET_CONTEXT["qwen35"]
    target = tiny_models.write_model(directory / "qwen35-mtp.gguf", "qwen35", context=context, mtp=True)
    draft = tiny_models.write_model(directory / "qwen35.gguf", "qwen35", context=context)
    return target, draft


@pytest.mark.tiny
@pytest.mark.parametrize("spec_type, with_draft", [
    ("draft-mtp,ngram-simple", False),
    ("draft-simple,draft-mtp,ngram-simple", True),
])
def test_a_chain_in_llama_cpps_spelling_writes_the_targets_greedy_text(cli, mtp_files, tmp_path, spec_type, with_draft):
    target, draft = mtp_files
    prompt_ids = tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), 20)
    backend = tiny_models.load(target)
    try:
        text = b"".join(backend.token_bytes(t) for t in prompt_ids).decode("utf-8", "replace")
    finally:
        backend.close()
    args = ["prompt", text, "--raw", "-m", str(target), "--spec-type", spec_type, "--temp", "0", "-n", "48", "--json",
            "--ignore-eos", "--draft-fixed", "3"]
    if with_draft:
        args += ["-md", str(draft)]
    result = cli(*args, home=tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    names = ["prompt-lookup", "mtp"] if not with_draft else ["qwen35.gguf", "mtp", "prompt-lookup"]
    assert all(name in record["drafter"] for name in names) and record["drafter"].count(" + ") == len(names) - 1
    stats = record["stats"]
    assert stats["drafted"] > 0 and stats["rollback_recoveries"] == 0
    assert sum(stats["drafted_by"].values()) == stats["drafted"]
    generated = [t["id"] for t in record["tokens"]]
    gaps = tiny_models.teacher_forced_gaps(target, record["prompt_token_ids"], generated)
    assert gaps.max() < 0.05, (int(gaps.argmax()), float(gaps.max()))


@pytest.mark.parametrize("args, needle", [
    (("--spec-type", "draft-simple,draft-eagle3", "-md", "x.gguf"), "a chain takes one drafter from a file"),
    (("--spec-type", "ngram-simple,bogus"), "'bogus' is not one of"),
    (("--spec-type", "draft-mtp,ngram-mod", "-md", "x.gguf"), "drop -md x.gguf"),
])
def test_a_bad_chain_is_a_one_line_error(cli, tmp_path, args, needle):
    result = cli("prompt", "hi", "-m", str(tmp_path / "absent.gguf"), *args, home=tmp_path)
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# -- a kind registered from a test: one module and one entry, nothing in specchat/ changed ------------------------


class Echo(ModelDrafting):
    """Proposes the last k tokens of the context again (cheap, often wrong, always exact: q one-hot)."""

    def __init__(self):
        super().__init__()
        self.proposed = 0

    kind: DrafterKind
    backend = None

    def prefill(self, prompt_ids):
        pass

    def room(self) -> int:
        return 1 << 30

    def propose(self, context, k, params, rng) -> Draft:
        tokens = list(context[-k:]) if k > 0 else []
        self.proposed += len(tokens)
        return Draft(tokens, [None] * len(tokens), source=self.kind.name)


BUILT: list[Echo] = []


def _build_echo(build) -> Echo:
    drafter = Echo()
    BUILT.append(drafter)
    return drafter


@pytest.fixture
def echo_kind():
    kind = kinds.register(DrafterKind("echo-test", "echo", _build_echo, cost="free", spec_types=("echo-test",),
                                      word="echo-test", colour="yellow"))
    Echo.kind = kind
    BUILT.clear()
    yield kind
    del kinds.KINDS[kind.name]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_models.write_model(tmp_path_factory.mktemp("tiny-echo") / "llama.gguf", "llama")


@pytest.mark.tiny
def test_a_registered_kind_runs_through_prompt(cli, echo_kind, tiny_llama, tmp_path):
    result = cli("prompt", " house garden", "-m", str(tiny_llama), "-md", "echo-test", "--temp", "0", "-n", "16",
                 "--json", "--draft-fixed", "2", home=tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["drafter"] == "echo-test" and BUILT and BUILT[-1].proposed > 0
    assert record["stats"]["drafted_by"] == {"echo-test": record["stats"]["drafted"]}
    # and by llama.cpp's spelling, chained with lookup
    result = cli("prompt", " house garden", "-m", str(tiny_llama), "--spec-type", "ngram-simple,echo-test", "--temp",
                 "0", "-n", "16", "--json", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["drafter"] == "prompt-lookup + echo-test"


@pytest.mark.tiny
def test_a_registered_kind_runs_through_report(cli, echo_kind, tiny_llama, tmp_path):
    out = tmp_path / "report"
    result = cli("report", "-m", str(tiny_llama), "-md", "echo-test", "--sweep", "0,2", "--limit", "1", "-n", "8",
                 "--out", str(out), home=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads((out / "report.json").read_text())
    assert doc["drafter_kind"] == "echo-test" and BUILT[-1].proposed > 0


@pytest.mark.tiny
def test_a_registered_kind_runs_through_chat(cli, echo_kind, tiny_llama, tmp_path):
    result = cli("chat", "-m", str(tiny_llama), "-md", "echo-test", "--temp", "0", "-n", "12", "--draft-fixed", "2",
                 home=tmp_path, stdin="house garden\n/stats\n")
    assert result.returncode == 0, result.stderr
    shown = result.stdout + result.stderr
    assert "echo-test" in shown and BUILT and BUILT[-1].proposed > 0
