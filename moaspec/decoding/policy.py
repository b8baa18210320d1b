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
POSITIONS = 4  # acceptance is kept per position for the first drafts of a cycle; the ones after share the last cell
NGRAMS = 3  # lookup's acceptance is kept apart for copies that followed a match of 1, 2, and 3 or more tokens
REQUEST_PRIOR = 4.0  # a request starts from what earlier ones saw, weighted as this many tries per cell
EXPLORE_EVERY = 16  # cycles without the drafter before it is tried anyway, to see if its acceptance rose; each look
EXPLORE_MOST = 256  # that does not win the drafter back doubles the wait, up to this
EXPLORE_WITHIN = 0.9  # ... but only while its expected rate is within this of a plain step's: a look costs the
# drafter's catch-up on every token since it last read (the prompt, the first time), which a drafter far from
# paying does not win back (on a 2-core CPU with a 4-bit target it cost 4% of 128-token answers)
EXPLORE_UNREAD = 128  # ... nor while the drafter would first have to read more tokens than this (a long prompt)
EMA = 0.2  # weight of a new timing in the moving averages
OUTLIER = 2.0  # one timing moves an estimate at most as if it were this many times above or below it


def extend(tokens: float, seconds: float, reach: float, accept: Sequence[float],
           extra: Sequence[float]) -> tuple[int, float, float]:
    """How many more drafts (0..len(accept)) maximise a cycle's expected tokens per second, and the cycle's expected
    tokens and seconds with them.

    The cycle so far expects ``tokens`` new tokens in ``seconds``; ``reach`` is the chance that every draft
    it holds is accepted (so that the next one counts at all); ``accept[j]`` is the chance that the
    ``j+1``-th further draft is accepted given all before it were; ``extra[j]`` is what ``j+1`` further
    drafts add to the cycle's seconds (drafting them and verifying them). Ties go to fewer drafts.
    """
    best, best_tokens, best_seconds = 0, tokens, seconds
    for j, (a, more) in enumerate(zip(accept, extra)):
        reach *= a
        tokens += reach
        if tokens / (seconds + more) > best_tokens / best_seconds * (1 + 1e-9):
            best, best_tokens, best_seconds = j + 1, tokens, seconds + more
    return best, best_tokens, best_seconds


def best_extension(tokens: float, seconds: float, reach: float, accept: Sequence[float],
                   extra: Sequence[float]) -> tuple[int, float]:
    """:func:`extend`'s choice and the cycle's expected tokens per second with it."""
    n, tokens, seconds = extend(tokens, seconds, reach, accept, extra)
    return n, tokens / seconds


def drafter_rate(base: float, draft_first: float, draft_next: float, verify_extra: Sequence[float],
                 first: Sequence[float], accept_first: Sequence[float], accept_after: Sequence[float]) -> tuple[int, float]:
    """Expected tokens per second of a cycle that lets the drafter draft, and the longest chain worth drafting.

    Whether the first draft pays depends on how sure the drafter turns out to be: ``first[b]`` is the share of
    first drafts whose likeliest token falls in probability bin ``b``, ``accept_first[b]`` their acceptance.
    Once the drafter has said how sure it is, the cycle keeps the chain that pays for that bin, or none (then
    the cycle is a plain step that paid ``draft_first`` for nothing). ``accept_after[j]`` is the acceptance of
    the ``j+2``-th draft, ``draft_next`` the drafting of each after the first, ``verify_extra[j]`` what
    verifying ``j+1`` drafts adds to the plain step's ``base`` seconds.
    """
    extra = [v + draft_next * j for j, v in enumerate(verify_extra)]
    tokens = seconds = 0.0
    longest = 0
    for share, a in zip(first, accept_first):
        if share > 0:
            n, t, s = extend(1.0, base + draft_first, 1.0, [a, *accept_after], extra)
            tokens, seconds, longest = tokens + share * t, seconds + share * s, max(longest, n)
    return longest, tokens / seconds if seconds else 0.0


@dataclass
class Costs:
    """Seconds a cycle's parts take on this host: ``target[k-1]`` a target forward with ``k`` new tokens;
    ``draft_first`` the drafter's first draft of a cycle (its reading of the tokens verified since included);
    ``draft_next`` each further draft.

    Timings taken while decoding refresh them in two ways: a common ``scale`` follows the whole table (a
    busier host, a longer context, a batch shared with other requests make every size dearer at once), and
    the entry of the size timed follows its own shape. So a size seldom timed still moves with the rest.
    Each timing counts as at most :data:`OUTLIER` times the estimate, above or below: a process paused or
    preempted for a moment must not make speculation look ruinous for the rest of the run (a host that really
    slows down moves the estimates all the same, over a few cycles).
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
        seconds = _bounded(seconds, self.scale * base)
        self.scale += EMA * (seconds / base - self.scale)
        self.target[new - 1] = base + EMA / 4 * (_bounded(seconds / self.scale, base) - base)

    def timed_draft(self, first: bool, seconds: float) -> None:
        """The drafter's first draft of a cycle (``first``), or a further one, took ``seconds``."""
        if seconds <= 0:
            return
        if first:
            self.draft_first += EMA * (_bounded(seconds, self.draft_first) - self.draft_first)
        else:
            self.draft_next += EMA * (_bounded(seconds, self.draft_next) - self.draft_next)

    def copy(self) -> Costs:
        return Costs(list(self.target), self.draft_first, self.draft_next, self.scale)


def _bounded(seconds: float, estimate: float) -> float:
    return min(max(seconds, estimate / OUTLIER), estimate * OUTLIER)


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


def at(cells: Sequence[Rate], start: int, stop: int) -> list[Rate]:
    """The cells of positions ``start..stop-1``: a position past the last cell reads the last (so the same cell may
    come several times, and recording into the list counts each of its outcomes)."""
    return [cells[min(i, len(cells) - 1)] for i in range(start, stop)]


def _bin(probability: float) -> int:
    return min(BINS - 1, max(0, int(probability * BINS)))


def _prior(p: float, weight: float) -> Rate:
    return Rate(p * weight, weight)


@dataclass
class Acceptance:
    """Chances of acceptance, each given that every draft before it in the cycle was accepted.

    Past the first :data:`POSITIONS` drafts of a cycle one cell serves every position (:func:`at`): deep drafts
    are reached too seldom to be learned one by one, and once that far a copy or a chain tends to keep holding.
    ``lookup[m][i]``: the ``i+1``-th token of a prompt-lookup copy that followed a match of ``m+1`` tokens
    (the last row: that many or more; a longer match is a surer copy). ``by_probability[b]``: a drafter draft whose
    likeliest token had probability in tenth ``b`` (the shipped drafter's probability is close to this
    chance, so that is the prior). ``by_depth[i]``: the drafter's ``i+1``-th draft, for planning before the
    drafter has said anything.
    """

    lookup: list[list[Rate]] = field(default_factory=lambda: [
        [_prior((0.6, 0.75, 0.8, 0.85)[i], 2.0) for i in range(POSITIONS)] for _ in range(NGRAMS)])
    by_probability: list[Rate] = field(default_factory=lambda: [_prior((b + 0.5) / BINS, 4.0) for b in range(BINS)])
    by_depth: list[Rate] = field(default_factory=lambda: [_prior((0.45, 0.6, 0.65, 0.7)[i], 2.0) for i in range(POSITIONS)])
    first: list[float] = field(default_factory=lambda: [1.0 / BINS] * BINS)  # shares of first drafts by probability bin
    tree_tokens: float = 0.0  # a drafted tree cycle's new tokens, and its drafting's seconds (reading the last
    tree_draft_s: float = 0.0  # cycle's verified states included), as moving averages (0: no tree seen yet)

    def cells(self) -> list[Rate]:
        return [r for row in self.lookup for r in row] + self.by_probability + self.by_depth

    def copy(self, weight: float | None = None) -> Acceptance:
        """A copy whose cells count as at most ``weight`` tries each (their rates unchanged): a request's own
        outcomes soon outweigh what the requests before it saw."""
        def rate(c: Rate) -> Rate:
            scale = 1.0 if weight is None or c.tries <= weight else weight / c.tries
            return Rate(c.hits * scale, c.tries * scale)

        return Acceptance([[rate(c) for c in row] for row in self.lookup], [rate(c) for c in self.by_probability],
                          [rate(c) for c in self.by_depth], list(self.first), self.tree_tokens, self.tree_draft_s)

    def blend(self, other: Acceptance, weight: float = 0.5) -> None:
        """Move toward ``other`` (a finished request's), so that the next request starts from what was seen."""
        for m, t in zip(self.cells(), other.cells()):
            m.hits += weight * (t.hits - m.hits)
            m.tries += weight * (t.tries - m.tries)
        self.first = [m + weight * (t - m) for m, t in zip(self.first, other.first)]
        if other.tree_tokens:
            w = weight if self.tree_tokens else 1.0
            self.tree_tokens += w * (other.tree_tokens - self.tree_tokens)
            self.tree_draft_s += w * (other.tree_draft_s - self.tree_draft_s)

    def drafted(self, probability: float) -> float:
        return self.by_probability[_bin(probability)].p

    def first_draft(self, probability: float) -> None:
        """A cycle's first draft had its likeliest token at ``probability`` (shares fade as counts do)."""
        self.first = [share * (1 - 1 / CAP) + (b == _bin(probability)) / CAP for b, share in enumerate(self.first)]

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

    def __init__(self, costs: Costs, acceptance: Acceptance, drafter: bool, timing: bool = True,
                 crowded: Callable[[], bool] | None = None) -> None:
        self.costs = costs
        self.timing = timing  # False: decisions from the costs given alone, never from this run's timings
        # whether the target's forwards are being run together with other requests' now (a busy server): each
        # token of such a forward costs about what a plain step's does, so nothing drafted can pay, and every
        # token drafted and rejected slows every request in the batch
        self.crowded = crowded
        self.acceptance = acceptance
        self.has_drafter = drafter
        self.idle = 0  # cycles since the drafter last drafted
        self.explore_after = EXPLORE_EVERY  # idle cycles before the drafter is tried anyway
        # the cycle being drafted: its expected tokens and seconds, the chance all its drafts are accepted,
        # the drafts' probabilities, and when the drafter's current draft started (for timing it)
        self._tokens = self._seconds = self._reach = 0.0
        self._probabilities: list[float] = []
        self._started = 0.0
        self._untimed = True  # the next first draft reads much more than a cycle's tokens (the prompt, a long catch-up)
        self._read_s = 0.0  # the drafter's reading of the last drafted cycle's verified states: part of its next draft
        self._kind = "plain"
        self._proposed = 0
        self._row = 0  # the lookup row of the cycle's copy
        self.cycles = {"plain": 0, "lookup": 0, "drafter": 0, "tree": 0}  # what each cycle chose, for reports

    # --- the start of a cycle -----------------------------------------------------------

    def _drafter_prospect(self, most: int) -> tuple[int, float]:
        c, a = self.costs, self.acceptance
        base = c.verify_s(1)
        return drafter_rate(base, c.draft_first, c.draft_next, [c.verify_s(j + 2) - base for j in range(most)],
                            a.first, [r.p for r in a.by_probability], [r.p for r in at(a.by_depth, 1, most)])

    def plan(self, copied: int, drafter_most: int, matched: int = 1, unread: int = 0) -> tuple[str, int]:
        """At a cycle's start, with ``copied`` lookup tokens at hand (after a match of ``matched`` tokens), room
        for ``drafter_most`` drafter drafts, and ``unread`` tokens the drafter has yet to read before it drafts (the
        prompt, until its first draft): a look at a drafter not expected to pay is not taken while that reading is
        longer than :data:`EXPLORE_UNREAD`.
        ("lookup", l) to verify the first ``l`` copied tokens, ("drafter", m) to let the drafter draft (``m``
        is the chain expected to pay; :meth:`keep` and :meth:`more` decide as it goes), or ("plain", 0)."""
        c = self.costs
        base = c.verify_s(1)
        options = [("plain", 0, 1.0 / base)]
        if self._batched():
            copied = drafter_most = 0
        if copied:
            self._row = min(matched, NGRAMS) - 1
            accept = [r.p for r in at(self.acceptance.lookup[self._row], 0, copied)]
            n, rate = best_extension(1.0, base, 1.0, accept, [c.verify_s(j + 2) - base for j in range(len(accept))])
            if n:
                options.append(("lookup", n, rate))
        m, drafter = 0, 0.0
        if self.has_drafter and drafter_most:
            m, drafter = self._drafter_prospect(min(drafter_most, MAX_CHAIN))
            if m:
                options.append(("drafter", m, drafter))
        kind, n, _ = max(options, key=lambda o: o[2])
        if kind == "drafter":
            self.explore_after = EXPLORE_EVERY
        elif kind == "plain" and drafter >= EXPLORE_WITHIN / base and unread <= EXPLORE_UNREAD and self._explore():
            kind, n = "drafter", max(1, m)
        self.cycles[kind] += 1
        self._kind, self._proposed = kind, n if kind == "lookup" else 0
        self.idle = 0 if kind == "drafter" else self.idle + 1
        if kind == "drafter":
            self._tokens, self._seconds, self._reach = 1.0, base, 1.0
            self._probabilities = []
            self._started = time.perf_counter()
        return kind, n

    def _batched(self) -> bool:
        """Whether this cycle's forward will run together with other requests' (then only a plain step pays)."""
        return self.crowded is not None and self.crowded()

    def _explore(self) -> bool:
        """Whether to try the drafter although it is not expected to pay: its acceptance moves with the text, and
        is only seen when it drafts. Each look that does not win it back makes the next wait twice as long."""
        if self.idle < self.explore_after:
            return False
        self.explore_after = min(2 * self.explore_after, EXPLORE_MOST)
        return True

    # --- while the drafter drafts -------------------------------------------------------

    def keep(self, index: int, probability: float) -> bool:
        """The drafter's draft ``index`` (0-based) has its likeliest token at ``probability``: keep it if verifying
        it raises the cycle's expected rate (its drafting is paid already)."""
        if self.timing and (index or not self._untimed):
            self.costs.timed_draft(index == 0, time.perf_counter() - self._started + (0.0 if index else self._read_s))
        self._untimed, self._read_s = False, 0.0
        if index == 0:
            self.acceptance.first_draft(probability)
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
        accept = [r.p for r in at(self.acceptance.by_depth, index, index + room)]
        extra = [c.draft_next * (j + 1) + c.verify_s(n + j + 2) - c.verify_s(n + 1) for j in range(len(accept))]
        go = best_extension(self._tokens, self._seconds, self._reach, accept, extra)[0] > 0
        if go:
            self._started = time.perf_counter()
        return go

    # --- trees ----------------------------------------------------------------------------

    def plan_tree(self, nodes: int) -> bool:
        """Whether a tree of ``nodes`` tokens (its root included) is expected to beat a plain step this cycle, from
        the tokens and drafting time of the trees seen so far (a tree's acceptance is its own: the rule keeps
        moving averages, started from the requests before, and tries a tree now and then when plain steps won,
        as long as it is expected to come within :data:`EXPLORE_WITHIN` of them, as for chains)."""
        c, a = self.costs, self.acceptance
        if not a.tree_tokens:
            accept = [r.p for r in at(a.by_depth, 0, MAX_CHAIN)]
            a.tree_tokens = best_extension(1.0, 1.0, 1.0, accept, [0.0] * len(accept))[1]  # a chain's, as a floor
            a.tree_draft_s = c.draft_first + c.draft_next * 2
        rate, plain = a.tree_tokens / (a.tree_draft_s + c.verify_s(nodes)), 1.0 / c.verify_s(1)
        if self._batched():
            rate = 0.0
        go = rate > plain
        if go:
            self.explore_after = EXPLORE_EVERY
        go = go or (rate >= EXPLORE_WITHIN * plain and self._explore())
        self.idle = 0 if go else self.idle + 1
        self.cycles["tree" if go else "plain"] += 1
        return go

    def tree_outcome(self, tokens: int, draft_s: float) -> None:
        """A tree cycle added ``tokens`` tokens and took ``draft_s`` seconds of drafting."""
        a = self.acceptance
        a.tree_tokens += EMA * (tokens - a.tree_tokens)
        if self.timing:
            a.tree_draft_s += EMA * (_bounded(draft_s, a.tree_draft_s) - a.tree_draft_s)

    # --- after the verification ---------------------------------------------------------

    def timed(self, new: int, seconds: float) -> None:
        """The cycle's target forward had ``new`` new tokens and took ``seconds``."""
        if self.timing:
            self.costs.timed_target(new, seconds)

    def catching_up(self) -> None:
        """The drafter's next first draft reads many verified tokens at once (its prompt, or a long run of cycles
        without it): not what a first draft costs cycle after cycle, so it is not timed."""
        self._untimed = True

    def read(self, seconds: float) -> None:
        """The drafter took ``seconds`` to read what a drafted cycle verified (counted with its next first draft:
        a cycle that drafts pays it, one that does not defers it)."""
        self._read_s += seconds

    def outcome(self, proposed: int, accepted: int) -> None:
        """Of the cycle's ``proposed`` drafts the first ``accepted`` were kept."""
        a = self.acceptance
        if self._kind == "lookup":
            a.record(at(a.lookup[self._row], 0, proposed), proposed, accepted)
        elif self._kind == "drafter" and proposed:
            a.record(at(a.by_depth, 0, proposed), proposed, accepted)
            cells = [a.by_probability[_bin(p)] for p in self._probabilities[:proposed]]
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

    def __post_init__(self) -> None:
        self.measured = self.costs.copy()  # as loaded or measured: what seeded requests decide by

    def request(self, drafter: bool, seed: int | None = None, crowded: Callable[[], bool] | None = None) -> Speculation:
        """One request's speculation; ``crowded`` says when the target's forwards run together with other requests'
        (a server's batches): it then takes plain steps. A seeded request must draw the same tokens every time it
        is made, and what is drafted decides how much of the seeded stream each cycle uses: so it decides from the
        costs as measured and from its own acceptance alone, never from timings, the load, or the requests before it."""
        if seed is not None:
            return Speculation(self.measured.copy(), Acceptance(), drafter, timing=False)
        return Speculation(self.costs, self.acceptance.copy(REQUEST_PRIOR), drafter, crowded=crowded)

    def finished(self, speculation: Speculation) -> None:
        self.acceptance.blend(speculation.acceptance)
        if self.keep is not None:
            self.keep(self.costs)
