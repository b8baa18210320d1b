"""Cost-aware speculation: each cycle, draft what is expected to pay on this host, and nothing where nothing does.

A drafted token pays only if its chance of acceptance, in tokens, is worth more than what drafting and
verifying it cost. Both sides move. A verification's cost per extra token depends on the host: a 4-bit
target on a 2-core AVX2 CPU pays about a sixth of a decoding step for each, a GPU nearly nothing. And
acceptance depends on the text: a summary copies its source, small talk does not. So the decoder measures
both while it runs and decides every cycle:

* **costs** (:class:`Costs`): the target's forward by new tokens (1..:data:`MAX_NEW`), the drafter's first
  draft of a cycle (catching up on what was verified included) and each further draft. The target's are
  measured once per host and thread count and kept (:mod:`moaspec.costs`); every timed cycle refreshes them.
* **acceptance** (:class:`Acceptance`): prompt lookup's by position in its copy, the drafter's by its own
  probability of the drafted token and by depth, from every verification, in counts that fade so that a
  request's own history soon outweighs the prior it started from.
* **the rule** (:func:`best_extension`, a pure function): the proposal that maximises expected new tokens
  per second this cycle. Lookup's first ``l`` copied tokens, or the drafter's chain, grown one draft at a
  time while another draft is expected to raise the cycle's rate, or nothing at all: a plain step.

Only what is drafted changes, never how it is verified, so output stays lossless. For sampling the rule
reads the drafter's distribution (its largest probability), never the token drawn from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MAX_NEW = 16  # the most new tokens one verification takes under the policy (and the cost table's length)
MAX_CHAIN = 8  # the most drafter drafts per cycle: past it the drafter's acceptance has always fallen too far
BINS = 10  # the drafter's probabilities are binned by tenths
CAP = 24.0  # counts fade once a cell holds this many tries: about the last two dozen outcomes decide
EXPLORE_EVERY = 16  # cycles without the drafter before one draft is tried anyway, to see if its acceptance rose
EMA = 0.2  # weight of a new timing in the moving averages


def best_extension(tokens: float, seconds: float, reach: float, accept: Sequence[float],
                   extra: Sequence[float]) -> tuple[int, float]:
    """How many more drafts (0..len(accept)) maximise a cycle's expected tokens per second, and that rate.

    The cycle so far expects ``tokens`` new tokens in ``seconds``; ``reach`` is the chance that every draft
    it holds is accepted (so that the next one counts at all); ``accept[j]`` is the chance that the
    ``j+1``-th further draft is accepted given all before it were; ``extra[j]`` is what ``j+1`` further
    drafts add to the cycle's seconds (drafting them and verifying them). Ties go to fewer drafts.
    """
    best, rate = 0, tokens / seconds
    for j, (a, more) in enumerate(zip(accept, extra)):
        reach *= a
        tokens += reach
        r = tokens / (seconds + more)
        if r > rate * (1 + 1e-9):
            best, rate = j + 1, r
    return best, rate


@dataclass
class Costs:
    """Seconds a cycle's parts take on this host: ``target[k-1]`` a target forward with ``k`` new tokens;
    ``draft_first`` the drafter's first draft of a cycle (its catching up on verified tokens included);
    ``draft_next`` each further draft.

    Timings taken while decoding refresh them in two ways: a common ``scale`` follows the whole table (a
    busier host, a longer context, a batch shared with other requests make every size dearer at once), and
    the entry of the size timed follows its own shape. So a size seldom timed still moves with the rest.
    """

    target: list[float]
    draft_first: float
    draft_next: float
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.target or min(self.target) <= 0 or self.draft_first <= 0 or self.draft_next <= 0:
            raise ValueError(f"costs must be positive seconds, got {self}")

    def verify_s(self, new: int) -> float:
        """A target forward with ``new`` new tokens (sizes past the table cost as its last, grown in step)."""
        n = len(self.target)
        if new <= n:
            return self.scale * self.target[new - 1]
        step = (self.target[-1] - self.target[0]) / max(1, n - 1)
        return self.scale * (self.target[-1] + step * (new - n))

    def timed_target(self, new: int, seconds: float) -> None:
        """A forward with ``new`` new tokens took ``seconds``."""
        if not 1 <= new <= len(self.target) or seconds <= 0:
            return
        base = self.target[new - 1]
        self.scale += EMA * (seconds / base - self.scale)
        self.target[new - 1] = base + EMA / 4 * (seconds / self.scale - base)

    def timed_draft(self, first: bool, seconds: float) -> None:
        """The drafter's first draft of a cycle (``first``), or a further one, took ``seconds``."""
        if seconds <= 0:
            return
        if first:
            self.draft_first += EMA * (seconds - self.draft_first)
        else:
            self.draft_next += EMA * (seconds - self.draft_next)

    def copy(self) -> Costs:
        return Costs(list(self.target), self.draft_first, self.draft_next, self.scale)


def default_draft_costs(step_s: float) -> tuple[float, float]:
    """Before any draft was timed: a MoA drafter's first and further drafts against the target's decoding step
    ``step_s`` on a 2-core CPU (3.3 and 2 ms against 13.4 ms, BENCHMARKS.md); the first cycles correct them."""
    return 0.25 * step_s, 0.15 * step_s


@dataclass
class Rate:
    """An acceptance rate as counts that fade: ``hits`` of ``tries``, both scaled down past :data:`CAP`."""

    hits: float
    tries: float

    @property
    def p(self) -> float:
        return self.hits / self.tries

    def add(self, hit: bool) -> None:
        self.hits += hit
        self.tries += 1
        if self.tries > CAP:
            self.hits *= CAP / self.tries
            self.tries = CAP


def _prior(p: float, weight: float) -> Rate:
    return Rate(p * weight, weight)


@dataclass
class Acceptance:
    """Chances of acceptance, each given that every draft before it in the cycle was accepted.

    ``lookup[i]``: the ``i+1``-th token of a prompt-lookup copy. ``by_probability[b]``: a drafter draft whose
    likeliest token had probability in tenth ``b`` (the shipped drafter's probability is close to this
    chance, so that is the prior). ``by_depth[i]``: the drafter's ``i+1``-th draft, for planning before the
    drafter has said anything.
    """

    lookup: list[Rate] = field(default_factory=lambda: [_prior(0.6 if i == 0 else 0.75, 2.0) for i in range(MAX_NEW)])
    by_probability: list[Rate] = field(default_factory=lambda: [_prior((b + 0.5) / BINS, 4.0) for b in range(BINS)])
    by_depth: list[Rate] = field(default_factory=lambda: [_prior(0.45 if i == 0 else 0.6, 2.0) for i in range(MAX_CHAIN)])

    def copy(self) -> Acceptance:
        def rates(cells: list[Rate]) -> list[Rate]:
            return [Rate(c.hits, c.tries) for c in cells]

        return Acceptance(rates(self.lookup), rates(self.by_probability), rates(self.by_depth))

    def blend(self, other: Acceptance, weight: float = 0.5) -> None:
        """Move toward ``other`` (a finished request's), so that the next request starts from what was seen."""
        for mine, theirs in ((self.lookup, other.lookup), (self.by_probability, other.by_probability),
                             (self.by_depth, other.by_depth)):
            for m, t in zip(mine, theirs):
                m.hits += weight * (t.hits - m.hits)
                m.tries += weight * (t.tries - m.tries)

    def drafted(self, probability: float) -> float:
        return self.by_probability[min(BINS - 1, int(probability * BINS))].p

    @staticmethod
    def record(cells: Sequence[Rate], proposed: int, accepted: int) -> None:
        """``proposed`` drafts were verified and the first ``accepted`` kept: each up to the first rejection
        is an outcome; those after it were never reached."""
        for i in range(min(proposed, accepted + 1, len(cells))):
            cells[i].add(i < accepted)


class Speculation:
    """One request's cost-aware drafting: the decisions of a cycle, and what each verification taught.

    ``costs`` is shared by every request of a :class:`Policy` (the host's), ``acceptance`` is this request's
    own, started from the policy's. The proposer asks :meth:`plan` at the start of a cycle, and while the
    drafter drafts, :meth:`keep` after each draft and :meth:`more` before drafting another; the decoding loop
    reports each verification's time (:meth:`timed`) and the proposer what it kept (:meth:`outcome`).
    """

    def __init__(self, costs: Costs, acceptance: Acceptance, drafter: bool) -> None:
        self.costs = costs
        self.acceptance = acceptance
        self.has_drafter = drafter
        self.idle = 0  # cycles since the drafter last drafted
        # the cycle being drafted: its expected tokens and seconds, the chance all its drafts are accepted,
        # the drafts' probabilities, and when the drafter's current draft started (for timing it)
        self._tokens = self._seconds = self._reach = 0.0
        self._probabilities: list[float] = []
        self._started = 0.0
        self._kind = "plain"
        self._proposed = 0
        self.tree_tokens: float | None = None  # a tree cycle's tokens and drafting seconds in this request (averages)
        self.tree_draft_s = 0.0

    # --- the start of a cycle -----------------------------------------------------------

    def _drafter_prospect(self, most: int) -> tuple[int, float]:
        c = self.costs
        base = c.verify_s(1)
        accept = [r.p for r in self.acceptance.by_depth[:most]]
        extra = [c.draft_first + c.draft_next * j + c.verify_s(j + 2) - base for j in range(len(accept))]
        return best_extension(1.0, base, 1.0, accept, extra)

    def plan(self, copied: int, drafter_most: int) -> tuple[str, int]:
        """At a cycle's start, with ``copied`` lookup tokens at hand and room for ``drafter_most`` drafter drafts:
        ("lookup", l) to verify the first ``l`` copied tokens, ("drafter", m) to let the drafter draft (``m``
        is the chain expected to pay; :meth:`keep` and :meth:`more` decide as it goes), or ("plain", 0)."""
        c = self.costs
        base = c.verify_s(1)
        options = [("plain", 0, 1.0 / base)]
        if copied:
            accept = [r.p for r in self.acceptance.lookup[:copied]]
            n, rate = best_extension(1.0, base, 1.0, accept, [c.verify_s(j + 2) - base for j in range(len(accept))])
            if n:
                options.append(("lookup", n, rate))
        if self.has_drafter and drafter_most:
            m, rate = self._drafter_prospect(min(drafter_most, MAX_CHAIN))
            if m:
                options.append(("drafter", m, rate))
            elif self.idle >= EXPLORE_EVERY and not copied:
                options.append(("drafter", 1, float("inf")))  # worth a look now and then: acceptance moves
        kind, n, _ = max(options, key=lambda o: o[2])
        self._kind, self._proposed = kind, n if kind == "lookup" else 0
        self.idle = 0 if kind == "drafter" else self.idle + 1
        if kind == "drafter":
            self._tokens, self._seconds, self._reach = 1.0, base, 1.0
            self._probabilities = []
            self._started = time.perf_counter()
        return kind, n

    # --- while the drafter drafts -------------------------------------------------------

    def keep(self, index: int, probability: float) -> bool:
        """The drafter's draft ``index`` (0-based) has its likeliest token at ``probability``: keep it if verifying
        it raises the cycle's expected rate (its drafting is paid already)."""
        now = time.perf_counter()
        self.costs.timed_draft(index == 0, now - self._started)
        c = self.costs
        self._seconds += c.draft_first if index == 0 else c.draft_next
        n = len(self._probabilities)
        extra = c.verify_s(n + 2) - c.verify_s(n + 1)
        a = self.acceptance.drafted(probability)
        if best_extension(self._tokens, self._seconds, self._reach, [a], [extra])[0] == 0:
            return False
        self._tokens += self._reach * a
        self._reach *= a
        self._seconds += extra
        self._probabilities.append(probability)
        return True

    def more(self, index: int) -> bool:
        """Before drafting draft ``index``: whether the drafts still to come are expected to raise the cycle's rate."""
        c = self.costs
        room = MAX_CHAIN - index
        if room <= 0:
            return False
        n = len(self._probabilities)
        accept = [r.p for r in self.acceptance.by_depth[index : index + room]]
        extra = [c.draft_next * (j + 1) + c.verify_s(n + j + 2) - c.verify_s(n + 1) for j in range(len(accept))]
        go = best_extension(self._tokens, self._seconds, self._reach, accept, extra)[0] > 0
        if go:
            self._started = time.perf_counter()
        return go

    # --- trees ----------------------------------------------------------------------------

    def plan_tree(self, nodes: int) -> bool:
        """Whether a tree of ``nodes`` tokens (its root included) is expected to beat a plain step this cycle, from
        the tokens and drafting time of this request's trees so far (a tree's acceptance is its own: the rule
        keeps one average per request, and tries a tree now and then when plain steps have won)."""
        c = self.costs
        if self.tree_tokens is None:
            accept = [r.p for r in self.acceptance.by_depth]
            self.tree_tokens = best_extension(1.0, 1.0, 1.0, accept, [0.0] * len(accept))[1]  # a chain's, as a floor
            self.tree_draft_s = c.draft_first + c.draft_next * 2
        go = (self.tree_tokens / (self.tree_draft_s + c.verify_s(nodes)) > 1.0 / c.verify_s(1)
              or self.idle >= EXPLORE_EVERY)
        self.idle = 0 if go else self.idle + 1
        return go

    def tree_outcome(self, tokens: int, draft_s: float) -> None:
        """A tree cycle added ``tokens`` tokens and took ``draft_s`` seconds of drafting."""
        assert self.tree_tokens is not None, "plan_tree() first"
        self.tree_tokens += EMA * (tokens - self.tree_tokens)
        self.tree_draft_s += EMA * (draft_s - self.tree_draft_s)

    # --- after the verification ---------------------------------------------------------

    def timed(self, new: int, seconds: float) -> None:
        """The cycle's target forward had ``new`` new tokens and took ``seconds``."""
        self.costs.timed_target(new, seconds)

    def outcome(self, proposed: int, accepted: int) -> None:
        """Of the cycle's ``proposed`` drafts the first ``accepted`` were kept."""
        a = self.acceptance
        if self._kind == "lookup":
            a.record(a.lookup, proposed, accepted)
        elif self._kind == "drafter" and proposed:
            a.record(a.by_depth, proposed, accepted)
            cells = [a.by_probability[min(BINS - 1, int(p * BINS))] for p in self._probabilities[:proposed]]
            a.record(cells, proposed, accepted)
        self._kind = "plain"


@dataclass
class Policy:
    """The host's costs and the acceptance every new request starts from; one per loaded strategy, shared by its
    requests (their updates are a few float additions each, so threads may share it: a lost update costs
    nothing but a slightly older estimate)."""

    costs: Costs
    acceptance: Acceptance = field(default_factory=Acceptance)
    source: str = "measured in this process"  # where the costs came from (a file of measured costs)
    keep: Callable[[Costs], None] | None = None  # told the refreshed costs after each request (to save them)

    def request(self, drafter: bool) -> Speculation:
        return Speculation(self.costs, self.acceptance.copy(), drafter)

    def finished(self, speculation: Speculation) -> None:
        self.acceptance.blend(speculation.acceptance)
        if self.keep is not None:
            self.keep(self.costs)
