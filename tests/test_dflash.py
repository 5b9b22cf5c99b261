"""Block drafters (DFlash and DSpark, llama.cpp's `dflash` architecture): a whole draft from one forward of
[last token, mask, ...] over the target's injected layer inputs.

On fakes: sampled drafts are lossless, DSpark's Markov head included (each slot's q is conditioned on the
token actually drawn before it, not on the graph's argmax), and a check that verifies against the graph's
argmax-conditioned rows instead fails. On the real llama.cpp: tiny DFlash / DSpark drafts for a tiny target
(tests/tiny_models.py write_dflash), built so that llama.cpp's own draft-dflash accepts most of each block:
greedy output is the target's argmax with the block at any size up to the file's, features paired with the
wrong position collapse acceptance, a hybrid target chats across turns and an interrupted reply, files that
do not fit are one-line errors, and the CLI runs them alone and in a chain with lookup."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_models
from fakes import ALPHA, FakeBackend, ScriptedDrafter, assert_user_error, chi2_pvalue, detection_power, first_two_emitted
from test_heads import SAMPLED, V, _target_logits, encode

from specchat import Conversation
from specchat.backend import BackendError
from specchat.dflash import BlockDrafter, BlockHead
from specchat.engine import Finished, TokenEvent, generate
from specchat.memory import MemoryKind
from specchat.policy import AdaptivePolicy, FixedPolicy, Member
from specchat.costs import CostModel
from specchat.sampling import SamplingParams, process

GREEDY = SamplingParams(temperature=0.0)

# -- fakes: a second-order target, a block head whose Markov head chains on the graph's argmax -------------

PROMPT = [1, 3, 2, 4, 1, 3]  # (test_chain's: 6k draws see a 0.03 error in any cell 83% of the time)
RANK = 3
_rng = np.random.default_rng(11)
BASE = _rng.normal(0, 1.0, (V, V, 4, V)).astype(np.float32)  # [x_{P-1}, anchor, slot, token]
W1 = _rng.normal(0, 1.0, (V, RANK)).astype(np.float32)
W2 = _rng.normal(0, 1.0, (V, RANK)).astype(np.float32)


class FakeFile:
    def __init__(self, markov: bool):
        self.markov = markov
        self.confidence = False
        self.markov_weights = (W1, W2, None)


class FeatureTarget(FakeBackend):
    """The second-order target of test_heads, handing over a feature row per evaluated token (what
    capture_layers hands a DFlash head): encode(x_{j-1}, x_j)."""

    def __init__(self):
        super().__init__(_target_logits, V)
        self.sink = None

    def capture_layers(self, layers, sink) -> None:
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


class FakeBlockHead:
    """A block draft model as llama.cpp runs one: slot j's logits come from the last injected feature's token
    (x_{P-1}), the anchor and j; with a Markov head, plus w2 . w1[prev], prev being the anchor for the first
    read slot and the argmax of the row before it after that (the graph's greedy chain)."""

    def __init__(self, markov: bool, block_size: int = 4):
        self.file = FakeFile(markov)
        self.markov = markov
        self.anchor_first = markov
        self.block_size = block_size
        self.mask = V - 1
        self.n_embd_in = 2 * V
        self.n_vocab, self.n_ctx = V, 4096
        self.tokens: list[int] = []
        self.features: list[np.ndarray] = []
        self.evaluated = self.rollback_recoveries = self.reevaluated = 0
        self.rollback_seconds = 0.0
        self.memory = MemoryKind("kv")
        self.name, self.path, self.n_threads, self.n_gpu_layers, self.rpc = "fake-block", None, 0, 0, ()
        self.rows: np.ndarray | None = None  # the last block's graph rows (the control reads them)

    def attach(self, sink) -> None:
        self.target.capture_layers((0,), sink)

    def inject(self, tokens, features) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.features.extend(np.asarray(features))
        self.evaluated += len(tokens)

    def block(self, tokens, read):
        last = self.features[len(self.tokens) - 1] if self.tokens else np.zeros(2 * V)
        before = int(np.argmax(last[V:]))
        anchor = int(tokens[0])
        rows, prev = [], anchor
        for j in read:
            row = BASE[before, anchor, j].copy()
            if self.markov:
                row += W2 @ W1[prev]
                prev = int(np.argmax(row))
            rows.append(row)
        self.tokens.extend(int(t) for t in tokens)
        self.evaluated += len(tokens)
        self.rows = np.array(rows, dtype=np.float32)
        return self.rows.copy()

    def truncate(self, n_keep):
        del self.tokens[n_keep:]
        del self.features[n_keep:]

    def checkpoint(self, batch=None, *, turn=False):
        pass


def fake_block(markov: bool):
    target = FeatureTarget()
    head = FakeBlockHead(markov)
    head.target = target
    return target, BlockDrafter(head, target)


def expected_first_two() -> np.ndarray:
    p1 = np.asarray(process(_target_logits(tuple(PROMPT)), SAMPLED, PROMPT))
    joint = np.zeros((V, V))
    for a in range(V):
        ctx = PROMPT + [a]
        joint[a] = p1[a] * np.asarray(process(_target_logits(tuple(ctx)), SAMPLED, ctx))
    return joint


class GraphQ(FixedPolicy):
    """The control: the block's tokens drawn as specchat draws them, but verified against the graph's rows,
    whose Markov bias follows the previous slot's argmax, not the token drawn there."""

    def draft(self, drafter, context, limit, params, rng):
        draft = super().draft(drafter, context, limit, params, rng)
        rows = drafter.head.rows
        draft.q = [process(rows[i], params, list(context) + draft.tokens[:i]) for i in range(len(draft.tokens))]
        return draft


def block_counts(markov: bool, policy_class, draws: int) -> np.ndarray:
    rng = np.random.default_rng(23)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(draws):
        target, drafter = fake_block(markov)
        a, b = first_two_emitted(generate(target, drafter, PROMPT, SAMPLED, max_tokens=4, policy=policy_class(3), rng=rng))
        counts[a, b] += 1
    return counts


DRAWS = 6_000


@pytest.mark.parametrize("markov", [False, True], ids=["dflash", "dspark"])
def test_sampled_block_drafts_are_lossless(markov):
    expected = expected_first_two()
    assert detection_power(DRAWS, expected, delta=0.03) >= 0.8
    pvalue = chi2_pvalue(block_counts(markov, FixedPolicy, DRAWS), expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}"


def test_the_check_fails_dspark_tokens_verified_against_the_graphs_argmax_chain():
    assert chi2_pvalue(block_counts(True, GraphQ, 4_000), expected_first_two()) < 1e-6


def test_a_block_draft_is_one_forward_and_the_block_entries_are_cut():
    """The head holds exactly the context before the last token after every step (the block's entries are
    noise); a draft of k tokens is one eval of k + 1 slots (DFlash) or k (anchor-first DSpark)."""
    for markov, extra in ((False, 1), (True, 0)):
        target, drafter = fake_block(markov)
        head = drafter.head
        sizes, held = [], []
        original_block, original_propose = head.block, drafter.propose
        head.block = lambda tokens, read: (sizes.append(len(tokens)), original_block(tokens, read))[1]

        def propose(context, k, params, rng):
            draft = original_propose(context, k, params, rng)
            held.append(head.tokens == list(context[:-1]))
            assert len(draft.tokens) == k
            return draft

        drafter.propose = propose
        finished = list(generate(target, drafter, PROMPT, GREEDY, max_tokens=12, policy=FixedPolicy(3)))[-1]
        assert isinstance(finished, Finished) and finished.stats.drafted > 0
        assert held and all(held)
        assert len(sizes) == len(held)  # one forward a draft
        assert max(sizes) == 3 + extra and sum(sizes) == finished.stats.drafted + extra * len(sizes)
        assert drafter.extra_slots == extra and drafter.max_tokens == head.block_size - extra


def test_the_policy_prices_a_block_as_one_forward():
    """A block drafter's k tokens cost its model's forward of the block, not k forwards."""
    target, drafter = fake_block(False)
    block_cost = CostModel([1, 8], [0.002, 0.004], measured=False)
    member = Member(drafter, block_cost)
    seconds = member.draft_seconds(6)
    assert seconds[0] == 0.0
    assert seconds[1:] == pytest.approx([block_cost(n + 1) for n in range(1, 7)])
    one_token_model = Member(ScriptedDrafter(), block_cost)
    assert one_token_model.draft_seconds(6)[6] == pytest.approx(6 * block_cost(1))


def test_the_policy_learns_a_blocks_cost_at_the_size_it_ran():
    """Timings of block drafts update the draft's cost model at the block's size (its extra slot included),
    the size asked for, and the policy drafts with a block drafter whose drafts are right."""
    target, drafter = fake_block(False)
    verify = CostModel([1, 2, 4, 8], [0.010, 0.011, 0.012, 0.014], measured=False)
    draft_cost = CostModel([1, 4, 8], [0.001, 0.0012, 0.0015], measured=False)
    learned = []
    original = draft_cost.update
    draft_cost.update = lambda n, seconds, weight=0.1: (learned.append(n), original(n, seconds, weight))[1]
    policy = AdaptivePolicy(drafter, verify, draft_max=8, draft_costs=[draft_cost])
    sizes = []
    original_block = drafter.head.block
    drafter.head.block = lambda tokens, read: (sizes.append(len(tokens)), original_block(tokens, read))[1]
    finished = list(generate(target, drafter, PROMPT, GREEDY, max_tokens=40, policy=policy))[-1]
    assert finished.stats.drafted > 0 and learned
    assert sorted(set(learned)) == sorted(set(sizes))  # every timing at a size a block really ran at


# -- tiny llama.cpp files --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dflash_files(tmp_path_factory):
    """(llama target, its DFlash draft, its DSpark draft, qwen35 (hybrid) target, drafts that do not fit)."""
    directory = tmp_path_factory.mktemp("tiny-dflash")
    target = tiny_models.write_dflash_target(directory / "llama.gguf")
    hybrid = tiny_models.write_dflash_target(directory / "qwen35.gguf", "qwen35")
    dflash = tiny_models.write_dflash(directory / "dflash.gguf")
    dspark = tiny_models.write_dflash(directory / "dspark.gguf", markov=3.0)
    misfits = {
        "layers": tiny_models.write_dflash(directory / "dflash-layers.gguf", layers=(0, 5)),
        "width": tiny_models.write_dflash(directory / "dflash-wide.gguf", block_size=6),
    }
    return target, dflash, dspark, hybrid, misfits


backend = tiny_models.load
N = 64


def prompt(n: int = 24) -> list[int]:
    return tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), n)


class MisPaired(BlockDrafter):
    """Injects the features of the position `offset` before each entry's own."""

    def __init__(self, head, target, offset: int):
        super().__init__(head, target)
        self.offset = offset

    def features_at(self, positions: range) -> np.ndarray:
        return self.features.states(range(positions.start - self.offset, positions.stop - self.offset))


def block_run(target_path, draft_path, k: int, n: int = N, offset: int = 0, params=GREEDY):
    target = backend(target_path)
    head = BlockHead(target, draft_path)
    try:
        drafter = MisPaired(head, target, offset)
        finished = list(generate(target, drafter, prompt(), params, max_tokens=n, policy=FixedPolicy(k)))[-1]
        return finished, target.rollback_recoveries
    finally:
        head.close()
        target.close()


@pytest.mark.tiny
@pytest.mark.parametrize("which, k", [("dflash", 3), ("dflash", 7), ("dspark", 8)])
def test_greedy_block_drafts_are_the_targets_argmax(dflash_files, which, k):
    """Forced k (up to the whole block) over 64 tokens: every emitted token is the target's argmax (teacher
    forced), nothing re-read, and the tiny draft is informative: most of its tokens are accepted (llama.cpp's
    own draft-dflash accepts ~80% of them on these files)."""
    target_path, dflash, dspark, _, _ = dflash_files
    finished, recoveries = block_run(target_path, dflash if which == "dflash" else dspark, k)
    stats = finished.stats
    assert len(finished.token_ids) == N and stats.rollback_recoveries == 0 and recoveries == 0
    assert stats.drafted > 30 and stats.accepted / stats.drafted > 0.6, (stats.accepted, stats.drafted)
    gaps = tiny_models.teacher_forced_gaps(target_path, prompt(), finished.token_ids)
    assert gaps.max() < 0.05, (int(gaps.argmax()), float(gaps.max()))


@pytest.mark.tiny
def test_features_paired_with_another_position_collapse_acceptance(dflash_files):
    target_path, dflash, _, _, _ = dflash_files
    right = block_run(target_path, dflash, 3, n=32)[0].stats
    rate = right.accepted / right.drafted
    assert rate > 0.6, (right.accepted, right.drafted)
    for offset in (1, -1):
        wrong = block_run(target_path, dflash, 3, n=32, offset=offset)[0].stats
        assert wrong.accepted / wrong.drafted < 0.2 * rate, (offset, wrong.accepted, wrong.drafted, rate)


@pytest.mark.tiny
def test_dspark_tokens_drawn_off_the_graphs_chain_get_their_markov_bias_moved(dflash_files):
    """A banned token (as --ignore-eos bans end-of-generation) is the graph's argmax at some slots: the token
    drawn there is another, the next slot's Markov bias is moved to it (from the file's own weights), and the
    text is still the target's own (its greedy text under the same ban)."""
    target_path, _, dspark, _, _ = dflash_files
    banned = GREEDY.__class__(temperature=0.0, banned=(prompt(30)[26],))  # a token the text reaches soon
    plain = block_run(target_path, dspark, 0, n=48, params=banned)[0]
    target = backend(target_path)
    head = BlockHead(target, dspark)
    try:
        drafter = BlockDrafter(head, target)
        moved = []
        original = drafter._markov_bias
        drafter._markov_bias = lambda prev: (moved.append(prev), original(prev))[1]
        finished = list(generate(target, drafter, prompt(), banned, max_tokens=48, policy=FixedPolicy(6)))[-1]
        assert finished.token_ids == plain.token_ids and finished.stats.drafted > 0
        assert moved and banned.banned[0] in moved  # the graph's prev (the banned argmax) taken back out
        w1, w2, d2t = head.file.markov_weights
        assert w1.shape == (tiny_models.N_VOCAB, 32) and d2t is not None and len(w2) == len(d2t)
    finally:
        head.close()
        target.close()


@pytest.mark.tiny
def test_a_hybrid_target_chats_across_turns_and_an_interrupted_reply(dflash_files):
    """qwen35 (Gated DeltaNet + attention, snapshot rollback) with a DFlash draft: turn two reuses turn one's
    caches, a reply closed mid-step (Ctrl-C) is cut back, and each turn evaluates only its new tokens."""
    _, dflash, _, hybrid, _ = dflash_files
    target = backend(hybrid)
    head = BlockHead(target, dflash)
    try:
        injected = []
        original = head.inject
        head.inject = lambda tokens, features: (injected.append((len(head.tokens), len(tokens))),
                                                original(tokens, features))[1]
        chat = Conversation(target, BlockDrafter(head, target), params=GREEDY, max_tokens=40, policy=FixedPolicy(5))
        first = list(chat.send(" house garden river"))[-1]
        assert isinstance(first, Finished) and first.stats.drafted > 0
        for user in (None, " again more"):
            if user is None:  # an interrupted reply
                gen = chat.send(" more words")
                for _ in zip(range(7), (e for e in gen if isinstance(e, TokenEvent))):
                    pass
                gen.close()
                continue
            held = list(chat.ids)
            injected.clear()
            reply = list(chat.send(user))[-1]
            assert isinstance(reply, Finished) and reply.prompt_token_ids[: len(held)] == held
            assert reply.stats.prompt_tokens_evaluated <= len(reply.prompt_token_ids) - len(held) + 5
            assert min(kept for kept, _ in injected) >= len(held) - 8  # the head never re-reads the conversation
        assert target.rollback_recoveries == 0
    finally:
        head.close()
        target.close()


@pytest.mark.tiny
@pytest.mark.parametrize("misfit, needle", [
    ("layers", "target layers [0, 5]"), ("width", "hidden states of width 320"),
])
def test_a_block_draft_that_does_not_fit_is_a_clear_error(dflash_files, misfit, needle):
    target_path, _, _, _, misfits = dflash_files
    target = backend(target_path)
    try:
        with pytest.raises(BackendError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            BlockHead(target, misfits[misfit])
    finally:
        target.close()


# -- the CLI ---------------------------------------------------------------------------------------------


def run_prompt(cli, tmp_path, target, *args):
    text = "".join(tiny_models.vocabulary()[t] for t in prompt()).replace("Ġ", " ")
    result = cli("prompt", text, "--raw", "-m", str(target), "--temp", "0", "-n", "32", "--ignore-eos", "--json",
                 "-t", "2", "-ngl", "0", "--no-lookup-history", *args, home=tmp_path)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.tiny
def test_cli_block_drafts_write_the_targets_text(cli, dflash_files, tmp_path):
    """-md with --spec-type draft-dflash, draft-dspark, and a chain with lookup: the target-only text."""
    target, dflash, dspark, _, _ = dflash_files
    plain = [t["id"] for t in run_prompt(cli, tmp_path, target, "--no-spec")["tokens"]]
    for spec_type, which, path in (("draft-dflash", "dflash", dflash), ("draft-dspark", "dspark", dspark),
                                   ("draft-dflash,ngram-simple", "dflash", dflash)):
        doc = run_prompt(cli, tmp_path, target, "--spec-type", spec_type, "-md", str(path), "--draft-fixed", "4")
        assert [t["id"] for t in doc["tokens"]] == plain, spec_type
        by = doc["stats"]["drafted_by"]
        assert by.get(which, 0) > 0, (spec_type, by)


@pytest.mark.tiny
def test_cli_a_block_draft_that_does_not_fit(cli, dflash_files, tmp_path):
    target, _, _, _, misfits = dflash_files
    text = "one two three"
    result = cli("prompt", text, "--raw", "-m", str(target), "-md", str(misfits["layers"]), "-n", "4", "-t", "2",
                 "-ngl", "0", home=tmp_path)
    assert_user_error(result, "target layers [0, 5]")


@pytest.mark.tiny
def test_models_describes_a_block_draft(cli, dflash_files, tmp_path):
    target, dflash, dspark, _, _ = dflash_files
    config = tmp_path / "models.toml"
    config.write_text(f'[models.tiny-dflash]\npath = "{dflash}"\n[models.tiny-dspark]\npath = "{dspark}"\n')
    result = cli("models", home=tmp_path, env={"SPECCHAT_CONFIG": str(config), "COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    rows = {name: next(line for line in result.stdout.splitlines() if name in line)
            for name in ("tiny-dflash", "tiny-dspark")}
    width = tiny_models.dflash_target_width()
    assert f"DFlash block draft for a target of width {width}, reading its layers 0 · block 8" in rows["tiny-dflash"]
    assert "Markov" not in rows["tiny-dflash"]
    assert "DSpark block draft" in rows["tiny-dspark"] and "Markov head" in rows["tiny-dspark"]
