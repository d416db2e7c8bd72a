"""Model and cache geometry: the two specs every other package derives its sizes from.

`ModelSpec` says what the model's caches look like (groups, heads, dims, dtypes, tensor parallelism);
`CacheSpec` says how tokens are grouped for hashing and for allocation. `PageGeometry` is derived
from both: the one page size in bytes that linear-attention state pages (KDA or GDN) and
full-attention KV pages (MLA or GQA) share, and how much of each page type is padding. Invalid
combinations fail at construction with a `ConfigError` that names the offending field, so a bad
TOML file or CLI flag never reaches Redis or a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cachetier.hf_config import HfConfigError, hf_model_fields

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


LINEAR_KINDS = ("kda", "gdn")
ATTENTION_KINDS = ("mla", "gqa")


@dataclass(frozen=True)
class ModelSpec:
    """The cache-relevant shape of a hybrid linear-attention + full-attention model.

    Two families share one layout: Kimi-style KDA + MLA (`linear_kind="kda"`,
    `attention_kind="mla"`) and Qwen3-Next-style Gated DeltaNet + grouped-query attention
    (`"gdn"`, `"gqa"`). The `kda_*` fields describe the linear-attention group whatever its kind
    and the `mla_*` names the full-attention group (kept: they are the index's wire fields).

    Layers are organised in cache groups of `layers_per_group` layers each. Every group, linear or
    full attention, has the same number of layers, so that one page id addresses one page per
    *layer slot* in every group and all groups can share a single free list (vLLM's hybrid
    allocator makes the same choice).

    A linear-attention layer's state has two parts, whatever its kind: the recurrent matrix,
    `kda_heads x [K, V]` in `kda_state_dtype` (one per value head), and the state of the short
    causal convolution over its q, k and v projections, the last `conv_kernel - 1` inputs of its
    `conv_channels` (q: key heads x K, k: key heads x K, v: value heads x V) in `conv_dtype`
    (vLLM's `kda_state_shape`/`gated_delta_net_state_shape`). KDA has one key head per value
    head; GDN shares each key head among `kda_heads / kda_key_heads` value heads
    (`kda_key_heads=0` means as many as value heads). The q/k channels split over tensor-parallel
    ranks by key heads, the v channels and recurrent matrices by value heads. `conv_kernel=1` is a
    layer without a convolution (no conv state).

    A full-attention layer caches per token either one latent of `mla_latent_dim` (MLA,
    replicated on every rank) or K and V of `gqa_kv_heads x gqa_head_dim` each (GQA, KV heads
    split over ranks, each replicated over `tp_degree / gqa_kv_heads` ranks when the degree
    exceeds the KV heads, as vLLM does). The other kind's fields must be 0.
    """

    name: str = "tiny"
    linear_kind: str = "kda"
    attention_kind: str = "mla"
    kda_groups: int = 3
    mla_groups: int = 1
    layers_per_group: int = 2
    kda_heads: int = 4
    kda_key_heads: int = 0
    kda_head_k_dim: int = 16
    kda_head_v_dim: int = 16
    kda_state_dtype: str = "float32"
    conv_kernel: int = 4
    conv_dtype: str = "float32"
    mla_latent_dim: int = 16
    gqa_kv_heads: int = 0
    gqa_head_dim: int = 0
    mla_dtype: str = "float32"
    tp_degree: int = 1

    def __post_init__(self) -> None:
        _positive("model", self, "mla_groups", "layers_per_group", "kda_heads", "kda_head_k_dim",
                  "kda_head_v_dim", "conv_kernel", "tp_degree")
        for key, kinds in (("linear_kind", LINEAR_KINDS), ("attention_kind", ATTENTION_KINDS)):
            if getattr(self, key) not in kinds:
                raise ConfigError(f"model.{key}", f"unknown kind {getattr(self, key)!r}; "
                                  f"expected one of {list(kinds)}")
        if self.kda_groups < 0:
            raise ConfigError("model.kda_groups", "must be >= 0 (0 means a full-attention model)")
        for key in ("kda_state_dtype", "conv_dtype", "mla_dtype"):
            if getattr(self, key) not in DTYPE_BYTES:
                raise ConfigError(f"model.{key}", f"unknown dtype {getattr(self, key)!r}; "
                                  f"expected one of {sorted(DTYPE_BYTES)}")
        self._check_linear()
        self._check_attention()

    def _check_linear(self) -> None:
        if self.kda_key_heads < 0:
            raise ConfigError("model.kda_key_heads", "must be >= 0 (0: one per value head)")
        if self.linear_kind == "kda" and self.key_heads != self.kda_heads:
            raise ConfigError("model.kda_key_heads", f"KDA has one key head per value head; got "
                              f"{self.key_heads} key heads for {self.kda_heads} value heads")
        if self.kda_heads % self.key_heads:
            raise ConfigError("model.kda_key_heads", f"{self.kda_heads} value heads do not share "
                              f"{self.key_heads} key heads evenly")
        if self.key_heads % self.tp_degree:
            raise ConfigError("model.tp_degree", f"{self.key_heads} {self.linear_kind.upper()} "
                              f"key heads do not split evenly over tp_degree={self.tp_degree}")

    def _check_attention(self) -> None:
        used, unused = ((("mla_latent_dim",), ("gqa_kv_heads", "gqa_head_dim"))
                        if self.attention_kind == "mla" else
                        (("gqa_kv_heads", "gqa_head_dim"), ("mla_latent_dim",)))
        _positive("model", self, *used)
        for key in unused:
            if getattr(self, key):
                raise ConfigError(f"model.{key}", f"must be 0 for attention_kind="
                                  f"{self.attention_kind!r}, got {getattr(self, key)}")
        heads, tp = self.attn_heads, self.tp_degree
        if heads % tp and tp % heads:
            raise ConfigError("model.tp_degree", f"{heads} KV heads neither split over nor "
                              f"replicate evenly across tp_degree={tp}")

    @property
    def kda_layers(self) -> int:
        return self.kda_groups * self.layers_per_group

    @property
    def mla_layers(self) -> int:
        return self.mla_groups * self.layers_per_group

    @property
    def key_heads(self) -> int:
        """Key heads of a linear-attention layer (q and k conv channels come in these)."""
        return self.kda_key_heads or self.kda_heads

    @property
    def heads_per_rank(self) -> int:
        """Value heads (recurrent matrices) one rank holds."""
        return self.kda_heads // self.tp_degree

    @property
    def value_heads_per_key_head(self) -> int:
        return self.kda_heads // self.key_heads

    @property
    def kda_head_bytes(self) -> int:
        """Bytes of one value head's [K, V] state: the unit of transfer between nodes."""
        return self.kda_head_k_dim * self.kda_head_v_dim * DTYPE_BYTES[self.kda_state_dtype]

    @property
    def kda_rank_recurrent_bytes(self) -> int:
        """Bytes of one layer's recurrent part on one tensor-parallel rank (head by head)."""
        return self.heads_per_rank * self.kda_head_bytes

    @property
    def conv_parts(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """`(heads, channels per head)` of the q, k and v parts of the conv channels: q and k
        come per key head, v per value head."""
        return ((self.key_heads, self.kda_head_k_dim), (self.key_heads, self.kda_head_k_dim),
                (self.kda_heads, self.kda_head_v_dim))

    @property
    def conv_channels(self) -> int:
        """Channels of one layer's short convolution over all ranks: `conv_dim` in vLLM."""
        return sum(heads * width for heads, width in self.conv_parts)

    @property
    def conv_rank_channels(self) -> int:
        """The conv channels one rank holds: its heads' share of q, then of k, then of v."""
        return self.conv_channels // self.tp_degree

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
    def attn_heads(self) -> int:
        """The units a full-attention token row splits into over ranks: the KV heads of GQA, or
        the one replicated latent of MLA."""
        return self.gqa_kv_heads if self.attention_kind == "gqa" else 1

    @property
    def attn_head_elems(self) -> int:
        """Elements one unit caches per token: K then V of one KV head, or the MLA latent."""
        return 2 * self.gqa_head_dim if self.attention_kind == "gqa" else self.mla_latent_dim

    @property
    def attn_heads_per_rank(self) -> int:
        return max(1, self.attn_heads // self.tp_degree)

    @property
    def attn_head_bytes(self) -> int:
        """Bytes of one unit's row in one token of one layer."""
        return self.attn_head_elems * DTYPE_BYTES[self.mla_dtype]

    @property
    def mla_token_bytes(self) -> int:
        """Bytes of one token in one full-attention layer on one rank: the MLA latent (replicated
        on every rank), or the K and V of the rank's KV heads (GQA)."""
        return self.attn_heads_per_rank * self.attn_head_bytes

    @property
    def checkpoint_recurrent_bytes(self) -> int:
        """The recurrent part of one request's linear-attention state over all layers and ranks:
        what the seed calls ~217 MB for Kimi K3."""
        return self.kda_layers * self.kda_heads * self.kda_head_bytes

    @property
    def checkpoint_conv_bytes(self) -> int:
        """The conv part of one request's linear-attention state over all layers and ranks."""
        return self.kda_layers * self.conv_channels * self.conv_row_bytes

    @property
    def checkpoint_bytes_unpadded(self) -> int:
        """One request's whole linear-attention state, both parts, over all layers and ranks."""
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
    # Qwen3-Next-80B-A3B (its HF config.json): 48 layers, every 4th full attention, so 36 Gated
    # DeltaNet layers in 3 groups and 12 GQA layers in 1; GDN: 16 key heads and 32 value heads of
    # 128, kernel-4 conv over q, k (16 x 128 each) and v (32 x 128): conv_dim 8,192; GQA: 2 KV
    # heads of 256. States in the model dtype (bf16, vLLM's default mamba_ssm_cache_dtype "auto").
    # 512-token pages: a GQA page (512 x 2 x 2 x 256 bf16 = 1 MiB) and a GDN page (48 KiB conv +
    # 1 MiB recurrent) nearly agree, so neither kind pads much.
    "qwen3-next": Config(
        ModelSpec(name="qwen3-next", linear_kind="gdn", attention_kind="gqa", kda_groups=3,
                  mla_groups=1, layers_per_group=12, kda_heads=32, kda_key_heads=16,
                  kda_head_k_dim=128, kda_head_v_dim=128, kda_state_dtype="bfloat16",
                  conv_kernel=4, conv_dtype="bfloat16", mla_latent_dim=0, gqa_kv_heads=2,
                  gqa_head_dim=256, mla_dtype="bfloat16", tp_degree=1),
        CacheSpec(hash_block_tokens=512, page_tokens=512, page_alignment=4096, num_pages=4096),
    ),
    # Small enough for CPU tests and Triton's interpreter; still 3 KDA groups (sibling invalidation)
    # and the kernel-4 conv on: a KDA page is 2,304 conv bytes (192 channels x 3 fp32) + 4,096
    # recurrent bytes (4 heads x 16 x 16 fp32), so the 64 x 16 fp32 MLA page is the padded kind.
    "tiny": Config(ModelSpec(), CacheSpec()),
    # `tiny`'s GDN + GQA sibling: 8 value heads sharing 4 key heads (as Qwen3-Next's 32 share 16),
    # so TP 1, 2 and 4 all split them, and 2 KV heads of 8 (replicated at TP 4): a GDN page is
    # 3,072 conv bytes (256 channels x 3 fp32) + 8,192 recurrent bytes; a GQA page (64 tokens x 2
    # heads x K, V x 8 fp32) is 8,192 bytes.
    "tiny-gqa": Config(
        ModelSpec(name="tiny-gqa", linear_kind="gdn", attention_kind="gqa", kda_heads=8,
                  kda_key_heads=4, mla_latent_dim=0, gqa_kv_heads=2, gqa_head_dim=8),
        CacheSpec(),
    ),
}


def load_config(preset: str = "tiny", toml_path: str | Path | None = None,
                overrides: Mapping[str, str] | None = None,
                hf_config: str | Path | None = None) -> Config:
    """Preset, then the model fields of a Hugging Face config.json, then a TOML file's
    `[model]`/`[cache]` tables, then `section.key=value` overrides."""
    if preset not in PRESETS:
        raise ConfigError("preset", f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    base = PRESETS[preset]
    model = dataclasses.asdict(base.model)
    cache = dataclasses.asdict(base.cache)
    if hf_config is not None:
        try:
            model.update(hf_model_fields(hf_config))
        except HfConfigError as exc:
            raise ConfigError(exc.field, exc.message) from exc
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
    parser.add_argument("--hf-config", metavar="CONFIG.json",
                        help="Hugging Face config.json (Qwen3-Next or Kimi Linear style) whose "
                        "model geometry replaces the preset's (the cache stays the preset's)")
    parser.add_argument("--config", metavar="FILE.toml",
                        help="TOML file whose [model]/[cache] tables override the preset")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        type=_parse_override, metavar="SECTION.KEY=VALUE",
                        help="override one field, e.g. cache.page_tokens=6144 (repeatable)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The configuration the flags of `add_config_arguments` describe; every failure a ConfigError."""
    try:
        return load_config(args.preset, args.config, dict(args.overrides), args.hf_config)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--config", str(exc)) from exc


def override_arguments(config: Config) -> list[str]:
    """`--set` flags that rebuild `config` whatever the preset: how a parent that computed a
    configuration (`cachetier up --vllm-model`) hands exactly that one to `serve`."""
    return [f"--set={section}.{key}={value}"
            for section, spec in (("model", config.model), ("cache", config.cache))
            for key, value in dataclasses.asdict(spec).items()]


def _parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected SECTION.KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()
