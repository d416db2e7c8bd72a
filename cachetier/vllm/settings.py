"""`kv_connector_extra_config`: where the tier is and which pool this engine uses.

`cachetier up --vllm-model` writes these keys into its info file's `kv_transfer_config`, so a user
passes them unchanged; a missing key or a value of the wrong type is refused at engine start with
the key's name, never guessed. The token is given as itself (`token`) or by the file holding it
(`token_file`, what `up` writes): a `vllm serve --kv-transfer-config JSON` command line, which every
local user reads, then holds a path, not the secret.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cachetier.engine.checkpoint_placement import PLACEMENTS


class ConnectorConfigError(ValueError):
    """A `kv_connector_extra_config` key is missing or invalid."""


@dataclass(frozen=True)
class ConnectorSettings:
    service: str  # the service URL, e.g. tcp://127.0.0.1:7400
    token: str
    pool: str
    # where the pool's agents publish their PoolHandles; `{rank}` stands for a worker's
    # tensor-parallel rank (a path without it serves TP 1)
    handle_file: str
    model_id: str  # `geometry.model_fingerprint` of the model the pool serves
    placement: str = "ladder"  # which of vLLM's boundary states become kept checkpoints
    # names this engine's readers and saves in the index: the scheduler's and every rank's
    # connector must agree on it (vLLM's `KVTransferConfig.engine_id` unless given)
    engine_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    timeout_s: float = 30.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None,
                          engine_id: str | None = None) -> ConnectorSettings:
        """`engine_id`: the engine's own id, unless `extra` names one."""
        extra = dict(extra or {})
        _read_token_file(extra)
        if engine_id is not None:
            extra.setdefault("engine_id", engine_id)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f.name
            if key not in extra:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ConnectorConfigError(f"kv_connector_extra_config.{key} is missing")
                continue
            value = extra.pop(key)
            wanted = float if key == "timeout_s" else str
            if not isinstance(value, (int, float) if wanted is float else str):
                raise ConnectorConfigError(f"kv_connector_extra_config.{key}: expected "
                                           f"{wanted.__name__}, got {value!r}")
            values[key] = wanted(value)
        if extra:
            raise ConnectorConfigError(f"kv_connector_extra_config: unknown keys {sorted(extra)}")
        settings = cls(**values)
        if settings.placement not in PLACEMENTS:
            raise ConnectorConfigError(f"kv_connector_extra_config.placement: unknown "
                                       f"{settings.placement!r}; expected one of "
                                       f"{sorted(PLACEMENTS)}")
        return settings

    def handle_file_of(self, rank: int) -> str:
        """The handle file of rank `rank`'s agent, the one its worker maps in place."""
        if "{rank}" not in self.handle_file:
            if rank:
                raise ConnectorConfigError(f"kv_connector_extra_config.handle_file "
                                           f"{self.handle_file!r} names one agent; a "
                                           "tensor-parallel engine needs a '{rank}' in it")
            return self.handle_file
        return self.handle_file.replace("{rank}", str(rank))


def _read_token_file(extra: dict[str, Any]) -> None:
    """`extra`'s `token_file` replaced by the `token` it holds, read once, at engine start."""
    if "token_file" not in extra:
        return
    path = extra.pop("token_file")
    if "token" in extra:
        raise ConnectorConfigError("kv_connector_extra_config: token or token_file, not both")
    if not isinstance(path, str):
        raise ConnectorConfigError(f"kv_connector_extra_config.token_file: expected str, got "
                                   f"{path!r}")
    try:
        extra["token"] = Path(path).read_text().strip()
    except OSError as exc:
        raise ConnectorConfigError(f"kv_connector_extra_config.token_file: {exc}") from None
