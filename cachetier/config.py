"""Model and cache geometry: the two specs every other package derives its sizes from.

`ModelSpec` says what the model's caches look like (groups, heads, dims, dtypes, tensor parallelism);
`CacheSpec` says how tokens are grouped for hashing and for allocation. `PageGeometry` is derived
from both: the one page size in bytes that KDA state pages and MLA KV pages share, and how much of
each page type is padding. Invalid combinations fail at construction with a `ConfigError` that names
the offending field, so a bad TOML file or CLI flag never reaches Redis or a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class ConfigError(ValueError):
    """A configuration value is invalid; `field` names it as `section.key`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _positive(section: str, spec: object, *keys: str) -> None:
    for key in keys:
        value = getattr(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{section}.{key}", f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The cache-relevant shape of a hybrid KDA + MLA model.

    Layers are organised in cache groups of `layers_per_group` layers each. Every group, KDA or MLA,
    has the same number of layers, so that one page id addresses one page per *layer slot* in every
    group and all groups can share a single free list (vLLM's hybrid allocator makes the same choice).

    A linear-attention layer's state has two parts, whatever its kind (KDA, or later Gated
    DeltaNet): the recurrent matrix, `kda_heads x [K, V]` in `kda_state_dtype`, and the state of
    the short causal convolution over its q, k and v projections, the last `conv_kernel - 1`
    inputs of its `conv_channels` (q: heads x K, k: heads x K, v: heads x V) in `conv_dtype`, the
    model dtype (vLLM's `kda_state_shape`/`gated_delta_net_state_shape`). The conv channels split
    over tensor-parallel ranks by heads, as the projections do. `conv_kernel=1` is a layer without
    a convolution (no conv state).
    """

    name: str = "tiny"
    kda_groups: int = 3
    mla_groups: int = 1
    layers_per_group: int = 2
    kda_heads: int = 4
    kda_head_k_dim: int = 16
    kda_head_v_dim: int = 16
    kda_state_dtype: str = "float32"
    conv_kernel: int = 4
    conv_dtype: str = "float32"
    mla_latent_dim: int = 16
    mla_dtype: str = "float32"
    tp_degree: int = 1

    def __post_init__(self) -> None:
        _positive("model", self, "mla_groups", "layers_per_group", "kda_heads", "kda_head_k_dim",
                  "kda_head_v_dim", "conv_kernel", "mla_latent_dim", "tp_degree")
        if self.kda_groups < 0:
            raise ConfigError("model.kda_groups", "must be >= 0 (0 means a full-attention model)")
        for key in ("kda_state_dtype", "conv_dtype", "mla_dtype"):
            if getattr(self, key) not in DTYPE_BYTES:
                raise ConfigError(f"model.{key}", f"unknown dtype {getattr(self, key)!r}; "
                                  f"expected one of {sorted(DTYPE_BYTES)}")
        if self.kda_heads % self.tp_degree:
            raise ConfigError("model.tp_degree", f"{self.kda_heads} KDA heads do not split evenly "
                              f"over tp_degree={self.tp_degree}")

    @property
    def kda_layers(self) -> int:
        return self.kda_groups * self.layers_per_group

    @property
    def mla_layers(self) -> int:
        return self.mla_groups * self.layers_per_group

    @property
    def heads_per_rank(self) -> int:
        return self.kda_heads // self.tp_degree

    @property
    def kda_head_bytes(self) -> int:
        """Bytes of one head's [K, V] state: the unit of transfer between nodes."""
        return self.kda_head_k_dim * self.kda_head_v_dim * DTYPE_BYTES[self.kda_state_dtype]

    @property
    def kda_rank_recurrent_bytes(self) -> int:
        """Bytes of one layer's recurrent part on one tensor-parallel rank (head by head)."""
        return self.heads_per_rank * self.kda_head_bytes

    @property
    def conv_head_channels(self) -> tuple[int, int, int]:
        """Conv channels one head owns in each of the q, k and v parts."""
        return (self.kda_head_k_dim, self.kda_head_k_dim, self.kda_head_v_dim)

    @property
    def conv_channels(self) -> int:
        """Channels of one layer's short convolution over all ranks: `conv_dim` in vLLM."""
        return self.kda_heads * sum(self.conv_head_channels)

    @property
    def conv_rank_channels(self) -> int:
        """The conv channels one rank holds: its heads' share of q, then of k, then of v."""
        return self.heads_per_rank * sum(self.conv_head_channels)

    @property
    def conv_row_bytes(self) -> int:
        """Bytes of one conv channel's state: its last `conv_kernel - 1` inputs."""
        return (self.conv_kernel - 1) * DTYPE_BYTES[self.conv_dtype]

    @property
    def kda_rank_conv_bytes(self) -> int:
        """Bytes of one layer's conv part on one rank (`[conv_rank_channels, conv_kernel - 1]`)."""
        return self.conv_rank_channels * self.conv_row_bytes

    @property
    def kda_rank_layer_bytes(self) -> int:
        """Bytes of one layer's whole state on one rank, both parts: what a restore copies."""
        return self.kda_rank_conv_bytes + self.kda_rank_recurrent_bytes

    @property
    def mla_token_bytes(self) -> int:
        """Bytes of one token's latent in one layer (replicated on every rank)."""
        return self.mla_latent_dim * DTYPE_BYTES[self.mla_dtype]

    @property
    def checkpoint_recurrent_bytes(self) -> int:
        """The recurrent part of one request's KDA state over all layers and ranks: what the seed
        calls ~217 MB for Kimi K3."""
        return self.kda_layers * self.kda_heads * self.kda_head_bytes

    @property
    def checkpoint_conv_bytes(self) -> int:
        """The conv part of one request's KDA state over all layers and ranks."""
        return self.kda_layers * self.conv_channels * self.conv_row_bytes

    @property
    def checkpoint_bytes_unpadded(self) -> int:
        """One request's whole KDA state, both parts, over all layers and ranks."""
        return self.checkpoint_conv_bytes + self.checkpoint_recurrent_bytes


@dataclass(frozen=True)
class CacheSpec:
    """Token granularities: hash blocks (the prefix-hash unit) inside physical pages (allocation)."""

    hash_block_tokens: int = 16
    page_tokens: int = 64
    page_alignment: int = 512
    num_pages: int = 256
    max_batch: int = 256
    hash_algo: str = "xxh3_128"

    def __post_init__(self) -> None:
        _positive("cache", self, "hash_block_tokens", "page_tokens", "page_alignment", "num_pages",
                  "max_batch")
        if self.page_tokens % self.hash_block_tokens:
            raise ConfigError("cache.page_tokens", f"{self.page_tokens} is not a multiple of "
                              f"hash_block_tokens={self.hash_block_tokens}")
        if self.page_alignment & (self.page_alignment - 1):
            raise ConfigError("cache.page_alignment", "must be a power of two")
        if self.hash_algo not in ("xxh3_128", "sha256"):
            raise ConfigError("cache.hash_algo", f"unknown {self.hash_algo!r}; "
                              "expected 'xxh3_128' or 'sha256'")

    @property
    def blocks_per_page(self) -> int:
        return self.page_tokens // self.hash_block_tokens


@dataclass(frozen=True)
class PageGeometry:
    """The unified page: one size in bytes for both page types, per layer slot."""

    page_bytes: int
    layer_slots: int
    mla_page_bytes: int
    kda_page_bytes: int
    mla_token_bytes: int

    @property
    def mla_padding_fraction(self) -> float:
        return 1.0 - self.mla_page_bytes / self.page_bytes

    @property
    def kda_padding_fraction(self) -> float:
        return 1.0 - self.kda_page_bytes / self.page_bytes

    @property
    def page_id_bytes(self) -> int:
        """Bytes one page id holds over all layer slots (what the pool spends per allocation)."""
        return self.page_bytes * self.layer_slots


def page_geometry(model: ModelSpec, cache: CacheSpec) -> PageGeometry:
    mla_page = cache.page_tokens * model.mla_token_bytes
    kda_page = model.kda_rank_layer_bytes if model.kda_groups else 0
    raw = max(mla_page, kda_page)
    aligned = -(-raw // cache.page_alignment) * cache.page_alignment
    return PageGeometry(page_bytes=aligned, layer_slots=model.layers_per_group,
                        mla_page_bytes=mla_page, kda_page_bytes=kda_page,
                        mla_token_bytes=model.mla_token_bytes)


@dataclass(frozen=True)
class Config:
    model: ModelSpec
    cache: CacheSpec

    @property
    def geometry(self) -> PageGeometry:
        return page_geometry(self.model, self.cache)

    def describe(self) -> dict[str, Any]:
        geo = self.geometry
        return {
            "model": dataclasses.asdict(self.model),
            "cache": dataclasses.asdict(self.cache),
            "page_bytes": geo.page_bytes,
            "layer_slots": geo.layer_slots,
            "mla_page_bytes": geo.mla_page_bytes,
            "kda_page_bytes": geo.kda_page_bytes,
            "mla_padding_fraction": round(geo.mla_padding_fraction, 4),
            "kda_padding_fraction": round(geo.kda_padding_fraction, 4),
            "kda_conv_bytes": self.model.kda_rank_conv_bytes,
            "kda_recurrent_bytes": self.model.kda_rank_recurrent_bytes,
            "checkpoint_conv_bytes": self.model.checkpoint_conv_bytes,
            "checkpoint_recurrent_bytes": self.model.checkpoint_recurrent_bytes,
            "checkpoint_bytes_unpadded": self.model.checkpoint_bytes_unpadded,
            "checkpoint_bytes_pooled": self.model.kda_groups * geo.page_id_bytes,
        }


PRESETS: dict[str, Config] = {
    # The seed's Kimi K3 figures: 69 KDA layers in 3 groups, 96 heads of 128x128 bf16 states and a
    # kernel-4 bf16 conv over q, k, v (3 x 96 x 128 channels, as Kimi Linear's KDA); 23 MLA layers
    # with a 512 + 64 latent per token; 512-token hash blocks in 6,144-token pages.
    "kimi-k3": Config(
        ModelSpec(name="kimi-k3", kda_groups=3, mla_groups=1, layers_per_group=23, kda_heads=96,
                  kda_head_k_dim=128, kda_head_v_dim=128, kda_state_dtype="bfloat16",
                  conv_kernel=4, conv_dtype="bfloat16", mla_latent_dim=576, mla_dtype="bfloat16",
                  tp_degree=1),
        CacheSpec(hash_block_tokens=512, page_tokens=6144, page_alignment=4096, num_pages=4096),
    ),
    # Small enough for CPU tests and Triton's interpreter; still 3 KDA groups (sibling invalidation)
    # and the kernel-4 conv on: a KDA page is 2,304 conv bytes (192 channels x 3 fp32) + 4,096
    # recurrent bytes (4 heads x 16 x 16 fp32), so the 64 x 16 fp32 MLA page is the padded kind.
    "tiny": Config(ModelSpec(), CacheSpec()),
}


def load_config(preset: str = "tiny", toml_path: str | Path | None = None,
                overrides: Mapping[str, str] | None = None) -> Config:
    """Preset, then a TOML file's `[model]`/`[cache]` tables, then `section.key=value` overrides."""
    if preset not in PRESETS:
        raise ConfigError("preset", f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    base = PRESETS[preset]
    model = dataclasses.asdict(base.model)
    cache = dataclasses.asdict(base.cache)
    sections = {"model": model, "cache": cache}
    if toml_path is not None:
        with open(toml_path, "rb") as f:
            data = tomllib.load(f)
        for name, table in data.items():
            if name not in sections:
                raise ConfigError(name, f"unknown section; expected one of {sorted(sections)}")
            for key, value in table.items():
                _assign(sections, f"{name}.{key}", value)
    for dotted, text in (overrides or {}).items():
        _assign(sections, dotted, _parse_scalar(text))
    return Config(ModelSpec(**model), CacheSpec(**cache))


def _assign(sections: dict[str, dict[str, Any]], dotted: str, value: Any) -> None:
    name, _, key = dotted.partition(".")
    if name not in sections or key not in sections[name]:
        raise ConfigError(dotted, "unknown field")
    expected = type(sections[name][key])
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(dotted, f"expected an integer, got {value!r}")
    if expected is str and not isinstance(value, str):
        raise ConfigError(dotted, f"expected a string, got {value!r}")
    sections[name][key] = value


def _parse_scalar(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that select a configuration: a preset, then a TOML file, then single overrides."""
    parser.add_argument("--preset", default="tiny",
                        help=f"starting configuration: one of {', '.join(sorted(PRESETS))}")
    parser.add_argument("--config", metavar="FILE.toml",
                        help="TOML file whose [model]/[cache] tables override the preset")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        type=_parse_override, metavar="SECTION.KEY=VALUE",
                        help="override one field, e.g. cache.page_tokens=6144 (repeatable)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The configuration the flags of `add_config_arguments` describe; every failure a ConfigError."""
    try:
        return load_config(args.preset, args.config, dict(args.overrides))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--config", str(exc)) from exc


def _parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected SECTION.KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()
