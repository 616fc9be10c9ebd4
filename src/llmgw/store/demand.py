"""What gateways see of each model's use, for loading on demand and giving idle memory
back: each gateway rewrites its own rows every few seconds (and at once when a request
starts waiting for a load); the scheduler sums the fresh rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from ._db import Aggregate, insert
from ._schema import demand

# A gateway's row older than this is left out (its gateway stopped or cannot write): a
# gateway rewrites its rows every DEMAND_FLUSH_S (gateway/_demand.py).
DEMAND_FRESH_S = 15.0
# A row not rewritten for this long is removed (each gateway worker writes under its own
# name, so every restart leaves its rows behind); its last use is long past any idle_s.
DEMAND_KEEP_S = 86400.0


@dataclass(frozen=True)
class Use:
    """One model as gateways see it: requests waiting for a replica to load, requests in
    flight, and when the last request came (unix time; 0: never seen)."""

    waiting: int = 0
    in_flight: int = 0
    last_used: float = 0.0


class DemandStore(Aggregate):
    def report_use(self, gateway: str, uses: Mapping[str, Use]) -> None:
        """Write this gateway's view of each model, one row each, in one transaction; rows
        no gateway rewrote for DEMAND_KEEP_S go."""
        now = self.clock()
        with self.db.tx() as conn:
            conn.execute(demand.delete().where(demand.c.at < now - DEMAND_KEEP_S))
            for model, use in uses.items():
                row = insert(conn, demand).values(
                    gateway=gateway, model=model, waiting=use.waiting,
                    in_flight=use.in_flight, last_used=use.last_used, at=now)
                conn.execute(row.on_conflict_do_update(
                    index_elements=[demand.c.gateway, demand.c.model],
                    set_={k: row.excluded[k] for k in ("waiting", "in_flight", "last_used",
                                                       "at")}))

    def uses(self) -> dict[str, Use]:
        """Each model's use summed over the gateways that wrote within DEMAND_FRESH_S (its
        last use from every row, however old: a stopped gateway's last request still
        counts)."""
        fresh = self.clock() - DEMAND_FRESH_S
        found: dict[str, Use] = {}
        for r in self.db.read(sa.select(demand)):
            was = found.get(r["model"], Use())
            live = r["at"] >= fresh
            found[r["model"]] = Use(
                was.waiting + (r["waiting"] if live else 0),
                was.in_flight + (r["in_flight"] if live else 0),
                max(was.last_used, r["last_used"]))
        return found
