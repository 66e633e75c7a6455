from __future__ import annotations

import mmap
import random
import sys

import pytest
import torch

from drafter_service.engine import ModelDrafter
from specd.engine import kvcache
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.params import SamplingParams
from specd.engine.slot_cache import SlotKVCache
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask
from verifier_service.engine import VerifierEngine

CPU = torch.device("cpu")
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)


def full_logits(model, tokens: list[int], start: int = 0) -> torch.Tensor:
    """Logits [len(tokens) - start, V] for positions start.. of a plain forward over the
    whole sequence, without any cache."""
    with torch.no_grad():
        ids = torch.tensor([tokens], dtype=torch.long)
        return model(input_ids=ids, logits_to_keep=len(tokens) - start).logits[0].float()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=ATOL, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# -- BatchedCausalLM against plain recomputation --------------------------------------


@pytest.mark.parametrize("head", ["plain", "transposed"])
@pytest.mark.parametrize("slots", [(5, 0, 3), (1, 2, 3)], ids=["scattered", "contiguous"])
def test_batched_rows_with_different_starts_and_lengths_match_full_recompute(tiny_target, vocab_size, slots, head):
    lm = BatchedCausalLM(tiny_target, CPU, torch.float32)
    if head == "transposed":  # the LM head's other product (specd.engine.head_product), at every row count
        lm.head_product.transposed_rows = frozenset(range(1, 64))
    rng = random.Random(0)
    seqs = {slot: random_tokens(rng, 40, vocab_size) for slot in slots}
    cached = dict.fromkeys(slots, 0)

    def feed(plan: dict[int, int]) -> None:
        """plan: slot -> number of new tokens; rows are passed in the given (unsorted) order."""
        rows = [Row(slot, cached[slot], seqs[slot][cached[slot] : cached[slot] + n], 0) for slot, n in plan.items()]
        out = lm.forward(rows)
        assert len(out) == len(rows)
        for row, got in zip(rows, out, strict=True):
            end = row.start + len(row.tokens)
            assert got.shape == (len(row.tokens), vocab_size)
            want = full_logits(tiny_target, seqs[row.slot][:end], row.start)
            assert_logits_close(got, want, f"slot {row.slot}, positions {row.start}..{end - 1}")
            cached[row.slot] = end

    a, b, c = slots
    feed({a: 7, b: 1, c: 12})  # prefill of different lengths in one pass
    feed({c: 1, a: 5, b: 9})  # continue at different offsets
    feed({b: 1})  # a lone row (written by a plain copy: SlotKVCache.prepare)
    feed({c: 4})  # a lone row of several tokens
    feed({a: 3, c: 2})  # a subset of the slots

    # Roll back: lower a row's length and feed other tokens; the stale keys
    # beyond the new length must be invisible and get overwritten.
    for slot, back in ((a, 4), (c, 6)):
        cached[slot] -= back
        seqs[slot][cached[slot] :] = random_tokens(rng, 40 - cached[slot], vocab_size)
    feed({a: 6, b: 2, c: 1})
    cached[b] = 0  # a slot reused from scratch by another sequence
    seqs[b] = random_tokens(rng, 40, vocab_size)
    feed({b: 5, c: 3, a: 1})


def test_logits_from_selects_the_wanted_positions(tiny_target, vocab_size):
    lm = BatchedCausalLM(tiny_target, CPU, torch.float32)
    rng = random.Random(1)
    x, y = random_tokens(rng, 10, vocab_size), random_tokens(rng, 6, vocab_size)
    out = lm.forward([Row(0, 0, x, 9), Row(2, 0, y, 3)])
    assert out[0].shape == (1, vocab_size)
    assert out[1].shape == (3, vocab_size)
    assert_logits_close(out[0], full_logits(tiny_target, x, 9), "last position only")
    assert_logits_close(out[1], full_logits(tiny_target, y, 3), "positions 3..5")
    assert lm.forward([]) == []


def cache_tensors(lm: BatchedCausalLM) -> list[torch.Tensor]:
    return [t for store in (lm.cache.keys, lm.cache.values) for t in store if t is not None]


def test_sequences_up_to_the_bound_share_one_fixed_cache(tiny_target, vocab_size):
    """Slots and positions up to the bound: the tensors are made once at the bound's size
    and never grow or move, whatever rows of mixed lengths feed them."""
    lm = BatchedCausalLM(tiny_target, CPU, torch.float32, max_slots=11, max_positions=256)
    rng = random.Random(2)
    seqs: dict[int, list[int]] = {}
    cached: dict[int, int] = {}

    def feed(plan: dict[int, int]) -> None:
        for slot, n in plan.items():
            seqs.setdefault(slot, [])
            cached.setdefault(slot, 0)
            seqs[slot] += random_tokens(rng, cached[slot] + n - len(seqs[slot]), vocab_size)
        rows = [Row(slot, cached[slot], seqs[slot][cached[slot] : cached[slot] + n], 0) for slot, n in plan.items()]
        for row, got in zip(rows, lm.forward(rows), strict=True):
            end = row.start + len(row.tokens)
            want = full_logits(tiny_target, seqs[row.slot][:end], row.start)
            assert_logits_close(got, want, f"slot {row.slot}, positions {row.start}..{end - 1}")
            cached[row.slot] = end

    def check_all() -> None:
        # One more token for every sequence: its logits depend on everything cached.
        feed(dict.fromkeys(seqs, 1))

    feed({0: 5})
    tensors = cache_tensors(lm)
    assert tensors and all(t.shape[0] == 11 and t.shape[2] == 256 for t in tensors)
    where = [t.data_ptr() for t in tensors]
    feed({1: 30, 2: 3})
    check_all()
    feed({slot: 2 + slot for slot in range(3, 11)})  # every slot
    check_all()
    feed({0: 65, 4: 1, 7: 2})  # beyond 64 positions, mixed with short rows
    check_all()
    feed({5: 150})  # beyond 128 positions
    check_all()
    assert [t.data_ptr() for t in cache_tensors(lm)] == where, "the cache was reallocated"
    assert lm.cache.bytes_per_token() > 0
    assert lm.cache.reserved_bytes() == lm.cache.bytes_per_token() * 11 * 256
    assert sum(t.numel() * t.element_size() for t in cache_tensors(lm)) == lm.cache.reserved_bytes()
    # On the CPU only the written positions count as backed.
    assert lm.cache.allocated_bytes() == lm.cache.bytes_per_token() * sum(cached.values())


def test_a_row_at_the_end_of_the_bound_batched_with_longer_rows_does_not_grow_the_cache(tiny_target, vocab_size):
    """Padding a short row to the longest row's token count used to reach past the last
    position and double the position capacity; padding is now never written."""
    lm = BatchedCausalLM(tiny_target, CPU, torch.float32, max_slots=3, max_positions=64)
    rng = random.Random(7)
    long, short = random_tokens(rng, 63, vocab_size), random_tokens(rng, 2, vocab_size)
    lm.forward([Row(0, 0, long, 62), Row(2, 0, short, 1)])
    where = [t.data_ptr() for t in cache_tensors(lm)]
    last, more = random_tokens(rng, 1, vocab_size), random_tokens(rng, 12, vocab_size)
    out = lm.forward([Row(2, 2, more, 0), Row(0, 63, last, 0)])
    assert_logits_close(out[1], full_logits(tiny_target, [*long, *last], 63), "row ending at the bound")
    assert_logits_close(out[0], full_logits(tiny_target, [*short, *more], 2), "longer row beside it")
    assert [t.data_ptr() for t in cache_tensors(lm)] == where
    assert all(t.shape[0] == 3 and t.shape[2] == 64 for t in cache_tensors(lm))


@pytest.mark.parametrize(
    "row", [Row(3, 0, [1], 0), Row(0, 60, [1] * 5, 0), Row(-1, 0, [1], 0)], ids=["slot", "positions", "negative"]
)
def test_a_row_past_the_bound_is_refused_before_anything_is_written(tiny_target, vocab_size, row):
    lm = BatchedCausalLM(tiny_target, CPU, torch.float32, max_slots=3, max_positions=64)
    lm.forward([Row(1, 0, [5, 6, 7], 2)])
    before = [t.clone() for t in cache_tensors(lm)]
    with pytest.raises(ValueError, match="outside the cache"):
        lm.forward([Row(1, 3, [8], 0), row])
    assert all(torch.equal(a, b) for a, b in zip(before, cache_tensors(lm), strict=True))
    assert lm.cache.allocated_bytes() == lm.cache.bytes_per_token() * 3


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_cpu_memory_is_backed_as_written_and_handed_back_when_a_slot_is_released():
    heads, dim, positions, slots = 4, 64, 4096, 8
    cache = SlotKVCache(1, CPU, torch.float32, max_slots=slots, max_positions=positions)
    per_slot = 2 * heads * positions * dim * 4  # keys and values: 8 MiB
    base = resident_bytes()

    def write(slot: int, start: int, n: int) -> None:
        cache.prepare([slot], [start], [n])
        kv = torch.ones((1, heads, n, dim))
        cache.update(kv, kv, 0)

    write(0, 0, 16)
    assert cache.reserved_bytes() == slots * per_slot
    assert resident_bytes() - base < per_slot / 2, "reserving the bound backed it with memory"
    write(3, 0, positions)  # one slot to the end of the context
    grown = resident_bytes() - base
    assert per_slot * 0.9 < grown < per_slot * 1.5
    assert cache.allocated_bytes() == cache.bytes_per_token() * (16 + positions)
    cache.release(3)
    assert resident_bytes() - base < per_slot / 2, "a released slot kept its memory"
    assert cache.allocated_bytes() == cache.bytes_per_token() * 16
    assert float(cache.keys[0][3].abs().sum()) == 0.0  # a released slot reads as zeros
    assert float(cache.keys[0][0, :, :16].sum()) == heads * 16 * dim  # its neighbours keep theirs


def test_padding_positions_stay_inside_learned_position_embeddings():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    lm = BatchedCausalLM(model, CPU, torch.float32)
    assert lm.max_positions == 32
    long, short = list(range(1, 31)), [3, 4]
    lm.forward([Row(0, 0, long, 29), Row(1, 0, short, 1)])
    # Position 30 is valid for row 0; its padding to 4 tokens reaches position 33.
    out = lm.forward([Row(0, 30, [7], 0), Row(1, 2, [5, 6, 7, 8], 0)])
    assert_logits_close(out[0], full_logits(model, [*long, 7], 30), "row at the end of the context")
    assert_logits_close(out[1], full_logits(model, [*short, 5, 6, 7, 8], 2), "longer row")


# -- the services after random accept/reject histories ---------------------------------


class History:
    """Drives a verifier and a model drafter the way the gateway does, with random choices.

    Per round and sequence one of:
      draft:  the drafter proposes k tokens and the verifier checks all of them;
      prefix: the drafter proposes k tokens and the verifier checks only a prefix;
      random: the drafter is skipped; the verifier checks k arbitrary tokens (mostly
              rejected), so the drafter later catches up on several committed tokens;
      oracle: the drafter is skipped; the verifier checks the target's own greedy
              continuation, sometimes corrupted at one position (long accepted runs).
    """

    def __init__(self, seed: int, verifier: VerifierEngine, drafter: ModelDrafter, target, draft, vocab: int):
        self.rng = random.Random(seed)
        self.verifier, self.drafter = verifier, drafter
        self.target, self.draft = target, draft
        self.vocab = vocab
        self.max_sequences = verifier.table.max_sequences
        self.committed: dict[str, list[int]] = {}
        self.unsent: dict[str, list[int]] = {}  # committed, not yet told to the drafter
        self.params: dict[str, SamplingParams] = {}
        self.opened = self.closed = 0
        self.accepted = self.rejected = 0
        self.slots_seen: set[int] = set()
        self.kinds_opened: set[str] = set()

    def open(self) -> None:
        rng = self.rng
        sid = f"seq-{self.opened}"
        self.opened += 1
        prompt = random_tokens(rng, rng.randint(1, 24), self.vocab)
        # In turn: greedy, seeded (the Gumbel-coupled path), unseeded (the Leviathan rule).
        kind = (self.opened - 1) % 3
        if kind == 0:
            params = GREEDY
        else:
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(2**31) if kind == 1 else None)
        spec = SequenceSpec(sid, prompt, params)
        for engine in (self.verifier, self.drafter):
            errors, _ = engine.open([spec])
            assert errors == [None]
        self.committed[sid] = list(prompt)
        self.unsent[sid] = []
        self.params[sid] = params
        self.kinds_opened.add("greedy" if params.greedy else "seeded" if params.seeded else "unseeded")
        self.slots_seen.add(self.verifier.table.get(sid).slot)

    def close(self) -> None:
        sid = self.rng.choice(sorted(self.committed))
        assert self.verifier.close([sid]) == 1
        assert self.drafter.close([sid]) == 1
        for table in (self.committed, self.unsent, self.params):
            del table[sid]
        self.closed += 1

    def round(self) -> None:
        rng = self.rng
        if len(self.committed) < self.max_sequences and (not self.committed or rng.random() < 0.4):
            self.open()
        if len(self.committed) > 1 and rng.random() < 0.15:
            self.close()
        ids = sorted(self.committed)
        ks = {sid: rng.randint(0, 6) for sid in ids}
        modes = {sid: rng.choice(["draft", "draft", "prefix", "random", "oracle"]) for sid in ids}

        drafted = [sid for sid in ids if modes[sid] in ("draft", "prefix")]
        rng.shuffle(drafted)
        tasks = [DraftTask(sid, self.unsent[sid], len(self.committed[sid]), ks[sid]) for sid in drafted]
        proposals, _ = self.drafter.draft(tasks)
        proposed = {}
        for sid, proposal in zip(drafted, proposals, strict=True):
            assert proposal.error is None, proposal.error
            assert len(proposal.tokens) == ks[sid]
            self.unsent[sid] = []
            if self.params[sid].greedy:
                assert proposal.dists == []
                self.check_greedy_draft(sid, proposal.tokens)
            elif self.params[sid].seeded:
                assert proposal.dists == []  # the coupling needs no q
            else:
                assert len(proposal.dists) == ks[sid]
                for token, dist in zip(proposal.tokens, proposal.dists, strict=True):
                    assert token in dist.token_ids
            proposed[sid] = (proposal.tokens, proposal.dists)

        verify = []
        for sid in ids:
            if modes[sid] == "random":
                tokens, dists = random_tokens(rng, ks[sid], self.vocab), []
            elif modes[sid] == "oracle":
                tokens, dists = self.target_greedy(sid, ks[sid]), []
                if tokens and rng.random() < 0.5:
                    tokens[rng.randrange(len(tokens))] = rng.randrange(self.vocab)
            else:
                tokens, dists = proposed[sid]
                if modes[sid] == "prefix":
                    j = rng.randint(0, len(tokens))
                    tokens, dists = tokens[:j], dists[:j]
            verify.append(VerifyTask(sid, len(self.committed[sid]), tokens, dists))
        rng.shuffle(verify)
        results, _ = self.verifier.verify(verify)
        for task, result in zip(verify, results, strict=True):
            assert result.error is None, result.error
            assert result.sequence_id == task.sequence_id
            n = result.num_accepted
            assert 0 <= n <= len(task.draft_tokens)
            assert 0 <= result.next_token < self.vocab
            if self.params[task.sequence_id].greedy:
                self.check_greedy_verdict(task, n, result.next_token)
            emitted = [*task.draft_tokens[:n], result.next_token]
            self.committed[task.sequence_id] += emitted
            self.unsent[task.sequence_id] += emitted
            self.accepted += n
            self.rejected += n < len(task.draft_tokens)

    def target_greedy(self, sid: str, k: int) -> list[int]:
        tokens = list(self.committed[sid])
        for _ in range(k):
            tokens.append(int(full_logits(self.target, tokens, len(tokens) - 1)[0].argmax()))
        return tokens[len(self.committed[sid]) :]

    def check_greedy_draft(self, sid: str, tokens: list[int]) -> None:
        """A greedy drafter's tokens are the draft model's own greedy continuation."""
        if not tokens:
            return
        base = self.committed[sid]
        logits = full_logits(self.draft, base + tokens[:-1], len(base) - 1)
        expected = logits.argmax(dim=-1).tolist()
        assert tokens == expected, f"{sid}: drafted {tokens}, the draft model's greedy path is {expected}"

    def check_greedy_verdict(self, task: VerifyTask, n: int, next_token: int) -> None:
        base = self.committed[task.sequence_id]
        best = full_logits(self.target, base + task.draft_tokens, len(base) - 1).argmax(dim=-1).tolist()
        expected_n = next((i for i, t in enumerate(task.draft_tokens) if t != best[i]), len(task.draft_tokens))
        assert (n, next_token) == (expected_n, best[expected_n]), (
            f"{task.sequence_id}: drafts {task.draft_tokens}, target greedy path {best}"
        )

    def check_next_token_logits(self) -> None:
        """Each service's next-token logits from its cache equal a recomputation from scratch."""
        ids = sorted(self.committed)
        rows, wants = [], []
        for sid in ids:
            state = self.verifier.table.get(sid)
            assert state.committed == self.committed[sid]
            assert state.cached == state.committed[: len(state.cached)]
            fed = state.committed[len(state.cached) :]
            assert fed
            rows.append(Row(state.slot, len(state.cached), fed, len(fed) - 1))
            wants.append(full_logits(self.target, state.committed, len(state.committed) - 1)[0])
        for sid, got, want in zip(ids, self.verifier.lm.forward(rows), wants, strict=True):
            assert_logits_close(got[-1], want, f"verifier, {sid}")

        rows, wants = [], []
        for sid in ids:
            state = self.drafter.table.get(sid)
            told = self.committed[sid][: len(self.committed[sid]) - len(self.unsent[sid])]
            assert state.committed == told
            ModelDrafter._roll_back(state, state.committed)
            assert state.cached == state.committed[: len(state.cached)]
            fed = state.committed[len(state.cached) :]
            assert fed
            rows.append(Row(state.slot, len(state.cached), fed, len(fed) - 1))
            wants.append(full_logits(self.draft, state.committed, len(state.committed) - 1)[0])
        for sid, got, want in zip(ids, self.drafter.lm.forward(rows), wants, strict=True):
            assert_logits_close(got[-1], want, f"drafter, {sid}")


@pytest.mark.parametrize(
    ("seed", "draft_model"), [(0, "tiny_draft"), (1, "tiny_draft"), (2, "close_draft"), (3, "close_draft")]
)
def test_after_random_accept_reject_histories_each_services_next_token_logits_equal_a_full_recomputation(
    seed, draft_model, request, make_verifier, make_drafter, tiny_target, vocab_size
):
    draft = request.getfixturevalue(draft_model)
    history = History(
        seed,
        make_verifier(max_sequences=4, max_draft_tokens=8),
        make_drafter(max_sequences=4, max_draft_tokens=8, max_support=16, model=draft),
        tiny_target,
        draft,
        vocab_size,
    )
    for r in range(36):
        history.round()
        if r % 4 == 3:
            history.check_next_token_logits()
    history.check_next_token_logits()
    # The history really exercised what the test is about.
    assert history.closed >= 1 and history.opened > history.max_sequences  # slots were reused
    assert history.accepted > 0 and history.rejected > 0
    assert history.kinds_opened == {"greedy", "seeded", "unseeded"}


def test_many_long_sequences_through_the_verifier_match_full_recompute(make_verifier, tiny_target, vocab_size):
    """More sequences than the initial capacity, and contexts past 64 and 128 positions."""
    rng = random.Random(5)
    verifier = make_verifier(max_sequences=12, max_draft_tokens=8)
    committed = {f"s{i}": random_tokens(rng, rng.choice([1, 3, 40, 70, 130]), vocab_size) for i in range(12)}
    specs = [
        SequenceSpec(sid, list(p), GREEDY if i % 2 else SamplingParams(seed=i))
        for i, (sid, p) in enumerate(committed.items())
    ]
    errors, _ = verifier.open(specs)
    assert errors == [None] * 12
    for _ in range(6):
        tasks = [
            VerifyTask(sid, len(t), random_tokens(rng, rng.randint(0, 8), vocab_size)) for sid, t in committed.items()
        ]
        results, _ = verifier.verify(tasks)
        for task, result in zip(tasks, results, strict=True):
            assert result.error is None
            committed[task.sequence_id] += [*task.draft_tokens[: result.num_accepted], result.next_token]
    assert verifier.lm.cache.max_slots == 12
    assert verifier.lm.cache.max_positions == 512
    for sid, tokens in committed.items():
        state = verifier.table.get(sid)
        fed = state.committed[len(state.cached) :]
        got = verifier.lm.forward([Row(state.slot, len(state.cached), fed, len(fed) - 1)])[0][-1]
        assert_logits_close(got, full_logits(tiny_target, tokens, len(tokens) - 1)[0], sid)


def test_the_cache_goes_in_by_the_keyword_the_model_names_whichever_transformers_is_installed():
    """Before transformers 5.24 a model's forward took `past_key_values`, since then `cache`
    (constraints.txt pins one of them, so the other spelling is checked here with stand-ins);
    extra arguments to `update`, positional (before 5.24) or by keyword (since), are ignored."""

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return cache

    class Wrapper(torch.nn.Module):  # forwards **kwargs to an HF model inside, and says which keyword
        cache_keyword = "cache"

        def forward(self, input_ids=None, **kwargs):
            return kwargs

    assert kvcache.cache_keyword(Old()) == "past_key_values"
    assert kvcache.cache_keyword(New()) == "cache"
    assert kvcache.cache_keyword(Wrapper()) == "cache"

    cache = SlotKVCache(1, torch.device("cpu"), torch.float32, 2, 8)
    cache.prepare([0], [0], [1])
    k, v = torch.ones(1, 1, 1, 4), torch.full((1, 1, 1, 4), 2.0)
    old_keys, _ = cache.update(k, v, 0, {"cache_position": None})
    new_keys, new_values = cache.update(k, v, 0, kwargs={"position_ids": None})
    assert torch.equal(old_keys, new_keys) and torch.equal(new_values[0, 0, 0], v[0, 0, 0])


def test_step_timings_cover_the_sizes_the_cache_has_slots_for_and_leave_it_empty(tiny_target, vocab_size):
    lm = BatchedCausalLM(tiny_target, CPU, torch.float32, max_slots=5, max_positions=64)
    timed = lm.time_steps([1, 2, 4, 8])
    assert [n for n, _ in timed] == [1, 2, 4]  # no room for 8
    assert all(ns > 0 for _, ns in timed)
    assert lm.cache.allocated_bytes() == 0  # every slot it used was released
    # The cache serves sequences afterwards as before: logits as a full recompute gives them.
    tokens = random_tokens(random.Random(5), 7, vocab_size)
    [got] = lm.forward([Row(0, 0, tokens, 0)])
    assert_logits_close(got, full_logits(tiny_target, tokens), "after the timings")


def test_device_ids_feed_each_row_its_own_token_whatever_the_slot_order(tiny_target):
    def step(ids: torch.Tensor | None) -> list[torch.Tensor]:
        lm = BatchedCausalLM(tiny_target, torch.device("cpu"), torch.float32)
        lm.forward([Row(slot, 0, [3 + slot, 4, 5], 2) for slot in range(3)])
        tokens = [[40], [41], [42]]  # for the rows in the order below: slots 2, 0, 1
        rows = [Row(slot, 3, [0] if ids is not None else tokens[n], 0) for n, slot in enumerate((2, 0, 1))]
        return lm.forward(rows, ids)

    want = step(None)
    got = step(torch.tensor([40, 41, 42]))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match="one token to each row"):
        BatchedCausalLM(tiny_target, torch.device("cpu"), torch.float32).forward(
            [Row(0, 0, [1, 2], 1)], torch.tensor([5])
        )


def test_forward_argmax_is_the_argmax_of_each_row_s_logits_in_the_caller_s_order(tiny_target):
    """Rows given out of slot order, with their own tokens or device ids: each row's likeliest
    next token, as `forward`'s logits rank them, and in the order the rows were given."""

    def run(argmax: bool, ids: torch.Tensor | None) -> torch.Tensor:
        lm = BatchedCausalLM(tiny_target, torch.device("cpu"), torch.float32)
        lm.forward([Row(slot, 0, [3 + slot, 4 + 2 * slot, 5], 2) for slot in range(3)])
        tokens = [[40], [41], [42]]
        rows = [Row(slot, 3, [0] if ids is not None else tokens[n], 0) for n, slot in enumerate((2, 0, 1))]
        if argmax:
            return lm.forward_argmax(rows, ids)
        return torch.cat(lm.forward(rows, ids)).argmax(dim=-1)

    want = run(False, None)
    assert len(set(want.tolist())) > 1  # rows that differ, so an order mix-up would show
    assert torch.equal(run(True, None), want)
    assert torch.equal(run(True, torch.tensor([40, 41, 42])), want)
    lm = BatchedCausalLM(tiny_target, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="one position of each row"):
        lm.forward_argmax([Row(0, 0, [1, 2], 0)])


@pytest.mark.parametrize("argmax", [False, True])
def test_head_inputs_give_each_row_s_logits_in_the_caller_s_order(tiny_target, argmax):
    """`inputs` gets each row's head inputs of its wanted positions, rows out of slot order and
    of different widths: `logits_of` turns them into the logits `forward` returns."""
    lm = BatchedCausalLM(tiny_target, torch.device("cpu"), torch.float32)
    lm.forward([Row(slot, 0, [3 + slot, 4 + 2 * slot, 5], 2) for slot in range(3)])
    tokens = [[40, 7], [41], [42, 9, 10]] if not argmax else [[40], [41], [42]]
    rows = [Row(slot, 3, tokens[n], 0) for n, slot in enumerate((2, 0, 1))]
    inputs: list[torch.Tensor] = []
    if argmax:
        best = lm.forward_argmax(rows, inputs=inputs)
        assert [len(x) for x in inputs] == [1, 1, 1]
        assert torch.equal(lm.logits_of(torch.cat(inputs)).argmax(dim=-1), best)
        return
    logits = lm.forward(rows, inputs=inputs)
    assert [len(x) for x in inputs] == [2, 1, 3]
    for x, want in zip(inputs, logits, strict=True):
        assert_logits_close(lm.logits_of(x), want, "logits of the head inputs")
