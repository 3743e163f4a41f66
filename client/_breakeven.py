"""Break-even loads: a hit is loaded only when loading it beats computing it again.

A hit is not free: its bytes cross a plane (shared memory, a socket) whose speed varies,
and the engine could compute the same tokens instead. vLLM users have seen hits make
time to first token 12x worse (vLLM #44294: concurrent requests queueing behind one
slow load). The engine adapters keep two measured models, learned online per engine:

- `TransferModel`: the plane's latency (a lookup's round trip) and its bandwidth (bytes
  over the time a fetch, or before any fetch a put, took beyond that latency);
- `PrefillModel`: the engine's prefill rate, tokens over the forward time of steps that
  computed at least a block's worth of tokens.

`BreakEven.plan` compares, for the blocks a request could load, `latency + bytes /
bandwidth` with `tokens / prefill rate` and answers how many to load (all or none: both
costs grow by block, loading has the fixed latency on top). A step's loads run one
after the other before its forward pass, so every request of the step waits for all of
them; `plan` also refuses a load that would make any request of the step that loads wait
longer than its own recompute would take (the convoy guard), and `end_step` starts the
next step's account. `deadline_s` is the longest a load may take before it is better
treated as a miss.

Until both models have a sample, every hit is loaded: that is how the first samples
are taken. Everything here is arithmetic on the values given; the callers measure.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of a new sample in the moving averages: a few steps follow a change of the
# plane or the load, one outlier moves the estimate by a fifth.
EWMA_WEIGHT = 0.2
# A transfer's time beyond the latency is floored at this, so a tiny transfer that took
# no longer than a round trip does not claim an unbounded bandwidth.
MIN_TRANSFER_S = 1e-5
# A load may run past its estimated recompute time by this factor before it is a miss:
# estimates are averages, and a load cut short is recomputed on top of the wait.
DEADLINE_SLACK = 2.0
# No deadline below this: a round trip on a busy host can take a few milliseconds.
MIN_DEADLINE_S = 0.05


def _ewma(old: float, new: float) -> float:
    return new if old <= 0 else old + EWMA_WEIGHT * (new - old)


@dataclass
class TransferModel:
    """The plane between the engine and the store, as measured so far (0 = no sample)."""

    latency_s: float = 0.0
    fetch_bytes_per_s: float = 0.0
    put_bytes_per_s: float = 0.0

    def round_trip(self, seconds: float) -> None:
        """A call that moved no block bytes (a lookup) took `seconds`."""
        if seconds > 0:
            self.latency_s = _ewma(self.latency_s, seconds)

    def _rate(self, n_bytes: int, seconds: float) -> float:
        return n_bytes / max(seconds - self.latency_s, MIN_TRANSFER_S)

    def fetched(self, n_bytes: int, seconds: float) -> None:
        if n_bytes > 0 and seconds > 0:
            self.fetch_bytes_per_s = _ewma(self.fetch_bytes_per_s, self._rate(n_bytes, seconds))

    def put(self, n_bytes: int, seconds: float) -> None:
        if n_bytes > 0 and seconds > 0:
            self.put_bytes_per_s = _ewma(self.put_bytes_per_s, self._rate(n_bytes, seconds))

    @property
    def bytes_per_s(self) -> float:
        """The fetch bandwidth; before any fetch, the put bandwidth (the same plane the
        other way); 0 when neither was measured."""
        return self.fetch_bytes_per_s or self.put_bytes_per_s

    def load_s(self, n_bytes: int) -> float | None:
        """Expected time to fetch `n_bytes`; None while the bandwidth is unknown."""
        rate = self.bytes_per_s
        return None if rate <= 0 else self.latency_s + n_bytes / rate


@dataclass
class PrefillModel:
    """The engine's prefill rate in tokens per second (0 = no sample yet)."""

    tokens_per_s: float = 0.0
    min_tokens: int = 1

    def step(self, tokens: int, seconds: float) -> None:
        """A forward pass computed `tokens` tokens in `seconds`. Steps of fewer than
        `min_tokens` (decode steps) are left out: their time is mostly fixed cost."""
        if tokens >= self.min_tokens and seconds > 0:
            self.tokens_per_s = _ewma(self.tokens_per_s, tokens / seconds)

    def compute_s(self, tokens: int) -> float | None:
        return None if self.tokens_per_s <= 0 else tokens / self.tokens_per_s


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How many of the offered blocks to load, and why."""

    blocks: int
    load_s: float | None  # expected time of the load (None: not yet measurable)
    compute_s: float | None  # expected time to compute the same tokens
    reason: str  # "unmeasured", "wins", "slower", "convoy", "nothing"


class BreakEven:
    """The two models and the current step's account of planned loads."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.transfer = TransferModel()
        self.prefill = PrefillModel(min_tokens=block_tokens)
        self._step_load_s = 0.0
        # The smallest recompute time of the requests that load in this step: no load
        # may make the step's loads outlast it.
        self._step_min_compute_s = float("inf")

    def plan(self, blocks: int, block_bytes: int) -> LoadPlan:
        """Decide whether a request loads its `blocks` held blocks, and book the load."""
        if blocks <= 0:
            return LoadPlan(0, None, None, "nothing")
        load_s = self.transfer.load_s(blocks * block_bytes)
        compute_s = self.prefill.compute_s(blocks * self.block_tokens)
        if load_s is None or compute_s is None:
            return LoadPlan(blocks, load_s, compute_s, "unmeasured")
        if load_s >= compute_s:
            return LoadPlan(0, load_s, compute_s, "slower")
        if self._step_load_s + load_s > min(self._step_min_compute_s, compute_s):
            return LoadPlan(0, load_s, compute_s, "convoy")
        self._step_load_s += load_s
        self._step_min_compute_s = min(self._step_min_compute_s, compute_s)
        return LoadPlan(blocks, load_s, compute_s, "wins")

    def end_step(self) -> None:
        self._step_load_s = 0.0
        self._step_min_compute_s = float("inf")

    @staticmethod
    def deadline_s(plan: LoadPlan, ceiling_s: float) -> float:
        """How long the load may take before it is a miss: its expected recompute time
        with some slack, never more than `ceiling_s` (the transfer timeout)."""
        if plan.compute_s is None:
            return ceiling_s
        return min(ceiling_s, max(MIN_DEADLINE_S, DEADLINE_SLACK * plan.compute_s))
