"""Carryover decoding through `transformers` generate.

This file is self-contained (torch + transformers only): it is imported by the drafter's model file and also saved,
unchanged, as `custom_generate/generate.py` next to every checkpoint, so that

    target.generate(**inputs, assistant_model=drafter, custom_generate=<drafter folder or repo>, trust_remote_code=True)

decodes with carryover in a process where this project is not installed. It talks to the drafter only through the
drafter's own methods (`check_target`, `feature_hidden_state_indices`, `target_features`, `block_inputs`,
`rejected_rows`, `forward`, `draft_logits`, `draft_tokens`, `markov_correction`, `full_vocab_logits`), so the
concepts they define are the ones training uses too.

Each round (batch size 1, like all assisted generation in transformers):
  1. the target's last verification forward returned hidden states for the window `[anchor, draft_1 .. draft_c]`;
  2. the anchor and the accepted drafts become committed drafter context (their keys/values are cached);
  3. with carryover, the rejected drafts' rows (+ E_carry) become read-only context for the next proposal only;
  4. the drafter proposes up to `block_size - 1` tokens (or `num_assistant_tokens`) for the block `[new anchor,
     MASK ...]`, all verified (the fixed policy, the default), or with `draft_confidence_threshold` only as many as it
     is confident in (`confident_drafts`); with `speculation_policy="adaptive"` (`SpeculationPolicy`) each round is
     the drafter's block (its drafts worth verifying), a prompt-lookup candidate or a plain step, by expected tokens
     per second;
  5. transformers verifies them (greedy match or exact speculative sampling) and crops its own cache.
"""

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from transformers import DynamicCache, GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)


@dataclass
class DraftRound:
    """One round of the target: `proposed` candidates after `anchor_position`, of which the target accepted
    `accepted`. `kind` is "draft" (the drafter's block, with `carried` rejected rows of the previous drafted round as
    extra context and `committed_rows` rows in the drafter's cache), "ngram" (a prompt-lookup candidate) or "plain"
    (one target step, no candidates), as the speculation policy chose; `predicted_accepted` is what it expected.
    `drafts` are the proposed token ids (for replay analyses). Seconds are wall-clock (CUDA-synchronised):
    `draft_seconds` is the time before the target forward (the policy's `policy_seconds` included)."""

    anchor_position: int
    proposed: int
    carried: int
    committed_rows: int
    drafts: list[int] = field(default_factory=list)
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    kind: str = "draft"
    predicted_accepted: float | None = None
    policy_seconds: float = 0.0


@dataclass
class GenerationStats:
    """Per-round records of the last `generate` call (`drafter.generation_stats`)."""

    rounds: list[DraftRound] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def acceptance_length(self) -> float:
        """tau: tokens per target forward (verification round), bonus token included, micro-averaged over rounds of
        every kind."""
        if not self.rounds:
            return float("nan")
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)

    def rounds_by_kind(self) -> dict[str, int]:
        """{kind: rounds} ("draft", "ngram", "plain")."""
        counts = {}
        for r in self.rounds:
            counts[r.kind] = counts.get(r.kind, 0) + 1
        return counts


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def confident_drafts(slot_logits, threshold: float) -> int:
    """How many leading drafts to verify: while the product of the drafter's top probabilities over its slots (its
    own estimate that every draft so far is accepted at T=0) stays >= `threshold`; at least one. Where a verified
    row costs real time (a CPU), unlikely drafts are not worth it. The count depends on the slots' distributions, never
    on a sampled draft, so speculative sampling stays exact. slot_logits [c, scored vocab] -> int"""
    confidence = slot_logits.float().softmax(-1).amax(-1).cumprod(0)  # [c], non-increasing
    return max(1, int((confidence >= threshold).sum()))


def drafts_per_round(block_size: int, num_assistant_tokens: int | None = None) -> int:
    """Drafts a round proposes: the block's block_size - 1 slots, or fewer with `num_assistant_tokens`."""
    if num_assistant_tokens is not None and num_assistant_tokens < 1:
        raise ValueError(f"num_assistant_tokens (drafts per round) must be at least 1, got {num_assistant_tokens}.")
    return min(block_size - 1, num_assistant_tokens or block_size)


# ----------------------------------------------------------------------------------------------------------------
# The speculation policy: each round, a drafted block (and how many of its drafts to verify), a prompt-lookup
# candidate, or a plain target step, by expected committed tokens per second.
# ----------------------------------------------------------------------------------------------------------------

SPECULATION_POLICIES = ("adaptive", "fixed")
EMA = 0.2  # weight of a new measurement in the moving averages: the policy follows the machine within a few rounds
WARMUP_DRAFTED_ROUNDS = 4  # drafted rounds that verify every draft before the policy trims or skips any
EXPLORE_EVERY = 8  # then every 8th drafted round verifies every draft, so late slots keep their acceptance labels
MAX_BACKOFF = 32  # rounds without drafting, at most, before the drafter is probed again


MAX_NGRAM = 3


def ngram_candidate(ids: torch.Tensor, max_ngram: int = MAX_NGRAM, max_tokens: int = 10) -> tuple[torch.Tensor, int]:
    """Prompt lookup (transformers' `prompt_lookup_num_tokens`, vLLM's n-gram proposer): the up to `max_tokens` tokens
    that followed the most recent earlier occurrence of the sequence's last n tokens, n from `max_ngram` down to 1,
    and that n; empty (and 0) when no n-gram recurs. No model, no training. ids [L] -> ([m], n)"""
    for n in range(min(max_ngram, ids.shape[0] - 1), 0, -1):
        earlier = ids.unfold(0, n, 1)[:-1]  # [L - n, n]: every n-gram but the sequence's own tail
        starts = (earlier == ids[-n:]).all(-1).nonzero()
        if len(starts):
            start = int(starts[-1]) + n  # the most recent occurrence: repetition is local
            return ids[start : start + max_tokens], n
    return ids[:0], 0


def ema(average: float | None, value: float) -> float:
    return value if average is None else average + EMA * (value - average)


class VerifyCosts:
    """Seconds of one target forward over r rows (r = 1: a plain step; r = k + 1: verifying k drafts), measured on
    this machine as every round runs: a moving average per row count, interpolated linearly between the counts
    measured. One table per target, device, dtype and thread count (`verify_costs_for`), shared by every generate
    call, so it is measured once and follows the machine when it slows down or speeds up."""

    def __init__(self):
        self.seconds = {}  # rows -> seconds

    def observe(self, rows: int, seconds: float):
        """A measured forward of `rows` rows. Where the machine as a whole got slower or faster (another process),
        the row counts not measured now move along by the same factor, so that a rarely chosen one (the plain step,
        where drafting pays) does not go stale."""
        if rows in self.seconds:  # the same factor by which this count's own average moves now
            drift = 1 + EMA * (seconds / self.seconds[rows] - 1)
            self.seconds = {r: s * drift if r != rows else s for r, s in self.seconds.items()}
        self.seconds[rows] = ema(self.seconds.get(rows), seconds)

    def __call__(self, rows: int) -> float | None:
        """The measured or interpolated cost of `rows` rows; None until two row counts are measured."""
        if rows in self.seconds:
            return self.seconds[rows]
        known = sorted(self.seconds)
        if len(known) < 2:
            return None
        below = [r for r in known if r < rows][-1:] or known[:1]
        above = [r for r in known if r > rows][:1] or known[-1:]
        low, high = (below[0], above[0]) if below[0] != above[0] else (known[-2], known[-1])
        slope = (self.seconds[high] - self.seconds[low]) / (high - low)
        return max(self.seconds[low] + slope * (rows - low), 1e-6)


_VERIFY_COSTS: dict[tuple, VerifyCosts] = {}


def verify_costs_for(target) -> VerifyCosts:
    key = (type(target).__name__, getattr(target.config, "_name_or_path", ""), target.num_parameters(), str(target.device),
           str(target.dtype), torch.get_num_threads())
    return _VERIFY_COSTS.setdefault(key, VerifyCosts())


class SlotAcceptance:
    """The chance that slot i's draft is accepted given that every earlier one was: a logistic model per slot on the
    logit of the drafter's top probability there, p_i = sigmoid(w_i logit(confidence_i) + b_i). It starts as the
    drafter's own estimate (w = 1, b = 0) and is refit online by one gradient step per verified slot; only slots
    reached (every earlier draft accepted) have a label. At T > 0 the label is speculative sampling's acceptance,
    min(1, p/q) in expectation, so the same model calibrates to it."""

    def __init__(self, num_slots: int, learning_rate: float = 0.05):
        self.weights = torch.tensor([[1.0, 0.0]], dtype=torch.float64).repeat(num_slots, 1)  # [S, (w, b)]
        self.learning_rate = learning_rate

    @staticmethod
    def features(confidence: torch.Tensor) -> torch.Tensor:
        return torch.logit(confidence.double().clamp(1e-4, 1 - 1e-4))

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Per-slot conditional acceptance [c] from the drafter's top probabilities [c]."""
        w, b = self.weights[: len(confidence)].unbind(-1)
        return torch.sigmoid(w * self.features(confidence.cpu()) + b)

    def observe(self, confidence: torch.Tensor, verified: int, accepted: int):
        reached = min(accepted + 1, verified)  # slots 0 .. accepted were judged (the last one rejected, if verified)
        x = self.features(confidence[:reached].cpu())
        labels = (torch.arange(reached) < accepted).double()
        error = self(confidence[:reached]) - labels  # d(log loss)/d(logit)
        self.weights[:reached] -= self.learning_rate * torch.stack([error * x, error], -1)


class NgramAcceptance:
    """Prompt-lookup candidates' acceptance by position and by the length n of the n-gram that matched (a longer match
    repeats more reliably): accepted / reached counts with a uniform prior, so that the first candidates are tried
    and the estimate follows what the prompt and output actually repeat."""

    def __init__(self, max_tokens: int):
        self.accepted = torch.zeros(MAX_NGRAM + 1, max_tokens, dtype=torch.float64)
        self.reached = torch.zeros(MAX_NGRAM + 1, max_tokens, dtype=torch.float64)

    def __call__(self, n: int, length: int) -> torch.Tensor:
        """Per-position conditional acceptance [length] of a candidate from an n-gram match."""
        return (self.accepted[n, :length] + 1) / (self.reached[n, :length] + 2)

    def observe(self, n: int, verified: int, accepted: int):
        reached = min(accepted + 1, verified)
        self.reached[n, :reached] += 1
        self.accepted[n, :accepted] += 1


def best_length(survival: torch.Tensor, fixed_seconds: float, verify_costs: VerifyCosts) -> tuple[int, float, float]:
    """(k, expected tokens, tokens per second) maximising (1 + sum_{i<=k} S_i) / (fixed_seconds + verify(k + 1)) over
    k = 1 .. len(survival): the expected committed tokens of a round (the bonus token included) per second of it."""
    best = (1, 1.0, 0.0)
    for k in range(1, len(survival) + 1):
        tokens = 1 + float(survival[:k].sum())
        rate = tokens / (fixed_seconds + verify_costs(k + 1))
        if rate > best[2]:
            best = (k, tokens, rate)
    return best


@dataclass
class PolicyState:
    """What the adaptive policy has learnt about one drafter with one target and sampling mode (kept on the drafter,
    so later generate calls start calibrated)."""

    slots: SlotAcceptance
    ngram: NgramAcceptance
    draft_seconds: float | None = None  # one drafter proposal
    drafted_tokens: float | None = None  # committed tokens per drafted round (accepted + bonus)
    drafted_seconds: float | None = None  # seconds per drafted round (drafting + verification)
    drafted_rounds: int = 0


class SpeculationPolicy:
    """`speculation_policy="adaptive"`: before drafting, the round's kind by expected committed tokens per second:
    the drafter's block (its recent tokens per second), a prompt-lookup candidate (its acceptance by position, its
    best length), or a plain step (1 / the measured cost of one row). After drafting, how many drafts to verify:
    `best_length` over the calibrated per-slot acceptance. Not drafting costs nothing extra: the decision comes first.
    Where drafting does not pay, it is skipped for a backoff (1, 2, 4, ... rounds, at most MAX_BACKOFF) and then
    probed again. The costs are measured online (`VerifyCosts`), the acceptance models refit online (`SlotAcceptance`,
    `NgramAcceptance`)."""

    def __init__(self, state: PolicyState, verify_costs: VerifyCosts, ngram_max_tokens: int = 10):
        self.state, self.verify_costs, self.ngram_max_tokens = state, verify_costs, ngram_max_tokens
        self.skip_left, self.backoff, self.probing = 0, 1, False
        self.ngram_size = 0  # n of the n-gram behind the current candidate

    @classmethod
    def for_drafter(cls, drafter, target, do_sample: bool, ngram_max_tokens: int = 10):
        states = drafter.__dict__.setdefault("_speculation_policy_states", {})
        key = (verify_costs_for(target), do_sample)
        if key not in states:
            states[key] = PolicyState(SlotAcceptance(drafter.config.block_size - 1), NgramAcceptance(ngram_max_tokens))
        return cls(states[key], verify_costs_for(target), ngram_max_tokens)

    def choose_round(self, ids: torch.Tensor, max_candidates: int) -> tuple[str, torch.Tensor | None]:
        """("draft", None), ("ngram", candidate tokens [m]) or ("plain", None) for the round after `ids` [L]."""
        state, plain_seconds = self.state, self.verify_costs(1)
        if state.drafted_rounds == 0 or self.probing:
            return "draft", None
        if plain_seconds is None:  # measure a plain step once: the policy's yardstick
            return "plain", None
        if state.drafted_rounds < WARMUP_DRAFTED_ROUNDS:
            return "draft", None
        rates = {"plain": 1 / plain_seconds}
        ngram, self.ngram_size = ngram_candidate(ids, max_tokens=min(self.ngram_max_tokens, max_candidates))
        if len(ngram):
            survival = self.state.ngram(self.ngram_size, len(ngram)).cumprod(0)
            k, _, rates["ngram"] = best_length(survival, 0.0, self.verify_costs)
            ngram = ngram[:k]
        if self.skip_left > 0:
            self.skip_left -= 1
            self.probing = self.skip_left == 0
        elif state.drafted_tokens / state.drafted_seconds >= rates["plain"]:
            rates["draft"] = state.drafted_tokens / state.drafted_seconds
        else:  # drafting does not pay here: skip it for a while, then probe it again
            self.skip_left = self.backoff - 1
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self.probing = self.skip_left == 0
        kind = max(rates, key=rates.get)
        return kind, ngram if kind == "ngram" else None

    def choose_num_drafts(self, confidence: torch.Tensor) -> tuple[int, float]:
        """(drafts to verify, expected accepted) for a drafted block whose slots have the drafter's top probabilities
        `confidence` [c]; every draft while warming up and every EXPLORE_EVERY-th round, so the labels cover all slots."""
        survival = self.state.slots(confidence).cumprod(0)
        exploring = self.state.drafted_rounds < WARMUP_DRAFTED_ROUNDS or self.state.drafted_rounds % EXPLORE_EVERY == 0
        if exploring or self.verify_costs(2) is None or self.state.draft_seconds is None:
            return len(confidence), float(survival.sum())
        k, tokens, _ = best_length(survival, self.state.draft_seconds, self.verify_costs)
        return k, tokens - 1

    def observe(self, round: "DraftRound", confidence: torch.Tensor | None):
        """Learn from a finished round: its costs, and its kind's acceptance."""
        state = self.state
        self.verify_costs.observe(round.proposed + 1, round.verify_seconds)
        if round.kind == "ngram":
            state.ngram.observe(self.ngram_size, round.proposed, round.accepted)
        elif round.kind == "draft":
            state.slots.observe(confidence, round.proposed, round.accepted)
            state.draft_seconds = ema(state.draft_seconds, round.draft_seconds)
            state.drafted_tokens = ema(state.drafted_tokens, round.accepted + 1)
            state.drafted_seconds = ema(state.drafted_seconds, round.draft_seconds + round.verify_seconds)
            state.drafted_rounds += 1
            if self.probing:
                self.probing = False
                plain_seconds = self.verify_costs(1)
                if plain_seconds and (round.accepted + 1) / (round.draft_seconds + round.verify_seconds) >= 1 / plain_seconds:
                    self.backoff = 1  # the probe paid: drafting is back


class CarryoverCandidateGenerator(CandidateGenerator):
    """Proposes blocks with a Carryover drafter from the target's hidden states of every verification forward."""

    requires_model_outputs = True

    def __init__(
        self, target, drafter, generation_config, logits_processor=None, carryover=None, input_ids=None,
        draft_confidence_threshold=None, num_assistant_tokens=None, speculation_policy=None,
    ):
        drafter.check_target(target.config)
        if draft_confidence_threshold is not None and not 0 < draft_confidence_threshold <= 1:
            raise ValueError(f"draft_confidence_threshold must be in (0, 1], got {draft_confidence_threshold}.")
        # "fixed" stays the default until the adaptive policy is measured to win on a quiet machine
        speculation_policy = speculation_policy or "fixed"
        if speculation_policy not in SPECULATION_POLICIES and not isinstance(speculation_policy, SpeculationPolicy):
            raise ValueError(f"speculation_policy must be one of {SPECULATION_POLICIES}, got {speculation_policy!r}.")
        if speculation_policy != "fixed" and draft_confidence_threshold is not None:
            raise ValueError("draft_confidence_threshold is a fixed policy: use it with speculation_policy='fixed'.")
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"Carryover decoding takes one sequence at a time (batch size 1, as transformers' assisted generation); "
                f"got a batch of {input_ids.shape[0]}. Call generate once per prompt."
            )
        if input_ids is not None and input_ids.shape[1] == 0:
            raise ValueError("The prompt is empty: carryover decoding needs at least one input token.")
        self.drafter = drafter
        # Drafts per round: the block's block_size - 1 slots, or fewer with `num_assistant_tokens` (vLLM's
        # num_speculative_tokens): the drafter still fills its whole block, the target verifies only the first ones.
        # Where verifying costs more per token than drafting (a CPU), fewer can be faster at the same block size.
        # Not generation_config.num_assistant_tokens: transformers fills in its own default there (20), which would
        # silently cap blocks above 21 tokens.
        self.max_drafts = drafts_per_round(drafter.config.block_size, num_assistant_tokens)
        self.draft_confidence_threshold = draft_confidence_threshold
        self.carryover = drafter.config.carryover if carryover is None else bool(carryover)
        self.use_markov = drafter.config.markov_rank > 0
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        # Each verification forward returns the feature layers only (all layers if the caller asked for them).
        indices = True if generation_config.output_hidden_states else drafter.feature_hidden_state_indices
        self.model_kwargs_overrides = {"output_hidden_states": indices}
        self.do_sample = generation_config.do_sample
        self.max_length = generation_config.max_length
        self.logits_processor = logits_processor if logits_processor is not None else []

        self.cache = DynamicCache()  # committed context keys/values of the drafter
        self.num_committed = 0  # positions 0 .. num_committed-1 are committed context (cached or pending)
        self.pending = None  # (features [1, P, F], position ids [1, P]) committed but not yet in the cache
        self.carried = None  # (features [1, 1, R, F], position ids [1, 1, R]) for the next proposal only
        self.stats = GenerationStats()
        drafter.generation_stats = self.stats
        self.current_round = None
        self.current_confidence = None  # [c] the drafter's top probability at each slot of the current round
        self.last_kind = None  # the kind of the round just verified: only a drafted round's rejected rows are carried
        self.verify_started = 0.0
        # None: every round drafts (fixed); else the adaptive policy, which keeps what it learns on the drafter
        self.policy = speculation_policy if isinstance(speculation_policy, SpeculationPolicy) else (
            SpeculationPolicy.for_drafter(drafter, target, self.do_sample) if speculation_policy == "adaptive" else None
        )

    # -- after each verification ---------------------------------------------------------------------------------

    def _absorb_verification(self, input_ids, model_outputs):
        """Split the verified window into committed rows (anchor + accepted drafts) and rejected rows."""
        device = self.drafter.device
        window = self.drafter.target_features(model_outputs.hidden_states).to(device)  # [1, W, F]
        window_position_ids = self.num_committed + torch.arange(window.shape[1], device=device)[None]  # [1, W]
        # input_ids ends with the new anchor (bonus token), whose own features come with the next verification.
        num_new = input_ids.shape[1] - 1 - self.num_committed
        new = (window[:, :num_new], window_position_ids[:, :num_new])
        self.pending = new if self.pending is None else tuple(torch.cat(p, 1) for p in zip(self.pending, new))
        self.num_committed += num_new

        # Rows rejected in a prompt-lookup round are not the drafter's own branch (it was trained to read those), and a
        # plain step rejects none: after either, the next proposal carries nothing.
        self.carried = None
        if self.carryover and self.last_kind == "draft" and num_new < window.shape[1]:
            accepted_len = torch.tensor([num_new - 1], device=device)
            rows, row_position_ids, valid = self.drafter.rejected_rows(window, window_position_ids, accepted_len)
            num_rejected = int(valid.sum())  # valid rows are packed first
            self.carried = (rows[:, None, :num_rejected], row_position_ids[:, None, :num_rejected])

    # -- the proposal --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _propose(self, input_ids, num_drafts):
        """Draft `num_drafts` tokens after `input_ids`. Returns candidates [1, L + c], the processed logits the drafts
        were drawn from for transformers [1, c, V] (None for plain greedy decoding), and the logits each draft was
        chosen from [c, V or scored vocab] (what the speculation policy reads)."""
        device = self.drafter.device
        anchor_position_ids = torch.tensor([input_ids.shape[1] - 1], device=device)
        block_ids, block_position_ids = self.drafter.block_inputs(input_ids[:, -1].to(device), anchor_position_ids)
        block_embeds = self.embed_tokens(block_ids.to(self.embed_tokens.weight.device)).to(device)
        carried_features, carried_position_ids = self.carried if self.carried is not None else (None, None)
        context_features, context_position_ids = self.pending
        out = self.drafter(
            block_embeds[:, None],
            block_position_ids[:, None],
            context_features=context_features,
            context_position_ids=context_position_ids,
            carried_features=carried_features,
            carried_position_ids=carried_position_ids,
            past_key_values=self.cache,
        )
        self.pending = None
        hidden = out.last_hidden_state[0, 0, 1 : num_drafts + 1]  # slot k predicts the token at anchor + k
        logits = self.drafter.draft_logits(self.lm_head, hidden)  # [c, scored vocab]: the draft vocabulary, if any
        if self.draft_confidence_threshold is not None:
            # judged on the distributions the greedy drafts come from (a Markov head's corrected ones), never on a
            # sampled draft
            judged = logits
            if self.use_markov:
                judged = self.drafter.draft_tokens(logits, input_ids[0, -1].to(logits.device), return_logits=True)[1]
            logits = logits[: confident_drafts(judged, self.draft_confidence_threshold)]
        return self._choose_drafts(input_ids, logits)

    def _choose_drafts(self, input_ids, logits):
        """Pick drafts slot by slot as the target will judge them: logits processors see the sequence so far and the
        Markov head the previous choice. The returned logits are exactly those each draft was drawn from, over the
        target's vocabulary (-inf outside a draft vocabulary: q = 0 there); slot k's depend on the drafts before it
        only, never on its own draft, so trimming the block by them keeps sampling exact. logits [c, scored vocab]"""
        if not (self.do_sample or len(self.logits_processor)):  # plain greedy: the rule training uses too
            drafts, chosen_from = self.drafter.draft_tokens(logits, input_ids[0, -1].to(logits.device), return_logits=True)
            return torch.cat([input_ids, drafts[None].to(input_ids.device)], dim=-1), None, chosen_from
        sequence, previous, chosen_from = input_ids, input_ids[:, -1], []
        logits = logits.to(input_ids.device)  # processors index with the sequence
        for slot_logits in logits.split(1):  # [1, scored vocab]
            if self.use_markov:
                correction = self.drafter.markov_correction(previous)
                slot_logits = slot_logits + correction.float().to(slot_logits.device)
            slot_logits = self.drafter.full_vocab_logits(slot_logits)  # [1, V]: processors index target ids
            if len(self.logits_processor):
                slot_logits = self.logits_processor(sequence, slot_logits)
            if self.do_sample:
                draft = torch.multinomial(slot_logits.softmax(-1), num_samples=1)
            else:
                draft = slot_logits.argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, draft.to(sequence.device)], dim=-1)
            previous = draft[:, 0]
            chosen_from.append(slot_logits)
        chosen_from = torch.stack(chosen_from, dim=1)  # [1, c, V]
        return sequence, chosen_from, chosen_from[0]

    # -- the CandidateGenerator interface ------------------------------------------------------------------------

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        if is_first_iteration:  # no target features yet: the target prefills and emits the first token itself
            return input_ids, None
        started = time.perf_counter()
        self._absorb_verification(input_ids, model_outputs)
        room = self.max_length - input_ids.shape[1] - 1  # leave room for the bonus token
        if room <= 0:  # the last token: a plain step, not a policy's round
            self.last_kind = None
            return input_ids, None
        kind, ngram = "draft", None
        if self.policy is not None:
            kind, ngram = self.policy.choose_round(input_ids[0], room)
        policy_seconds = time.perf_counter() - started
        candidate_logits, confidence, predicted = None, None, None
        if kind == "draft":
            candidates, candidate_logits, chosen_from = self._propose(input_ids, min(self.max_drafts, room))
            if self.policy is not None:
                chosen = time.perf_counter()
                confidence = chosen_from.float().softmax(-1).amax(-1)  # [c] the drafter's top probability per slot
                num_drafts, predicted = self.policy.choose_num_drafts(confidence)
                candidates = candidates[:, : input_ids.shape[1] + num_drafts]
                candidate_logits = None if candidate_logits is None else candidate_logits[:, :num_drafts]
                policy_seconds += time.perf_counter() - chosen
        elif kind == "ngram":
            # a point mass on each candidate token: with no candidate logits transformers samples the target's token
            # at each position and keeps the candidate while they agree, which accepts it with probability p(token)
            # and otherwise emits a token from p restricted to the others (speculative sampling with q = 1)
            candidates = torch.cat([input_ids, ngram[None, :room].to(input_ids.device)], dim=-1)
        else:
            candidates = input_ids
        _synchronize(self.drafter.device)
        self.verify_started = time.perf_counter()
        self.last_kind, self.current_confidence = kind, confidence
        self.current_round = DraftRound(
            anchor_position=input_ids.shape[1] - 1,
            proposed=candidates.shape[1] - input_ids.shape[1],
            carried=0 if self.carried is None or kind != "draft" else self.carried[0].shape[2],
            committed_rows=self.cache.get_seq_length(),
            drafts=candidates[0, input_ids.shape[1] :].tolist(),
            draft_seconds=self.verify_started - started,
            kind=kind,
            predicted_accepted=predicted,
            policy_seconds=policy_seconds,
        )
        return candidates, candidate_logits if self.do_sample else None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self.current_round is None:  # that forward was a plain target step outside the policy
            return
        _synchronize(input_ids.device)
        self.current_round.accepted = int(num_matches)
        self.current_round.verify_seconds = time.perf_counter() - self.verify_started
        self.stats.rounds.append(self.current_round)
        if self.policy is not None:
            self.policy.observe(self.current_round, self.current_confidence)
        self.current_round = None


class FirstStopInRound(StoppingCriteria):
    """transformers checks the stopping criteria once per round, after all its accepted tokens, and cuts only at EOS
    and max length: a stop string or custom criterion met mid-round would let the output run on. This wrapper checks
    every new prefix and remembers the shortest length at which `criteria` fire, where the output is then cut."""

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int):
        self.criteria, self.checked_length, self.stop_length = criteria, prompt_length, None
        # transformers cuts EOS and max length itself (and max time is round-grained anyway): no prefix checks then
        self.cut_by_transformers = all(isinstance(c, (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria)) for c in criteria)

    def __call__(self, input_ids, scores, **kwargs):
        if self.cut_by_transformers:
            return self.criteria(input_ids, scores, **kwargs)
        while self.stop_length is None and self.checked_length < input_ids.shape[1]:
            self.checked_length += 1
            if self.criteria(input_ids[:, : self.checked_length], scores, **kwargs).any():
                self.stop_length = self.checked_length
        return torch.full((input_ids.shape[0],), self.stop_length is not None, dtype=torch.bool, device=input_ids.device)


def cut_output(output, length):
    """`generate`'s output (ids, or a ModelOutput with per-token tuples and the cache) cut to `length` tokens."""
    if length is None:
        return output
    if isinstance(output, torch.Tensor):
        return output[:, :length]
    removed = output.sequences.shape[1] - length
    output.sequences = output.sequences[:, :length]
    for name in ("scores", "logits", "attentions", "hidden_states"):  # one entry per generated token
        if getattr(output, name, None) is not None:
            setattr(output, name, getattr(output, name)[: len(getattr(output, name)) - removed])
    if removed and getattr(output, "past_key_values", None) is not None:
        output.past_key_values.crop(-removed)
    return output


@contextlib.contextmanager
def _candidate_generator_of(target, candidate_generator):
    """Make `target._assisted_decoding` use `candidate_generator` (an instance-level override; not thread-safe)."""
    previous = vars(target).get("_get_candidate_generator")
    target._get_candidate_generator = lambda *args, **kwargs: candidate_generator
    try:
        yield
    finally:
        if previous is None:
            del target._get_candidate_generator
        else:
            target._get_candidate_generator = previous


def carryover_decoding(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    carryover_drafter=None,
    carryover=None,
    carryover_streamer=None,
    draft_confidence_threshold=None,
    carryover_num_assistant_tokens=None,
    speculation_policy=None,
    inputs_tensor=None,
    **model_kwargs,
):
    """The decoding method handed to `generate(custom_generate=...)`: transformers' assisted decoding loop with a
    `CarryoverCandidateGenerator`, cut where a stopping criterion first fires (`FirstStopInRound`; a streamer may
    already have received the tokens after a mid-round stop string)."""
    if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
        raise ValueError("Carryover decoding supports num_beams=1 and num_return_sequences=1 only.")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("Carryover decoding starts from an empty target cache; do not pass a pre-filled past_key_values.")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("Carryover decoding does not support padded prompts; pass the prompt without padding.")
    generator = CarryoverCandidateGenerator(
        model, carryover_drafter, generation_config, logits_processor, carryover=carryover, input_ids=input_ids,
        draft_confidence_threshold=draft_confidence_threshold, num_assistant_tokens=carryover_num_assistant_tokens,
        speculation_policy=speculation_policy or getattr(generation_config, "speculation_policy", None),
    )
    if carryover_streamer is not None:
        carryover_streamer.put(input_ids.cpu())
    first_stop = FirstStopInRound(stopping_criteria, input_ids.shape[1])
    with _candidate_generator_of(model, generator):
        output = GenerationMixin._assisted_decoding(
            model,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=StoppingCriteriaList([first_stop]),
            generation_config=generation_config,
            assistant_model=carryover_drafter,
            streamer=carryover_streamer,
            inputs_tensor=inputs_tensor,
            **model_kwargs,
        )
    return cut_output(output, first_stop.stop_length)


def _stop_strings_as_criterion(model, kwargs):
    """transformers does not hand `tokenizer` to a custom decoding function: turn stop strings (from the call or a
    generation config) into a `StopStringCriteria` in `kwargs` here, leaving the caller's config as it is."""
    generation_config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or generation_config.stop_strings
    tokenizer = kwargs.pop("tokenizer", None)
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: generate(..., stop_strings=..., tokenizer=tokenizer).")
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), StopStringCriteria(tokenizer, stop_strings)])
    if "generation_config" in kwargs:
        kwargs["generation_config"] = copy.deepcopy(generation_config)
        kwargs["generation_config"].stop_strings = None
    else:
        kwargs["stop_strings"] = None


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose float32 CPU inference runs as a oneDNN matmul against a copy of its weight packed once
    into oneDNN's blocked layout (the kernel and packing that torch.compile's CPU backend uses for linear layers).

    Why: on some CPUs (the 2-core AMD EPYC machine here) the default float32 GEMM (MKL) costs about M times one row
    for the M = 1-8 rows that decoding and verification feed, so a 2-token SmolLM2 forward cost 1.7-2.2 plain steps;
    oneDNN's cost grows slowly with M. Same weights, float32 both ways: outputs agree to float32 rounding. Training,
    other dtypes and devices take `nn.Linear`'s own path; the packed copy is made again if the weight changes."""

    def __init__(self, weight, bias=None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias  # the swapped layer's own: tied weights stay tied, the state dict unchanged
        self._packed = None  # (key, weight in oneDNN's layout)

    def _packed_weight(self):
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()))
        return self._packed[1]

    def forward(self, x):
        fast = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        if not fast or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self._packed_weight(), bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def swap_in_onednn_linears(model: nn.Module) -> list:
    """Replace every `nn.Linear` of `model` by a `OneDNNLinear` sharing its weights; returns (parent, name, original)
    for each swap, so that a caller can put the originals back. A layer swapped before reuses its packed twin (kept
    on the original, outside its submodules), so swapping per `generate` call does not repack the weights."""
    swapped = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            twin = child.__dict__.get("_onednn_twin")
            if twin is None or twin.weight is not child.weight or twin.bias is not child.bias:
                twin = OneDNNLinear(child.weight, child.bias)
                child.__dict__["_onednn_twin"] = twin  # not via setattr: it must not become a submodule
            setattr(module, name, twin)
            swapped.append((module, name, child))
    return swapped


LINEAR_BACKENDS = ("auto", "onednn", "default")


def resolve_linear_backend(backend: str, *models) -> str:
    """"auto" -> "onednn" where every model is float32 on CPU and torch has oneDNN's kernels, else "default"; any
    other name as it is."""
    if backend != "auto":
        return backend
    parameters = [next(model.parameters()) for model in models]
    on_cpu_float32 = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in parameters)
    return "onednn" if on_cpu_float32 and onednn_available() else "default"


@contextlib.contextmanager
def linear_backend_of(backend: str, *models):
    """Inside the block, the float32 CPU `nn.Linear` layers of `models` run with `backend`: "onednn" as `OneDNNLinear`
    (the same weights; outputs agree to float32 rounding), "default" as they are, "auto" as oneDNN where torch has
    its kernels and the models are float32 on CPU. The user's modules are put back afterwards, even on error.

    Why: verifying 8 rows with torch's default float32 GEMM costs 1.35-1.99 plain steps on the 2-core AMD EPYC
    machine here against 1.25-1.51 with oneDNN, and a plain step itself 1.6-1.9x as long (experiments/onednn-linear)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}.")
    if backend == "onednn" and resolve_linear_backend("auto", *models) != "onednn":
        raise ValueError("linear_backend='onednn' needs float32 models on CPU and a torch build with oneDNN kernels.")
    if resolve_linear_backend(backend, *models) == "default":
        yield
        return
    swapped = [swap for model in models for swap in swap_in_onednn_linears(model)]
    try:
        yield
    finally:
        for parent, name, original in swapped:
            setattr(parent, name, original)


def generate(
    model, *args, assistant_model=None, carryover=None, streamer=None, draft_confidence_threshold=None,
    speculation_policy=None, linear_backend=None, **kwargs
):
    """Speculative decoding of `model` (the target) with a Carryover drafter as `assistant_model`.

    This is both the Hub `custom_generate` entry point (`target.generate(..., assistant_model=drafter,
    custom_generate=<drafter folder>, trust_remote_code=True)`) and the in-process API
    (`modeling_carryover.generate(target, **inputs, assistant_model=drafter, max_new_tokens=...)`).
    `carryover=False` decodes with the same weights but without carried rows (the paper's OFF); the default is the
    drafter config's `carryover`. `speculation_policy` (or the generation config's field of that name): "adaptive"
    chooses each round between the drafter's block (and how many of its drafts to verify), a
    prompt-lookup candidate and a plain step by expected tokens per second (`SpeculationPolicy`); "fixed" drafts every
    round and verifies all its drafts, or with `draft_confidence_threshold` (in (0, 1]) only the leading drafts whose
    running product of the drafter's top probabilities stays at or above it (at least one a round;
    `confident_drafts`); "fixed" is the default. Both stay within `num_assistant_tokens` (drafts per round; unset: all `block_size - 1`).
    `linear_backend` (or the generation config's field): "default" leaves the linear layers as they are; "auto" runs
    the float32 CPU linear layers of target and drafter with oneDNN for the call where torch has its kernels
    (`linear_backend_of`; the user's modules are restored after), "onednn" insists. Opt-in: it paid on the host of
    experiments/onednn-linear, not on the one of experiments/speculative-linear-default.
    Afterwards `assistant_model.generation_stats` holds the per-round records.
    """
    if assistant_model is None or not hasattr(assistant_model, "block_inputs"):
        raise ValueError(
            "Carryover decoding needs the drafter as `assistant_model=`, loaded with "
            "`AutoModel.from_pretrained(<drafter>, trust_remote_code=True)`; got "
            f"{type(assistant_model).__name__}."
        )
    kwargs.pop("custom_generate", None)
    _stop_strings_as_criterion(model, kwargs)
    generation_config = kwargs.get("generation_config") or model.generation_config
    backend = linear_backend or getattr(generation_config, "linear_backend", None) or "default"
    with linear_backend_of(backend, model, assistant_model):
        return GenerationMixin.generate(
            model,
            *args,
            custom_generate=carryover_decoding,
            carryover_drafter=assistant_model,
            carryover=carryover,
            carryover_streamer=streamer,
            draft_confidence_threshold=draft_confidence_threshold,
            carryover_num_assistant_tokens=kwargs.pop("num_assistant_tokens", None),
            speculation_policy=speculation_policy,
            **kwargs,
        )
