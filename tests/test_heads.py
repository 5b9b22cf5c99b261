"""Drafting heads that read the target's hidden states: the target's own MTP (NextN) layers (`-md mtp`) and
EAGLE-3 heads (`-md HEAD.gguf`, arch `eagle3`).

On fakes: the head drafter's min(1, p/q) path is lossless, and a head fed the right hidden state is a
perfect predictor here (q == p, every draft accepted, drafts distributed as the target's tokens), while
the same head fed another position's state fails that check. On the real llama.cpp: a tiny qwen35 (hybrid,
recurrent-state snapshots) with one NextN block, and a tiny EAGLE-3 head for a 4-layer llama target
(tests/tiny_models.py); greedy output is the target's argmax everywhere, nothing is re-read, chat turns
evaluate only their new tokens in both contexts, a wrong pairing collapses acceptance, and heads that do not
fit (no MTP layers, another vocabulary, width or layer ids) are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
from fakes import ALPHA, FakeBackend, assert_user_error, chi2_pvalue

from specchat import Conversation
from specchat.backend import BackendError
from specchat.drafters import HeadDrafter
from specchat.engine import Finished, StepEvent, TokenEvent, generate
from specchat import kinds
from specchat.drafters import ModelDrafting
from specchat.heads import Eagle3Head, MtpHead
from specchat.memory import MemoryKind
from specchat.policy import AdaptivePolicy, FixedPolicy
from specchat.sampling import SamplingParams, process

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

# -- fakes: a second-order target and a head that reads its hidden state ----------------------------------

V = 5  # vocabulary
PROMPT = [1, 3, 2, 4]
DRAWS = 6_000


def _table(seed: int) -> np.ndarray:
    """p(next | previous, current): rows for previous = 0..V-1 and V (no previous token)."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(V) * 0.7, size=(V + 1, V))


TABLE = _table(3)


def _logits(prev: int, cur: int) -> np.ndarray:
    return np.log(TABLE[prev, cur]).astype(np.float32)


def _target_logits(ctx: tuple[int, ...]) -> np.ndarray:
    return _logits(ctx[-2] if len(ctx) >= 2 else V, ctx[-1])


def encode(prev: int, cur: int) -> np.ndarray:
    """A hidden row that says (previous token, current token); a zero half = unknown."""
    row = np.zeros(2 * V, dtype=np.float32)
    if prev < V:
        row[prev] = 1.0
    row[V + cur] = 1.0
    return row


class HiddenTarget(FakeBackend):
    """A second-order Markov target whose decodes hand over a hidden row per token, as
    LlamaCppBackend.capture_hidden does: h_j encodes (x_{j-1}, x_j)."""

    def __init__(self):
        super().__init__(_target_logits, V)
        self.sink = None

    def capture_hidden(self, sink) -> None:
        self.sink = sink

    def stop_capture(self) -> None:
        self.sink = None

    def eval(self, tokens, logits_at, *, in_place=False):
        start = len(self.tokens)
        rows = super().eval(tokens, logits_at, in_place=in_place)
        if self.sink is not None:
            ctx = self.tokens
            self.sink(start, np.stack([encode(ctx[j - 1] if j else V, ctx[j]) for j in range(start, len(ctx))]))
        return rows


class FakeHead:
    """An MTP-like head: its entry (token x_j, state h) predicts x_{j+1} from the (previous, current) pair it
    can read off h and x_j, and hands back its own state encode(h's current, x_j) for a chained draft. Fed
    the right state (h_{j-1}) it is exactly the target's distribution."""

    def __init__(self, n_ctx: int = 4096):
        self.n_embd = 2 * V
        self.n_vocab, self.n_ctx = V, n_ctx
        self.tokens: list[int] = []
        self.hidden = np.zeros((0, self.n_embd), dtype=np.float32)
        self.evaluated = self.rollback_recoveries = self.reevaluated = 0
        self.rollback_seconds = 0.0
        self.memory = MemoryKind("kv")
        self.name, self.path, self.n_threads, self.n_gpu_layers, self.rpc = "fake-head", None, 0, 0, ()
        self.calls: list[int] = []  # tokens per eval

    def eval(self, tokens, logits_at, *, in_place=False, states=None):
        states = np.zeros((len(tokens), self.n_embd), np.float32) if states is None else states
        self.calls.append(len(tokens))
        rows, hidden = [], []
        for i in logits_at:
            state = states[i]
            prev = int(np.argmax(state[V:])) if state[V:].any() else V
            rows.append(_logits(prev, tokens[i]))
            hidden.append(encode(prev, tokens[i]))
        self.tokens.extend(int(t) for t in tokens)
        self.evaluated += len(tokens)
        self.hidden = np.array(hidden, dtype=np.float32).reshape(len(hidden), self.n_embd)
        return np.array(rows, dtype=np.float32).reshape(len(rows), V)

    def truncate(self, n_keep):
        del self.tokens[n_keep:]

    def checkpoint(self, batch=None, *, turn=False):
        pass


class MisPaired(HeadDrafter):
    """A head drafter that pairs the entry of x_j with the row of x_{j-1-offset}: a wrong pairing for
    offset != 0 (the right one for 0)."""

    def __init__(self, head, target, offset: int, **kw):
        super().__init__(head, target, **kw)
        self.offset = offset

    def row_of(self, entry: int) -> int:
        return super().row_of(entry) - self.offset


def fake_pair(pair_offset: int = 0):
    target = HiddenTarget()
    return target, MisPaired(FakeHead(), target, pair_offset)


def expected_first_two() -> np.ndarray:
    p1 = np.asarray(process(_target_logits(tuple(PROMPT)), SAMPLED, PROMPT))
    joint = np.zeros((V, V))
    for a in range(V):
        joint[a] = p1[a] * np.asarray(process(_target_logits(tuple(PROMPT + [a])), SAMPLED, PROMPT + [a]))
    return joint


def head_check(pair_offset: int, draws: int = DRAWS) -> dict:
    """Sampled runs at forced k = 2: the first two emitted tokens (losslessness), the first step's two draft
    tokens (what the head proposed), and how many drafts were accepted."""
    rng = np.random.default_rng(11)
    emitted = np.zeros((V, V), dtype=np.int64)
    drafted = np.zeros((V, V), dtype=np.int64)
    n_drafted = n_accepted = 0
    for _ in range(draws):
        target, drafter = fake_pair(pair_offset)
        original = drafter.propose
        first: list[list[int]] = []

        def propose(context, k, params, rng, original=original, first=first):
            draft = original(context, k, params, rng)
            if not first:
                first.append(list(draft.tokens))
            return draft

        drafter.propose = propose
        got = []
        gen = generate(target, drafter, PROMPT, SAMPLED, max_tokens=6, policy=FixedPolicy(2), rng=rng)
        for event in gen:
            if isinstance(event, TokenEvent) and len(got) < 2:
                got.append(event.id)
            if isinstance(event, StepEvent):
                n_drafted += event.stats.drafted
                n_accepted += event.stats.accepted
        emitted[got[0], got[1]] += 1
        drafted[first[0][0], first[0][1]] += 1
    return {"emitted": emitted, "drafted": drafted, "acceptance": n_accepted / n_drafted}


def test_head_drafts_are_lossless_and_read_the_right_hidden_state():
    """min(1, p/q) with the head's q: the emitted tokens follow the target's joint distribution. Fed h_{j-1}
    with x_j (llama.cpp's pairing), this head is the target itself: its drafts follow the same joint and
    every one is accepted (p / q = 1)."""
    result = head_check(0)
    joint = expected_first_two()
    p_emit = chi2_pvalue(result["emitted"], joint)
    assert p_emit > ALPHA, f"p={p_emit:.2e}\n{result['emitted'] / DRAWS}\n{joint}"
    p_draft = chi2_pvalue(result["drafted"], joint)
    assert p_draft > ALPHA, f"p={p_draft:.2e}\n{result['drafted'] / DRAWS}\n{joint}"
    assert result["acceptance"] > 0.999


@pytest.mark.parametrize("offset", [1, -1])
def test_the_check_fails_a_head_fed_another_positions_state(offset):
    """The power of the check above: the head fed the previous position's row (offset 1), or the row of its
    own token (offset -1), still gives lossless output (min(1, p/q) holds for any q), but its drafts are not
    the target's distribution and many are rejected."""
    result = head_check(offset, draws=2_000)
    assert chi2_pvalue(result["emitted"], expected_first_two()) > ALPHA  # still lossless
    assert chi2_pvalue(result["drafted"], expected_first_two()) < 1e-6
    assert result["acceptance"] < 0.9


def test_head_catch_up_evaluates_each_entry_once():
    """The head's cache follows the context: after the prompt's entries (prefill), each step evaluates only
    the entries it lacks, and its own draft entries are cut again."""
    target, drafter = fake_pair()
    finished = list(generate(target, drafter, PROMPT, GREEDY, max_tokens=30, policy=FixedPolicy(3)))[-1]
    head = drafter.head
    context = PROMPT + finished.token_ids
    assert head.tokens == context[: len(head.tokens)]
    # every context entry once, plus k - 1 draft entries and at most k + 1 re-read entries per step
    assert head.evaluated <= len(context) + finished.stats.steps * (2 + 3)
    assert finished.stats.accepted == finished.stats.drafted  # the perfect head, greedy


def test_mtp_kind_is_learned_like_a_draft_model():
    target, drafter = fake_pair()
    assert drafter.kind is kinds.MTP and isinstance(drafter, ModelDrafting) and drafter.kind.cost == "head"
    assert drafter.backend is drafter.head


# -- the real llama.cpp: a tiny qwen35 with one MTP block ---------------------------------------------------

N = 240


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-mtp")
    target = tiny_models.write_model(directory / "qwen35-mtp.gguf", "qwen35",
                                     context=tiny_models.TARGET_CONTEXT["qwen35"], mtp=True)
    plain = tiny_models.write_model(directory / "qwen35.gguf", "qwen35", context=tiny_models.TARGET_CONTEXT["qwen35"])
    return target, plain


@pytest.fixture(scope="module")
def eagle_files(tmp_path_factory):
    """(a 4-layer llama target, its EAGLE-3 head, a quieter target for the pairing test, heads that do not fit)."""
    directory = tmp_path_factory.mktemp("tiny-eagle3")
    layers = tiny_models.EAGLE3_TARGET_LAYERS
    target = tiny_models.write_model(directory / "llama4.gguf", "llama", context=tiny_models.TARGET_CONTEXT["llama"],
                                     n_layer=layers)
    quiet = tiny_models.write_model(directory / "llama4-0.8.gguf", "llama", context=0.8, n_layer=layers)
    head = tiny_models.write_eagle3(directory / "eagle3.gguf")
    misfits = {
        "vocabulary": tiny_models.write_eagle3(directory / "eagle3-vocab.gguf", other_vocab=True),
        "width": tiny_models.write_eagle3(directory / "eagle3-wide.gguf", target_n_embd=128),
        "layers": tiny_models.write_eagle3(directory / "eagle3-layers.gguf", layers=(1, 2, 7)),
    }
    return target, head, quiet, misfits


@pytest.fixture(scope="module")
def quiet_mtp_file(tmp_path_factory):
    """A target whose context moves fewer argmaxes (context 0.6): the head's drafts are nearly all accepted."""
    return tiny_models.write_model(tmp_path_factory.mktemp("tiny-mtp-quiet") / "qwen35-mtp-0.6.gguf", "qwen35",
                                   context=0.6, mtp=True)


backend = tiny_models.load


def prompt(n: int = 20) -> list[int]:
    return tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), n)


def load_head(kind: str, path, head_path=None, pair_offset: int = 0):
    """(target, head, drafter) for "mtp" (the target's own layers) or "eagle3" (head_path)."""
    if kind == "mtp":
        target = backend(path, mtp=True)
        head = MtpHead(target)
    else:
        target = backend(path)
        head = Eagle3Head(target, head_path)
    return target, head, MisPaired(head, target, pair_offset)


def head_run(kind: str, path, k: int, n: int = N, pair_offset: int = 0, head_path=None):
    target, head, drafter = load_head(kind, path, head_path, pair_offset)
    try:
        finished = list(generate(target, drafter, prompt(), GREEDY, max_tokens=n, policy=FixedPolicy(k)))[-1]
        return finished, target.memory, target.rollback_recoveries
    finally:
        head.close()
        target.close()


def mtp_run(path, k: int, n: int = N, pair_offset: int = 0):
    return head_run("mtp", path, k, n, pair_offset)


teacher_forced_gaps = tiny_models.teacher_forced_gaps


@pytest.mark.tiny
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_is_the_targets_argmax_and_never_rereads(mtp_files, k):
    """Forced k over 240 tokens on a hybrid target with snapshots: every emitted token is the target's argmax
    (teacher forced), no cut ever re-read the context, and the head is informative (most drafts accepted)."""
    path, _ = mtp_files
    finished, memory, recoveries = mtp_run(path, k)
    assert isinstance(finished, Finished) and len(finished.token_ids) == N
    assert memory.kind == "snapshots"
    stats = finished.stats
    assert stats.rollback_recoveries == 0 and recoveries == 0
    assert stats.drafted > 50 and 0 < stats.accepted < stats.drafted
    assert stats.accepted / stats.drafted > 0.5, (stats.accepted, stats.drafted)
    gaps = teacher_forced_gaps(path, prompt(), finished.token_ids)
    assert gaps.max() < 0.05, (int(gaps.argmax()), float(gaps.max()))


@pytest.mark.tiny
def test_mtp_wrong_pairing_collapses_acceptance(quiet_mtp_file):
    """The tiny MTP block needs h_{j-1} with x_j: paired with the row before (offset 1) or its own token's row
    (offset -1) its top choice is a tie between two or three tokens, and acceptance collapses (measured:
    100% right, 42% and 4% wrong)."""
    right = mtp_run(quiet_mtp_file, 3, n=120)[0].stats
    rate = right.accepted / right.drafted
    assert rate > 0.9, (right.accepted, right.drafted)
    for offset, most in ((1, 0.6), (-1, 0.2)):
        wrong = mtp_run(quiet_mtp_file, 3, n=120, pair_offset=offset)[0].stats
        assert wrong.accepted / wrong.drafted < most * rate, (offset, wrong.accepted, wrong.drafted, rate)


@pytest.mark.tiny
@pytest.mark.parametrize("k", [1, 3])
def test_eagle3_greedy_is_the_targets_argmax(eagle_files, k):
    """An EAGLE-3 head on a dense llama target, forced k over 240 tokens: every emitted token is the target's
    argmax, nothing re-read, most drafts accepted."""
    path, head_path, _, _ = eagle_files
    finished, memory, recoveries = head_run("eagle3", path, k, head_path=head_path)
    assert len(finished.token_ids) == N and memory.kind == "kv"
    stats = finished.stats
    assert stats.rollback_recoveries == 0 and recoveries == 0
    assert stats.drafted > 50 and 0 < stats.accepted < stats.drafted
    assert stats.accepted / stats.drafted > 0.5, (stats.accepted, stats.drafted)
    gaps = teacher_forced_gaps(path, prompt(), finished.token_ids)
    assert gaps.max() < 0.05, (int(gaps.argmax()), float(gaps.max()))


@pytest.mark.tiny
def test_eagle3_wrong_pairing_collapses_acceptance(eagle_files):
    """g_P must go with x_{P+1} (the deferred boundary): g of the token before, or of x_{P+1} itself, and the
    tiny head's top choice becomes a tie, acceptance collapses."""
    _, head_path, quiet, _ = eagle_files
    right = head_run("eagle3", quiet, 3, n=120, head_path=head_path)[0].stats
    rate = right.accepted / right.drafted
    assert rate > 0.9, (right.accepted, right.drafted)
    for offset, most in ((1, 0.6), (-1, 0.2)):
        wrong = head_run("eagle3", quiet, 3, n=120, pair_offset=offset, head_path=head_path)[0].stats
        assert wrong.accepted / wrong.drafted < most * rate, (offset, wrong.accepted, wrong.drafted, rate)


@pytest.mark.parametrize("misfit, needle", [
    ("vocabulary", "another vocabulary"), ("width", "hidden states of width 128"), ("layers", "target layers [1, 2, 7]"),
])
@pytest.mark.tiny
def test_eagle3_head_that_does_not_fit_is_a_clear_error(eagle_files, misfit, needle):
    path, _, _, misfits = eagle_files
    target = backend(path)
    try:
        with pytest.raises(BackendError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            Eagle3Head(target, misfits[misfit])
    finally:
        target.close()


@pytest.mark.tiny
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_chat_turns_evaluate_only_new_tokens_in_both_contexts(mtp_files, eagle_files, kind):
    """A two-turn chat with -md mtp (and with an EAGLE-3 head): turn two's prompt repeats turn one's
    conversation; the target evaluates only the new tokens and the head catches up on only those (plus the
    last step's few) before drafting."""
    path, head_path = (mtp_files[0], None) if kind == "mtp" else eagle_files[:2]
    target, head, drafter = load_head(kind, path, head_path)
    try:
        calls: list[tuple[int, int]] = []  # (entries the head held, entries evaluated) per eval
        original = head.eval

        def eval_(tokens, logits_at, **kw):
            calls.append((len(head.tokens), len(tokens)))
            return original(tokens, logits_at, **kw)

        head.eval = eval_
        chat = Conversation(target, drafter, params=GREEDY, max_tokens=40, policy=FixedPolicy(3))
        first = list(chat.send(" house garden river"))[-1]
        assert isinstance(first, Finished) and first.stats.drafted > 0
        held = list(chat.ids)
        calls.clear()
        second = list(chat.send(" again more"))[-1]
        assert isinstance(second, Finished)
        new = len(second.prompt_token_ids) - len(held)
        assert second.prompt_token_ids[: len(held)] == held
        assert second.stats.prompt_tokens_evaluated <= new + 2
        # the head's first catch-up of turn two starts past turn one's conversation
        kept, evaluated = calls[0]
        assert kept >= len(held) - 4 and evaluated <= new + 4, (kept, evaluated, new, len(held))
        assert min(k for k, _ in calls) >= len(held) - 4  # never re-read from the start
        assert target.rollback_recoveries == 0
    finally:
        head.close()
        target.close()


@pytest.mark.tiny
def test_the_policy_learns_the_heads_cost_like_a_draft_models(mtp_files, tmp_path, monkeypatch):
    """make_policy measures the head (cached apart from the target: same file, another cost) and the
    draft-model policy learns its per-token cost from the steps."""
    from specchat.loader import Loaded
    from specchat.costs import cost_cache_key
    from specchat.loader import make_policy

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    path, _ = mtp_files
    target = backend(path, mtp=True)
    head = MtpHead(target)
    try:
        drafter = HeadDrafter(head, target)
        loaded = Loaded(target, drafter, None, None, "mtp")
        policy = make_policy(loaded, 4, None, remember=False)
        assert isinstance(policy, AdaptivePolicy)
        draft_cost = policy.members[0].draft_cost
        assert draft_cost is not None
        assert cost_cache_key(head) != cost_cache_key(target)
        from specchat.stats import StepStats

        before = draft_cost.scale
        per_token = draft_cost.costs(1)[1]
        # a step whose 3 drafted tokens took 3x what the calibration says: the per-token cost goes up
        step = StepStats(step=0, drafted=3, accepted=2, emitted=3, decided=3, draft_seconds=9 * per_token,
                         verify_seconds=0.001, planned=3, source="mtp")
        # the head drafts this step, whatever its price on this tiny file (a probe: it was idle for ages)
        member = policy.members[0]
        member.possible, member.idle = True, 10**6
        target.eval([1, 2, 3, 4], [3])  # (the head reads the target's hidden rows of the context)
        sent = policy.draft(drafter, [1, 2, 3, 4], 3, SamplingParams(temperature=0.0), np.random.default_rng(0))
        assert sent.drafter is drafter and sent.tokens
        policy.observe(step, [1, 2, 4])
        # the probe's time includes catching the head up on the idle steps' tokens: not learned from
        assert draft_cost.scale == before
        policy._price = lambda member, offer: (3, 1.0)  # the next step drafts again, whatever its price
        target.eval([5, 6, 7], [2])
        sent = policy.draft(drafter, [1, 2, 3, 4, 5, 6, 7], 3, SamplingParams(temperature=0.0), np.random.default_rng(0))
        assert sent.drafter is drafter and sent.tokens
        policy.observe(step, [5, 6, 7])
        assert draft_cost.scale > before
    finally:
        head.close()
        target.close()


@pytest.mark.tiny
def test_a_head_the_policy_cannot_use_costs_the_target_nothing(mtp_files):
    """Where a head cannot pay even if always right (its tokens cost what the target's do), the policy never
    asks it: the target stops extracting the rows it reads until a policy that can use it resumes it; the
    text is the target's either way."""
    from specchat.costs import CostModel

    path, _ = mtp_files
    target, head, drafter = load_head("mtp", path)
    try:
        flat = CostModel([1, 2, 4, 8], [0.010, 0.0101, 0.0102, 0.0104])  # a GPU: verifying 8 ~ 1 token
        dear = CostModel([1], [0.02])  # a head token costs two target steps: it can never pay
        policy = AdaptivePolicy(drafter, flat, draft_max=4, draft_costs=[dear], learn_costs=False)
        assert not policy.drafting_possible and drafter.suspended and target.hidden_sink is None
        prompt = [int(t) for t in tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), 12)]
        suspended = [e.id for e in generate(target, drafter, prompt, GREEDY, max_tokens=24, policy=policy)
                     if isinstance(e, TokenEvent)]
        assert target.hidden_sink is None and drafter.hidden.known == 0  # no row was handed over
        cheap = AdaptivePolicy(drafter, flat, draft_max=4, draft_costs=[CostModel([1], [0.001])], learn_costs=False)
        assert cheap.drafting_possible and not drafter.suspended and target.hidden_sink is not None
        target.truncate(0)
        head.truncate(0)
        resumed = [e.id for e in generate(target, drafter, prompt, GREEDY, max_tokens=24, policy=FixedPolicy(3))
                   if isinstance(e, TokenEvent)]
        assert drafter.hidden.known > 0
        gaps = tiny_models.teacher_forced_gaps(path, prompt, suspended)
        assert gaps.max() < 0.05 and len(resumed) == len(suspended)
    finally:
        head.close()
        target.close()


@pytest.mark.tiny
def test_mtp_on_a_model_without_mtp_layers_is_a_clear_error(mtp_files):
    _, plain = mtp_files
    target = backend(plain, mtp=True)
    try:
        assert target.n_layer_nextn == 0
        with pytest.raises(BackendError, match="has no MTP layers"):
            MtpHead(target)
    finally:
        target.close()


# -- the command line --------------------------------------------------------------------------------------




@pytest.mark.tiny
def test_cli_mtp_runs(cli, mtp_files, tmp_path):
    path, _ = mtp_files
    result = cli("prompt", " house", "-m", str(path), "-md", "mtp", "--temp", "0", "-n", "24", "--json",
                 "--draft-fixed", "3", home=tmp_path)
    assert result.returncode == 0, result.stderr
    import json

    record = json.loads(result.stdout)
    assert record["stats"]["drafted"] > 0 and record["stats"]["rollback_recoveries"] == 0


@pytest.mark.tiny
def test_cli_hybrid_lookup_and_mtp(cli, mtp_files, tmp_path):
    """--hybrid: prompt lookup where the context repeats, the MTP head elsewhere, per step."""
    import json

    path, _ = mtp_files
    text = " " + " ".join(["house garden river"] * 3)
    result = cli("prompt", text, "-m", str(path), "-md", "mtp", "--hybrid", "--draft-fixed", "3", "--temp", "0",
                 "-n", "40", "--json", home=tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["drafter"] == "prompt-lookup + mtp"
    assert record["stats"]["drafted_by"].get("mtp", 0) > 0


@pytest.mark.tiny
def test_cli_spec_type_draft_mtp_is_md_mtp(cli, mtp_files, tmp_path):
    path, _ = mtp_files
    result = cli("prompt", " house", "-m", str(path), "--spec-type", "draft-mtp", "--temp", "0", "-n", "8",
                 "--json", "--draft-fixed", "2", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '"drafted"' in result.stdout


@pytest.mark.tiny
def test_cli_eagle3_head_runs(cli, eagle_files, tmp_path):
    path, head_path, _, _ = eagle_files
    for extra in ((), ("--spec-type", "draft-eagle3")):
        result = cli("prompt", " house", "-m", str(path), "-md", str(head_path), *extra, "--temp", "0", "-n", "24",
                     "--json", "--draft-fixed", "3", home=tmp_path)
        assert result.returncode == 0, result.stderr
        import json

        stats = json.loads(result.stdout)["stats"]
        assert stats["drafted"] > 0 and stats["accepted"] > 0


@pytest.mark.parametrize("misfit, needle", [
    ("vocabulary", "another vocabulary"), ("width", "trained for another target"), ("layers", "has layers 0..3"),
])
@pytest.mark.tiny
def test_cli_eagle3_head_that_does_not_fit(cli, eagle_files, tmp_path, misfit, needle):
    path, _, _, misfits = eagle_files
    assert_user_error(cli("prompt", " house", "-m", str(path), "-md", str(misfits[misfit]), home=tmp_path), needle)


@pytest.mark.tiny
def test_cli_spec_type_eagle3_with_a_draft_model(cli, eagle_files, tmp_path):
    path, _, quiet, _ = eagle_files
    assert_user_error(cli("prompt", " house", "-m", str(path), "-md", str(quiet), "--spec-type", "draft-eagle3",
                          home=tmp_path), "not an EAGLE-3 head")


@pytest.mark.tiny
def test_cli_mtp_without_mtp_layers(cli, mtp_files, tmp_path):
    _, plain = mtp_files
    assert_user_error(cli("prompt", " house", "-m", str(plain), "-md", "mtp", home=tmp_path),
                      "has no MTP layers", "llama_model_n_layer_nextn")


@pytest.mark.parametrize("args, needle", [
    (("--spec-type", "draft-mtp", "-md", "other.gguf"), "drop -md other.gguf"),
    (("--spec-type", "bogus"), "--spec-type 'bogus'"),
    (("--spec-type", "draft-eagle3"), "needs the EAGLE-3 head"),
    (("--spec-type", "ngram-simple", "-md", "mtp"), "drafts with prompt-lookup"),
])
@pytest.mark.tiny
def test_cli_spec_type_errors(cli, mtp_files, tmp_path, args, needle):
    path, _ = mtp_files
    assert_user_error(cli("prompt", " house", "-m", str(path), *args, home=tmp_path), needle)


@pytest.mark.tiny
def test_cli_a_llama_cpp_python_without_the_staging_api(cli, mtp_files, tmp_path, monkeypatch):
    """An older llama-cpp-python whose libllama lacks llama_set_embeddings_nextn: one line naming the version
    that has it."""
    import specchat.compat as compat_module

    monkeypatch.setattr(compat_module, "_nextn_api", None)
    monkeypatch.setitem(compat_module._NEXTN_SYMBOLS, "set_embeddings_nextn", "_Z_not_in_this_build")
    path, _ = mtp_files
    assert_user_error(cli("prompt", " house", "-m", str(path), "-md", "mtp", home=tmp_path),
                      "llama-cpp-python >= 0.3.36", "llama_set_embeddings_nextn")


@pytest.mark.tiny
def test_models_shows_mtp_layers_and_pairs_may_name_mtp(cli, mtp_files, eagle_files, tmp_path):
    path, plain = mtp_files
    config = tmp_path / "models.toml"
    config.write_text(
        f'[models.tiny-mtp]\npath = "{path}"\n[models.tiny]\npath = "{plain}"\n'
        f'[models.tiny-eagle3]\npath = "{eagle_files[1]}"\n'
        '[pairs.self]\ntarget = "tiny-mtp"\ndraft = "mtp"\n'
    )
    result = cli("models", home=tmp_path, env={"SPECCHAT_CONFIG": str(config), "COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "tiny-mtp" in line and "qwen35" in line)
    assert "MTP" in row
    plain_row = next(line for line in result.stdout.splitlines() if "│ tiny " in line)
    assert "MTP" not in plain_row
    eagle_row = next(line for line in result.stdout.splitlines() if "tiny-eagle3" in line)
    assert "EAGLE-3 head for a target of width 64, reading its layers 1, 2, 3" in eagle_row
    run = cli("prompt", " house", "--pair", "self", "--temp", "0", "-n", "8", "--json", home=tmp_path,
              env={"SPECCHAT_CONFIG": str(config)})
    assert run.returncode == 0, run.stderr
