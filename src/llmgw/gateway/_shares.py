"""A key's rpm and tpm as one gateway holds them: the shares of the key's minute it took
from the store, spent here with no store on the request path (pure logic, times given)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from llmgw.gateway._limits import Window
from llmgw.store import Grant, Settled, Want

# Units of a claim left unspent this long go back to the key's minute, for other gateways.
SHARE_TTL_S = 5.0
# A claim asks for what this gateway spent in the last AHEAD_S seconds (at least 1) ...
AHEAD_S = 2.0
# ... and at most 1/(BATCHES × gateways) of the limit, so no gateway holds much it may not
# spend while another needs it.
BATCHES = 4
# A refusal from the store is believed this long: the requests meanwhile get their 429 here.
RECHECK_S = 1.0
# With the store away each gateway keeps limit // max(AWAY_MIN_GATEWAYS, gateways it last
# saw): a gateway that saw itself alone cannot know that no other started since.
AWAY_MIN_GATEWAYS = 2


@dataclass
class Claim:
    """Units of a key's minute granted to this gateway (the store's row id), usable until
    expires (monotonic); spent of them used, the last at last (unix time)."""

    id: int
    granted: int
    expires: float
    spent: int = 0
    last: float = 0.0

    @property
    def left(self) -> int:
        return self.granted - self.spent


class Ask:
    """The verdict that the store must be asked for a share before the request is judged."""


ASK = Ask()


@dataclass
class Share:
    """One kind ("requests" or "tokens") of one key's minute as this gateway holds it: its
    claims (spent oldest first), what it spent beyond them (debt, counted by force at the
    next claim), when the store last said none is left, and what it spent here over the
    last minute (its rate, and its limit while the store is away)."""

    kind: str
    limit: int
    claims: deque[Claim] = field(default_factory=deque)
    debt: int = 0
    refused_until: float = -math.inf
    refused_at: float = -math.inf
    batch: int = 0  # what the last claim asked for
    spent: Window = field(init=False)

    def __post_init__(self) -> None:
        self.spent = Window(self.limit)

    def held(self, now: float) -> int:
        """Units this gateway may still spend without asking the store."""
        return sum(c.left for c in self.claims if c.expires > now) - self.debt

    def take(self, now: float, wall: float, n: int) -> None:
        """n units spent here now: from the oldest live claims first, the rest a debt."""
        if n <= 0:
            return
        self.spent.add(now, n)
        for claim in self.claims:
            if n == 0:
                break
            if claim.expires > now and claim.left > 0:
                used = min(n, claim.left)
                claim.spent += used
                claim.last = wall
                n -= used
        self.debt += n

    def refused(self, now: float) -> float:
        """Seconds to wait when the store said, within RECHECK_S, that none is left; else 0."""
        if now - self.refused_at < RECHECK_S and self.refused_until > now:
            return self.refused_until - now
        return 0.0

    def want(self, now: float, gateways: int) -> int:
        """What to ask the store for: what was spent here over the last AHEAD_S, or twice
        the last claim's ask when none is held (a burst, or traffic again after a pause:
        few claims to reach its rate); at least 1, at most 1/(BATCHES × gateways) of the
        limit (at least 1). Read once a claim (it walks those seconds' entries), kept as
        batch."""
        cap = max(1, math.ceil(self.limit / (BATCHES * max(1, gateways))))
        wanted = self.spent.since(now - AHEAD_S)
        if self.held(now) <= 0:
            wanted = max(wanted, 2 * self.batch)
        self.batch = max(1, min(cap, wanted))
        return self.batch

    def low(self, now: float) -> bool:
        """Whether to ask for more ahead of need (on the request path: no walk): under half
        of the last claim's worth is held, or there is a debt to count; and the store did
        not just say none is left."""
        return (self.debt > 0 or self.held(now) * 2 < self.batch) and not self.refused(now)

    def granted(self, grant: Grant, wanted: int, now: float) -> None:
        if grant.amount:
            self.claims.append(Claim(grant.claim, grant.amount, now + SHARE_TTL_S))
        if grant.amount < wanted:
            self.refused_until, self.refused_at = now + grant.wait_s, now
        else:
            self.refused_until = self.refused_at = -math.inf

    def done(self, now: float, every: bool = False) -> list[Settled]:
        """The claims this gateway is through with (used up, past SHARE_TTL_S, or every
        one), taken out, as the store settles them."""
        out = []
        while self.claims and (every or self.claims[0].left <= 0
                               or self.claims[0].expires <= now):
            claim = self.claims.popleft()
            out.append(Settled(claim.id, claim.spent, claim.last))
        return out

    def away_wait(self, now: float, gateways: int) -> float:
        """With the store away: 0 when one more unit fits under this gateway's fraction of
        the limit (limit // max(2, gateways)), counting what it spent here over the last
        minute; else the seconds until it does."""
        fraction = self.limit // max(AWAY_MIN_GATEWAYS, gateways)
        if fraction < 1:
            return self.spent.span_s
        return self.spent.wait_s(now, 1, fraction)


@dataclass
class KeyShares:
    """A key's shares of both kinds (None where the key has no such limit)."""

    key_id: str
    rpm: int
    tpm: int
    requests: Share | None = field(init=False)
    tokens: Share | None = field(init=False)

    def __post_init__(self) -> None:
        self.requests = Share("requests", self.rpm) if self.rpm else None
        self.tokens = Share("tokens", self.tpm) if self.tpm else None

    @property
    def shares(self) -> list[Share]:
        return [s for s in (self.tokens, self.requests) if s is not None]

    def admit(self, now: float, wall: float, gateways: int,
              away: bool) -> tuple[str, float] | Ask | None:
        """None when a request may go now (its request counted); (what ran out, seconds to
        wait); or ASK when this gateway holds none and the store must be asked. A request
        goes while one token is left (its tokens are known only after it). Away (the store
        cannot be asked), each kind is held to this gateway's fraction of the limit."""
        for share in self.shares:
            if away:
                wait = share.away_wait(now, gateways)
            elif share.held(now) >= 1:
                continue
            else:
                wait = share.refused(now)
                if not wait:
                    return ASK
            if wait:
                return share.kind, wait
        if self.requests is not None:
            self.requests.take(now, wall, 1)
        return None

    def wants(self, now: float, gateways: int) -> list[Want]:
        """What to ask the store for (what each share wants, and its debt, now handed to
        the store: put_back() returns it when the store could not be asked)."""
        found = []
        for share in self.shares:
            found.append(Want(self.key_id, share.kind, share.want(now, gateways), share.debt))
            share.debt = 0
        return found

    def put_back(self, wants: list[Want]) -> None:
        for want in wants:
            share = self.requests if want.kind == "requests" else self.tokens
            if share is not None:
                share.debt += want.forced

    def granted(self, grants: list[Grant], wants: list[Want], now: float) -> None:
        asked = {w.kind: w.amount for w in wants}
        for grant in grants:
            share = self.requests if grant.kind == "requests" else self.tokens
            if share is not None:
                share.granted(grant, asked.get(grant.kind, 0), now)

    def done(self, now: float, every: bool = False) -> list[Settled]:
        return [s for share in self.shares for s in share.done(now, every)]

    def low(self, now: float) -> bool:
        return any(share.low(now) for share in self.shares)
