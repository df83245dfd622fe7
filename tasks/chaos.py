"""Fault injection for drills and tests: ``--chaos KIND:key=value,...`` (repeatable).

    crash:shard=1,round=2          shard 1 raises ChaosCrash in round 2, on its first attempt only
    crash:shard=0,round=3,step=5   ... after 5 steps of the round (default: half the round)
    crash:shard=1,round=2,attempt=2  ... on the second attempt (so the first retry fails too)

Keys: ``shard`` and ``round`` (required), ``attempt`` (default 1: the first attempt only, so a
Prefect retry succeeds), ``step`` (the round-local step after which it strikes; default half the
round). A spec is plain text, so it travels as a flow parameter. More kinds (hang, zombie, kill)
come with the watchdog, with the same syntax: add them to ``KINDS`` and to ``strike``.

Nothing here knows Prefect; the shard task passes the attempt number (``run_count``).
"""

from __future__ import annotations

from dataclasses import dataclass

# kind -> what it does (for messages and --help)
KINDS: dict[str, str] = {
    "crash": "the shard task raises ChaosCrash (a loud failure: Prefect retries it)",
}
_INT_KEYS = ("shard", "round", "attempt", "step")


class ChaosCrash(RuntimeError):
    """Raised on purpose by a ``crash`` chaos spec."""


@dataclass(frozen=True)
class Chaos:
    kind: str
    shard: int
    round: int
    attempt: int = 1
    step: int | None = None  # round-local step after which it strikes; None = half the round

    def __str__(self) -> str:
        text = f"{self.kind}:shard={self.shard},round={self.round}"
        if self.attempt != 1:
            text += f",attempt={self.attempt}"
        if self.step is not None:
            text += f",step={self.step}"
        return text

    def strikes(self, shard: int, round: int, attempt: int) -> bool:
        return (self.shard, self.round, self.attempt) == (shard, round, attempt)

    def strike_step(self, steps_per_round: int) -> int:
        """The round-local step count after which this strikes (at least 1, at most the round)."""
        step = steps_per_round // 2 if self.step is None else self.step
        return max(1, min(step, steps_per_round))


def parse_chaos(spec: str) -> Chaos:
    """``"crash:shard=1,round=2"`` -> Chaos; a malformed spec raises ValueError saying what is wrong."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"chaos spec {spec!r} must look like KIND:key=value,..., e.g. crash:shard=1,round=2")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown chaos kind {kind!r} in {spec!r}; known kinds: {', '.join(sorted(KINDS))}")
    values: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _INT_KEYS:
            raise ValueError(f"bad item {item!r} in chaos spec {spec!r}: use key=value with keys {list(_INT_KEYS)}")
        if key in values:
            raise ValueError(f"key {key!r} given twice in chaos spec {spec!r}")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} in chaos spec {spec!r} is not an integer") from None
    missing = [k for k in ("shard", "round") if k not in values]
    if missing:
        raise ValueError(f"chaos spec {spec!r} lacks {missing}, e.g. {kind}:shard=1,round=2")
    if values["shard"] < 0 or values["round"] < 1 or values.get("attempt", 1) < 1 or values.get("step", 1) < 1:
        raise ValueError(f"chaos spec {spec!r}: need shard >= 0, round >= 1, attempt >= 1, step >= 1")
    return Chaos(kind, **values)


def parse_all(specs: list[str] | None) -> list[Chaos]:
    return [parse_chaos(s) for s in specs or []]


def for_attempt(specs: list[str] | None, shard: int, round: int, attempt: int) -> list[Chaos]:
    """The specs that strike this shard's attempt in this round."""
    return [c for c in parse_all(specs) if c.strikes(shard, round, attempt)]


def strike(chaos: Chaos, *, part: str, round_step: int) -> None:
    """Do what ``chaos`` says, now (called from the training loop once its step is reached)."""
    if chaos.kind == "crash":
        raise ChaosCrash(f"chaos {chaos}: {part} crashes on purpose after {round_step} steps of round "
                         f"{chaos.round} (attempt {chaos.attempt}); a retry starts again from the last cut")
    raise ValueError(f"chaos kind {chaos.kind!r} has no action yet")  # pragma: no cover
