"""The credentials `cachetier up` generates: one token per principal, each in its own file.

Every token derives from the cluster secret (`cachetier.credentials`); the files live in
`<run dir>/credentials/` (the directory 0700, each file 0600), named after their principal:
`admin`, `client`, `observer`, `service`, `agent-<rank>`, `redis-<user>`. A child is handed its
own token only, through its environment; a user reads `credentials/client` to connect a
scheduler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cachetier import credentials
from cachetier.credentials import Principal, Role, issue
from cachetier.private_files import write_private

REDIS_USERS = ("cachetier", "replica", "operator")  # see `cachetier.run.redis_auth`


@dataclass(frozen=True)
class ClusterCredentials:
    """The tokens of one local cluster: its roles, the agents of `pool`'s `ranks` and a client
    of each tenant (`client/<tenant>`: a cache of its own, `cachetier.service.ownership`)."""

    secret: str
    pool: str
    ranks: int
    tenants: tuple[str, ...] = ()

    def token(self, principal: Principal) -> str:
        return issue(self.secret, principal)

    def role(self, role: Role) -> str:
        return self.token(Principal(role))

    def agent(self, rank: int) -> str:
        return self.token(credentials.agent(self.pool, rank))

    def redis_password(self, user: str) -> str:
        """A Redis ACL user's password, derived like the tokens (one secret to keep)."""
        return credentials.derive(self.secret, f"redis-user:{user}")

    def mqtt_tokens(self) -> list[str]:
        """The broker's users: the service, the observer, the admin and every agent."""
        return [self.role(Role.SERVICE), self.role(Role.OBSERVER), self.role(Role.ADMIN),
                *(self.agent(rank) for rank in range(self.ranks))]

    def write(self, run_dir: Path, subdirectory: str | None = "credentials") -> Path:
        """Every token and Redis password under `run_dir/subdirectory` (the secret itself is
        not written); returns that directory."""
        directory = run_dir if subdirectory is None else run_dir / subdirectory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        files = {str(role): self.role(role) for role in Role if role is not Role.AGENT}
        files |= {f"agent-{rank}": self.agent(rank) for rank in range(self.ranks)}
        files |= {f"client-{tenant}": self.token(Principal(Role.CLIENT, tenant=tenant))
                  for tenant in self.tenants}
        files |= {f"redis-{user}": self.redis_password(user) for user in REDIS_USERS}
        for name, token in files.items():
            write_private(directory / name, token + "\n")
        return directory
