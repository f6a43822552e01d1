"""TierConfig: the keys both tier shells share, validated once, with their defaults.

:class:`kvtier.manager.FileSystemTierManager` (keyword arguments) and
:class:`kvtier.vllm.KvtierTier` (a vLLM tier entry) build one :class:`TierConfig` from
their keys: the engine's thread counts, the checksum mode, O_DIRECT, durability, the
stale-temp sweep, the two deadlines, where loads land, how large loads split and a bounded root's capacity knobs
(:mod:`kvtier._tier.capacity`, docs/capacity.md). Each shell keeps what only it has (the manager's
FileMapper fields and metrics, vLLM's ``root_dir``, ``locality`` and events). A new key
both shells take goes here (a field, its check in :meth:`TierConfig.__post_init__`, and
the engine or startup call that uses it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from kvtier._blockio.policy import check_mode
from kvtier._tier import capacity as _capacity
from kvtier._tier.deadline import DEFAULT_IO_TIMEOUT_S, check_timeout
from kvtier._tier.engine import SPLIT_LOAD_BLOCKS


def _check_threads(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


def check_bool(name: str, v) -> None:
    """TypeError unless ``v`` is a bool (a shell's flag)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")


@dataclass(frozen=True)
class TierConfig:
    """The shared keys of a tier (meanings: :class:`kvtier.manager.FileSystemTierManager`).

    ``io_timeout_s``: None is the default, :data:`kvtier._tier.deadline.DEFAULT_IO_TIMEOUT_S`
    (resolved here, once for both shells); ``lookup_timeout_s``: None leaves the engine's
    rule (2 s, or ``io_timeout_s`` when shorter and not 0). ``max_bytes`` None (default):
    the root is not bounded; else :attr:`capacity` is the checked
    :class:`kvtier._tier.capacity.CapacityConfig` (a percentage is resolved against the
    root later). TypeError / ValueError naming the key, before any I/O."""

    n_read_threads: int = 16
    n_write_threads: int = 16
    checksum_blocks: Union[bool, str] = True
    use_o_direct: bool = True
    durable: bool = False
    sweep_stale_temps_after: Optional[float] = None
    io_timeout_s: Optional[float] = None
    lookup_timeout_s: Optional[float] = None
    load_landing: str = "auto"
    load_split_blocks: int = SPLIT_LOAD_BLOCKS
    max_bytes: Any = None
    evict_high: float = _capacity.DEFAULT_HIGH
    evict_low: float = _capacity.DEFAULT_LOW
    census_interval_s: float = _capacity.DEFAULT_CENSUS_INTERVAL_S
    touch_window_s: float = _capacity.DEFAULT_TOUCH_WINDOW_S
    takeover_s: float = _capacity.DEFAULT_TAKEOVER_S

    def __post_init__(self) -> None:
        _check_threads("n_read_threads", self.n_read_threads)
        _check_threads("n_write_threads", self.n_write_threads)
        check_bool("use_o_direct", self.use_o_direct)
        check_bool("durable", self.durable)
        io_timeout_s = DEFAULT_IO_TIMEOUT_S if self.io_timeout_s is None else check_timeout(self.io_timeout_s)
        object.__setattr__(self, "io_timeout_s", io_timeout_s)
        if self.lookup_timeout_s is not None:
            check_timeout(self.lookup_timeout_s, "lookup_timeout_s")
        check_mode(self.checksum_blocks, "checksum_blocks")
        from kvtier._tier import landing

        landing.check_mode(self.load_landing)
        if self.load_landing == "auto":  # KVTIER_LOAD_LANDING decides then: checked now, before any I/O
            landing.env_mode()
        if isinstance(self.load_split_blocks, bool) or not isinstance(self.load_split_blocks, int):
            raise TypeError(f"load_split_blocks must be an int (0: never split), got "
                            f"{type(self.load_split_blocks).__name__}")
        if self.load_split_blocks < 0:
            raise ValueError(f"load_split_blocks must be >= 0 (0: never split), got {self.load_split_blocks}")
        if self.sweep_stale_temps_after is not None:
            from kvtier._tier.sweep import check_sweep_after

            check_sweep_after(self.sweep_stale_temps_after)
        object.__setattr__(self, "_capacity", _capacity.check_config(
            self.max_bytes, self.evict_high, self.evict_low, self.census_interval_s, self.touch_window_s,
            self.takeover_s))

    @property
    def capacity(self) -> Optional[_capacity.CapacityConfig]:
        """The checked capacity knobs of a bounded root, None when ``max_bytes`` is None."""
        return self._capacity  # type: ignore[attr-defined]

    def engine_args(self) -> dict:
        """The :class:`kvtier._tier.engine.TierEngine` keywords these keys set (``use_o_direct``
        is the startup's answer, :class:`kvtier._tier.startup.Started`)."""
        return {"n_read_threads": self.n_read_threads, "n_write_threads": self.n_write_threads,
                "checksum": self.checksum_blocks, "durable": self.durable, "io_timeout_s": self.io_timeout_s,
                "lookup_timeout_s": self.lookup_timeout_s, "load_split_blocks": self.load_split_blocks}
