"""Join tokens: kept by their hash, each spent once, before it expires."""

from __future__ import annotations

import sqlalchemy as sa

from ._db import Aggregate
from ._schema import tokens


class TokenStore(Aggregate):
    def add_token(self, token_hash: str, ttl_s: float, bundle: str = "") -> float:
        """Store a join token by its hash (with a control-plane token's sealed bundle);
        returns when it expires."""
        now = self.clock()
        with self.db.tx() as conn:
            conn.execute(tokens.insert().values(hash=token_hash, created=now,
                                                expires=now + ttl_s, bundle=bundle))
        return now + ttl_s

    def use_token(self, token_hash: str, node_id: str) -> str:
        """Spend a token: 'ok', or why not ('unknown', 'used by NODE', 'expired'). The row
        is locked while it is read, so two control planes never spend one token twice."""
        return self._spend(token_hash, node_id)[0]

    def use_control_plane_token(self, token_hash: str, who: str,
                                spend: bool = True) -> tuple[str, str]:
        """Spend a control-plane token: ('ok', its sealed bundle), or why not and '' (as
        use_token, or 'not for a control plane' for a node's token, which stays unspent).
        spend=False answers the same and leaves the token unspent: the joining machine
        checks what the bundle names (the fleet's store) before it spends the token."""
        return self._spend(token_hash, who, control_plane=True, spend=spend)

    def _spend(self, token_hash: str, who: str, control_plane: bool = False,
               spend: bool = True) -> tuple[str, str]:
        now = self.clock()
        with self.db.tx() as conn:
            row = conn.execute(sa.select(tokens).where(tokens.c.hash == token_hash)
                               .with_for_update()).mappings().first()
            if row is None:
                return "unknown", ""
            if control_plane and not row["bundle"]:
                return "not for a control plane", ""
            if row["used"] is not None:
                return f"used by {row['used_by']}", ""
            if row["expires"] <= now:
                return "expired", ""
            if not spend:
                return "ok", row["bundle"]
            conn.execute(tokens.update().where(tokens.c.hash == token_hash)
                         .values(used=now, used_by=who))
        return "ok", row["bundle"]
