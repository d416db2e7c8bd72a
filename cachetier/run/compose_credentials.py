"""`cachetier credentials DIR`: every secret file docker-compose.yml mounts, from one secret.

The cluster secret comes from `$CACHETIER_SECRET` (there is no default: a cluster whose secret is
in a public file is open to anyone). DIR gets, each 0600 in a 0700 directory: `secret` (mounted
into the service only), the tokens (`client`, `admin`, `observer`, `service`, `agent-<rank>` of
pool0), the Redis users' passwords (`redis-<user>`), the Redis ACL (`redis-users.acl`) and the
replicas' login (`redis-replica.conf`), and the broker's users, ACL and configuration
(`mosquitto.passwd`, `mosquitto.acl`, `mosquitto.conf`), whose paths name where compose mounts
them (`/run/secrets/<file>`). Each container is given the files it needs, nothing more.
"""

from __future__ import annotations

from pathlib import Path

from cachetier.private_files import write_private
from cachetier.run.credential_files import ClusterCredentials
from cachetier.run.mqtt_auth import BrokerAuth
from cachetier.run.redis_auth import RedisAcl

MOUNTED = Path("/run/secrets")  # where docker-compose puts a service's secrets


def write_compose_credentials(credentials: ClusterCredentials, directory: Path) -> list[Path]:
    """Everything in the module docstring; the files written."""
    directory = credentials.write(directory, subdirectory=None)
    password = credentials.redis_password
    acl = RedisAcl(password("cachetier"), password("replica"), password("operator"))
    write_private(directory / "redis-users.acl", "\n".join(acl.acl_lines()) + "\n")
    write_private(directory / "redis-replica.conf",
                  f"masteruser replica\nmasterauth {acl.replica}\n")
    passwords, topics = BrokerAuth.of(credentials.mqtt_tokens()).write(directory)
    write_private(directory / "mosquitto.conf",
                  "listener 1883\nallow_anonymous false\npersistence false\n"
                  f"password_file {MOUNTED / passwords.name}\nacl_file {MOUNTED / topics.name}\n")
    write_private(directory / "secret", credentials.secret + "\n")
    return sorted(directory.iterdir())
