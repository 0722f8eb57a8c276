"""Hardware descriptions for the cost model.

A :class:`Hardware` is a homogeneous fleet: ``n_nodes`` nodes of ``devices_per_node`` identical
devices (:class:`DeviceSpec`). Devices are numbered ``0 .. n_devices-1`` node by node, so device
``d`` sits on node ``d // devices_per_node``. Two devices on the same node talk over the intra-node
link (NVLink through NVSwitch on an HGX board); devices on different nodes talk over the
inter-node link (one NIC per device, e.g. 400 Gb/s InfiniBand). Both are :class:`LinkSpec`:
bandwidth *per direction* per device port, a latency, and an energy per byte moved. A transfer
of ``b`` bytes holds the sender's and the receiver's port for ``b / bandwidth``; the latency
delays the data's arrival without holding them (links pipeline, see ``costmodel.simulate``), so
one transfer alone takes ``latency + b / bandwidth`` (:meth:`Hardware.transfer_time`).

Per-kernel-class efficiency factors scale the datasheet peaks: a shard of kernel class ``c`` runs
at ``peak_flops[dtype] * compute_eff[c]`` and ``mem_bandwidth * memory_eff[c]``. Class
``"default"`` is always present and is used for classes without an entry. A class may be a
*subclass* of another, written ``parent.child`` (``matmul.attention``, ``matmul.norm``,
``matmul.einsum``: ops of the GEMM family whose measured efficiency differs from a plain GEMM's
where the executor runs them as several kernels or pays transposes); a subclass without an entry of its own takes its parent's factors and launch
overhead, then ``"default"``'s (:func:`class_chain`), so a hardware description that never names a
subclass behaves as if the subclass were its parent. Code that asks what *kind* of kernel a class
is (e.g. whether the GEMM efficiency curve applies) asks :func:`class_family`. Calibration (from
measured shard times) produces new factors; :meth:`Hardware.with_efficiency` returns the
calibrated copy and ``costmodel.hardware_io.save_hardware`` writes it as ``base: <preset>`` plus overrides.

Units are SI throughout: FLOP/s, bytes/s, bytes, seconds, watts, joules per byte. In YAML files a
number may also be written with a unit (``"3.35 TB/s"``, ``"80 GB"``, ``"5 us"``,
``"400 Gb/s"`` (bits), ``"5 pJ/bit"``, ``"989.4 TFLOP/s"``); decimal prefixes are powers of
1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024.

Reading and writing YAML files (presets plus overrides) is ``costmodel.hardware_io``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = [
    "HardwareError",
    "DeviceSpec",
    "LinkSpec",
    "Hardware",
    "REQUIRED_DTYPES",
    "class_chain",
    "class_family",
]

#: dtypes every device must give a peak for (the IR's dtypes). Others (float64, tf32) may be added.
REQUIRED_DTYPES = ("float32", "float16", "bfloat16")


class HardwareError(ValueError):
    """Invalid hardware description: unknown preset, bad or missing field, bad value."""


def class_family(kernel_class: str) -> str:
    """The top of a kernel class's hierarchy: ``class_family("matmul.attention") == "matmul"``."""
    return kernel_class.split(".", 1)[0]


def class_chain(kernel_class: str) -> tuple[str, ...]:
    """Where a class's factors are looked up, most specific first, ending with ``"default"``:
    ``class_chain("matmul.attention") == ("matmul.attention", "matmul", "default")``."""
    parts = kernel_class.split(".")
    chain = tuple(".".join(parts[:i]) for i in range(len(parts), 0, -1))
    return chain if kernel_class == "default" else chain + ("default",)


# ---------------------------------------------------------------------------------------------
# numbers with units
# ---------------------------------------------------------------------------------------------

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "m": 1e-3, "u": 1e-6, "µ": 1e-6, "n": 1e-9, "p": 1e-12, "f": 1e-15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}


def _units_for(quantity: str) -> dict[str, float]:
    """Accepted unit spellings for a quantity and their factor to the SI base unit."""
    u: dict[str, float] = {}
    if quantity == "bytes":
        for p in ("", "k", "K", "M", "G", "T", "P"):
            u[p + "B"] = _PREFIX[p]
        for p, f in _BINARY.items():
            u[p + "B"] = f
    elif quantity == "bandwidth":
        for p in ("", "k", "K", "M", "G", "T"):
            u[p + "B/s"] = _PREFIX[p]
            u[p + "b/s"] = _PREFIX[p] / 8.0
            u[p + "bit/s"] = _PREFIX[p] / 8.0
        for p, f in _BINARY.items():
            u[p + "B/s"] = f
    elif quantity == "flops":
        for p in ("", "k", "M", "G", "T", "P"):
            u[p + "FLOP/s"] = _PREFIX[p]
            u[p + "FLOPS"] = _PREFIX[p]
    elif quantity == "seconds":
        for p in ("", "m", "u", "µ", "n"):
            u[p + "s"] = _PREFIX[p]
    elif quantity == "watts":
        for p in ("", "m", "k"):
            u[p + "W"] = _PREFIX[p]
    elif quantity == "energy_per_byte":
        for p in ("", "m", "u", "n", "p", "f"):
            u[p + "J/B"] = _PREFIX[p]
            u[p + "J/bit"] = _PREFIX[p] * 8.0
    return u


_NUM_RE = re.compile(r"^\s*([+-]?(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([^\s\d].*?)?\s*$")


def _number(value: Any, where: str, quantity: str = "number") -> float:
    """Parse a float (possibly a string with a unit) for field ``where``; raise HardwareError."""
    if isinstance(value, bool):
        raise HardwareError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, str):
        m = _NUM_RE.match(value)
        if m:
            num = float(m.group(1).replace("_", ""))
            unit = (m.group(2) or "").strip()
            if not unit:
                return num
            units = _units_for(quantity)
            if unit in units:
                return num * units[unit]
            known = ", ".join(sorted(units)) or "none (plain number)"
            raise HardwareError(f"{where}: unknown unit {unit!r} in {value!r}; accepted: {known}")
    raise HardwareError(f"{where}: expected a number, got {value!r}")


def _positive(x: float, where: str, allow_zero: bool = False, allow_inf: bool = False) -> float:
    if math.isnan(x) or (math.isinf(x) and not allow_inf):
        raise HardwareError(f"{where}: must be finite, got {x!r}")
    if x < 0 or (x == 0 and not allow_zero):
        raise HardwareError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {x!r}")
    return x


def _check_keys(d: Any, where: str, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    if not isinstance(d, Mapping):
        raise HardwareError(f"{where or 'hardware'}: expected a mapping, got {type(d).__name__}")
    required = tuple(required)
    allowed = set(required) | set(optional)
    prefix = f"{where}." if where else ""
    for k in d:
        if k not in allowed:
            raise HardwareError(
                f"unknown field {prefix}{k!s}; allowed fields{' of ' + where if where else ''}: "
                f"{', '.join(sorted(allowed))}")
    for k in required:
        if k not in d:
            raise HardwareError(f"missing field {prefix}{k}")


# ---------------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU socket). All figures SI: FLOP/s, B/s, bytes, s, W."""

    name: str
    peak_flops: dict[str, float] = field(hash=False)  # dtype -> dense peak FLOP/s
    mem_bandwidth: float  # B/s
    mem_capacity: float  # bytes
    launch_overhead: float  # s, added to every shard
    active_power: float  # W while computing
    idle_power: float  # W while not computing (but powered and in use)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise HardwareError("device.name: must be a non-empty string")
        if not isinstance(self.peak_flops, Mapping):
            raise HardwareError("device.peak_flops: expected a mapping dtype -> FLOP/s")
        pf = {}
        for k, v in self.peak_flops.items():
            pf[str(k)] = _positive(_number(v, f"device.peak_flops.{k}", "flops"), f"device.peak_flops.{k}")
        for dt in REQUIRED_DTYPES:
            if dt not in pf:
                raise HardwareError(f"missing field device.peak_flops.{dt}")
        object.__setattr__(self, "peak_flops", pf)
        for f, q, zero in (("mem_bandwidth", "bandwidth", False), ("mem_capacity", "bytes", False),
                           ("launch_overhead", "seconds", True), ("active_power", "watts", True),
                           ("idle_power", "watts", True)):
            where = f"device.{f}"
            object.__setattr__(self, f, _positive(_number(getattr(self, f), where, q), where, zero))
        if self.idle_power > self.active_power:
            raise HardwareError(
                f"device.idle_power ({self.idle_power} W) exceeds device.active_power ({self.active_power} W)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "mem_bandwidth": self.mem_bandwidth,
            "mem_capacity": self.mem_capacity,
            "launch_overhead": self.launch_overhead,
            "active_power": self.active_power,
            "idle_power": self.idle_power,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "device") -> "DeviceSpec":
        fields = [f.name for f in dataclasses.fields(cls)]
        _check_keys(d, where, fields)
        if not isinstance(d["peak_flops"], Mapping):
            raise HardwareError(f"{where}.peak_flops: expected a mapping dtype -> FLOP/s")
        return cls(**{k: d[k] for k in fields})


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point port: bandwidth per direction (B/s), latency (s), energy per byte (J/B)."""

    bandwidth: float
    latency: float
    energy_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for f, q, zero in (("bandwidth", "bandwidth", False), ("latency", "seconds", True),
                           ("energy_per_byte", "energy_per_byte", True)):
            object.__setattr__(self, f, _positive(_number(getattr(self, f), f"link.{f}", q), f"link.{f}", zero))

    def transfer_time(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """latency + bytes / bandwidth: when the data of one transfer alone has arrived (the
        port is held for bytes / bandwidth only)."""
        return self.latency + np.asarray(nbytes, dtype=np.float64) / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {"bandwidth": self.bandwidth, "latency": self.latency, "energy_per_byte": self.energy_per_byte}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "link") -> "LinkSpec":
        _check_keys(d, where, ("bandwidth", "latency"), ("energy_per_byte",))
        try:
            return cls(**dict(d))
        except HardwareError as e:  # re-label "link." with the real field path
            raise HardwareError(str(e).replace("link.", f"{where}.", 1)) from None


#: the most devices a fleet may have (the largest GPU clusters built hold about 10^5)
MAX_DEVICES = 1 << 17
#: the largest efficiency factor a hardware file may give (``costmodel.calibrate`` clips to it)
MAX_EFFICIENCY = 1.5


@functools.lru_cache(maxsize=1)
def kernel_classes() -> frozenset[str]:
    """The efficiency classes of every kernel (``matmul``, ``matmul.attention``, ...), their
    families and ``default``: what ``efficiency`` and ``launch_overhead_by_class`` may name
    (computed once: every Hardware checks its classes against it)."""
    from ir.kernels import REGISTRY

    out = {"default"}
    for k in REGISTRY.values():
        out.update(class_chain(k.kernel_class))
    return frozenset(out)


def _check_classes(by_class: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(by_class) - kernel_classes())
    if unknown:
        raise HardwareError(f"{where}.{unknown[0]}: no kernel has that class (a typo?); the classes are "
                            f"{', '.join(sorted(kernel_classes()))}")


def _efficiency_pair(v: Any, where: str) -> tuple[float, float]:
    if isinstance(v, Mapping):
        _check_keys(v, where, ("compute", "memory"))
        c, m = v["compute"], v["memory"]
    elif isinstance(v, (list, tuple)) and len(v) == 2:
        c, m = v
    else:
        raise HardwareError(f"{where}: expected [compute, memory] or {{compute: .., memory: ..}}, got {v!r}")
    c = _positive(_number(c, f"{where}.compute"), f"{where}.compute")
    m = _positive(_number(m, f"{where}.memory"), f"{where}.memory")
    return (c, m)


@dataclass(frozen=True)
class Hardware:
    """A homogeneous fleet of ``n_nodes * devices_per_node`` devices.

    ``efficiency[kernel_class] = (compute_eff, memory_eff)`` multiplies the datasheet peaks
    (``"default"`` always present). ``launch_overhead_by_class`` optionally replaces the device's
    launch overhead for some kernel classes. Use :meth:`with_efficiency` / :meth:`replace` to
    derive variants; instances are immutable and picklable.
    """

    name: str
    device: DeviceSpec
    n_nodes: int
    devices_per_node: int
    intra_link: LinkSpec
    inter_link: LinkSpec
    efficiency: dict[str, tuple[float, float]] = field(
        default_factory=lambda: {"default": (1.0, 1.0)}, hash=False)
    launch_overhead_by_class: dict[str, float] = field(default_factory=dict, hash=False)
    description: str = field(default="", compare=False)
    #: slowdown of compute while its device communicates (``costmodel.simulate``, "Contention");
    #: 1 = none. Presets cite their value (``costmodel.presets``); calibration may set it.
    contention: float = 1.0
    #: a fused op runs as its stages one after another, each its own kernel (this repository's
    #: executor on NumPy or CuPy: ``ir.kernels.fused`` calls the stages in turn), so it is costed
    #: per stage at each stage's kernel class (``costmodel.efficiency.staged_fused_seconds``);
    #: False (default): one kernel at its first stage's class, the epilogue in its registers
    staged_fusion: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise HardwareError("name: must be a non-empty string")
        if not isinstance(self.device, DeviceSpec):
            raise HardwareError("device: expected a DeviceSpec")
        for f in ("intra_link", "inter_link"):
            if not isinstance(getattr(self, f), LinkSpec):
                raise HardwareError(f"{f}: expected a LinkSpec")
        for f in ("n_nodes", "devices_per_node"):
            v = getattr(self, f)
            ok = not isinstance(v, bool) and (
                isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer()))
            if not ok or v < 1:
                raise HardwareError(f"{f}: must be an integer >= 1, got {v!r}")
            object.__setattr__(self, f, int(v))
        if self.n_nodes * self.devices_per_node > MAX_DEVICES:
            raise HardwareError(f"n_nodes x devices_per_node = {self.n_nodes * self.devices_per_node} devices; a fleet "
                                f"here has at most {MAX_DEVICES} (check devices_per_node and n_nodes)")
        if not isinstance(self.efficiency, Mapping):
            raise HardwareError("efficiency: expected a mapping kernel_class -> (compute, memory)")
        eff = {str(k): _efficiency_pair(v, f"efficiency.{k}") for k, v in self.efficiency.items()}
        if "default" not in eff:
            raise HardwareError("missing field efficiency.default")
        _check_classes(eff, "efficiency")
        for k, (c, m) in eff.items():
            if c > MAX_EFFICIENCY or m > MAX_EFFICIENCY:
                raise HardwareError(f"efficiency.{k}: compute and memory are fractions of the datasheet peaks "
                                    f"(at most {MAX_EFFICIENCY}, calibration's limit), got {c:g} and {m:g}")
        object.__setattr__(self, "efficiency", eff)
        if not isinstance(self.launch_overhead_by_class, Mapping):
            raise HardwareError("launch_overhead_by_class: expected a mapping kernel_class -> seconds")
        lo = {}
        for k, v in self.launch_overhead_by_class.items():
            w = f"launch_overhead_by_class.{k}"
            lo[str(k)] = _positive(_number(v, w, "seconds"), w, allow_zero=True)
        _check_classes(lo, "launch_overhead_by_class")
        object.__setattr__(self, "launch_overhead_by_class", lo)
        if not isinstance(self.description, str):
            raise HardwareError("description: must be a string")
        c = _number(self.contention, "contention")
        if not (math.isfinite(c) and c >= 1.0):
            raise HardwareError(f"contention: a slowdown factor >= 1 (1 = communication does not slow compute), "
                                f"got {self.contention!r}")
        if not isinstance(self.staged_fusion, (bool, np.bool_)):
            raise HardwareError(f"staged_fusion: true or false (whether a fused op's stages run one after another), "
                                f"got {self.staged_fusion!r}")
        object.__setattr__(self, "staged_fusion", bool(self.staged_fusion))
        object.__setattr__(self, "contention", c)

    # -- topology ---------------------------------------------------------------------------

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.devices_per_node

    def node_of(self, dev: int | np.ndarray) -> int | np.ndarray:
        """Node number of a device (scalar in, scalar out; array in, int64 array out)."""
        if np.ndim(dev) == 0:
            d = int(dev)
            self._check_devices(np.asarray([d]))
            return d // self.devices_per_node
        d = np.asarray(dev, dtype=np.int64)
        self._check_devices(d)
        return d // self.devices_per_node

    def device_nodes(self) -> np.ndarray:
        """int64[n_devices]: node of every device."""
        return np.arange(self.n_devices, dtype=np.int64) // self.devices_per_node

    def _check_devices(self, d: np.ndarray) -> None:
        if d.size and (d.min() < 0 or d.max() >= self.n_devices):
            bad = d[(d < 0) | (d >= self.n_devices)][0]
            raise HardwareError(f"device {int(bad)} out of range 0..{self.n_devices - 1} on {self.name!r}")

    def _link_select(self, src, dst, intra: float, inter: float, same: float) -> np.ndarray:
        s = np.asarray(src, dtype=np.int64)
        t = np.asarray(dst, dtype=np.int64)
        self._check_devices(s.ravel())
        self._check_devices(t.ravel())
        out = np.where(s // self.devices_per_node == t // self.devices_per_node, intra, inter)
        return np.where(s == t, same, out).astype(np.float64)

    def link_bandwidth(self, src, dst) -> np.ndarray:
        """float64 array (broadcast of src, dst): B/s per direction; ``inf`` where src == dst."""
        return self._link_select(src, dst, self.intra_link.bandwidth, self.inter_link.bandwidth, np.inf)

    def link_latency(self, src, dst) -> np.ndarray:
        """float64 array: link latency in s; 0 where src == dst."""
        return self._link_select(src, dst, self.intra_link.latency, self.inter_link.latency, 0.0)

    def link_energy_per_byte(self, src, dst) -> np.ndarray:
        """float64 array: J per byte moved; 0 where src == dst."""
        return self._link_select(src, dst, self.intra_link.energy_per_byte,
                                 self.inter_link.energy_per_byte, 0.0)

    def transfer_time(self, src, dst, nbytes) -> np.ndarray:
        """float64 array: latency + bytes / bandwidth, when the data of one transfer alone has
        arrived (the ports are held for bytes / bandwidth only); 0 where src == dst (no transfer)."""
        lat = self.link_latency(src, dst)
        bw = self.link_bandwidth(src, dst)
        return lat + np.asarray(nbytes, dtype=np.float64) / bw

    # -- compute ----------------------------------------------------------------------------

    def peak_flops(self, dtype: str) -> float:
        """Datasheet dense peak FLOP/s of one device for ``dtype``."""
        key = str(getattr(dtype, "name", dtype))
        try:
            return self.device.peak_flops[key]
        except KeyError:
            raise HardwareError(
                f"no peak FLOP/s for dtype {key!r} on {self.name!r}; known: {sorted(self.device.peak_flops)}"
            ) from None

    def efficiency_for(self, kernel_class: str) -> tuple[float, float]:
        """(compute_eff, memory_eff) of a kernel class, falling back to its parent classes, then
        ``"default"`` (:func:`class_chain`)."""
        for k in class_chain(kernel_class):
            if k in self.efficiency:
                return self.efficiency[k]
        return self.efficiency["default"]

    def launch_overhead_for(self, kernel_class: str) -> float:
        """Launch overhead of a kernel class, falling back to its parent classes, then the
        device's (a ``"default"`` entry counts only for the class ``"default"`` itself)."""
        for k in class_chain(kernel_class)[:-1] or ("default",):
            if k in self.launch_overhead_by_class:
                return self.launch_overhead_by_class[k]
        return self.device.launch_overhead

    def efficiency_arrays(self, kernel_classes: Iterable[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a list of kernel classes: float64 arrays (compute_eff, memory_eff, launch_overhead)."""
        ks = list(kernel_classes)
        ce = np.array([self.efficiency_for(k)[0] for k in ks], dtype=np.float64)
        me = np.array([self.efficiency_for(k)[1] for k in ks], dtype=np.float64)
        lo = np.array([self.launch_overhead_for(k) for k in ks], dtype=np.float64)
        return ce, me, lo

    def shard_time(self, flops, nbytes, dtype: str = "float32", kernel_class: str = "default") -> np.ndarray:
        """Roofline time of shards (broadcast over ``flops``/``nbytes`` arrays):
        ``max(flops / (peak[dtype]*ce), bytes / (mem_bandwidth*me)) + launch_overhead``."""
        ce, me = self.efficiency_for(kernel_class)
        f = np.asarray(flops, dtype=np.float64) / (self.peak_flops(dtype) * ce)
        b = np.asarray(nbytes, dtype=np.float64) / (self.device.mem_bandwidth * me)
        return np.maximum(f, b) + self.launch_overhead_for(kernel_class)

    # -- derivation ---------------------------------------------------------------------------

    def replace(self, **changes: Any) -> "Hardware":
        return dataclasses.replace(self, **changes)

    def with_efficiency(self, efficiency: Mapping[str, Any] | None = None, *,
                        launch_overhead_by_class: Mapping[str, Any] | None = None,
                        replace_all: bool = False, **by_class: Any) -> "Hardware":
        """New Hardware with efficiency factors updated (merged into the current map unless
        ``replace_all``), e.g. ``hw.with_efficiency(matmul=(0.7, 0.9))`` or
        ``hw.with_efficiency({"default": (0.8, 0.85)}, launch_overhead_by_class={"matmul": 6e-6})``."""
        upd = dict(efficiency or {})
        upd.update(by_class)
        eff = dict(upd) if replace_all else {**self.efficiency, **upd}
        lo = dict(self.launch_overhead_by_class)
        if launch_overhead_by_class is not None:
            lo = dict(launch_overhead_by_class) if replace_all else {**lo, **launch_overhead_by_class}
        return dataclasses.replace(self, efficiency=eff, launch_overhead_by_class=lo)

    # -- (de)serialization ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/YAML-safe), the full-spec form read by :meth:`from_dict`."""
        d: dict[str, Any] = {
            "name": self.name,
            "device": self.device.to_dict(),
            "n_nodes": self.n_nodes,
            "devices_per_node": self.devices_per_node,
            "intra_link": self.intra_link.to_dict(),
            "inter_link": self.inter_link.to_dict(),
            "efficiency": {k: {"compute": c, "memory": m} for k, (c, m) in self.efficiency.items()},
            "launch_overhead_by_class": dict(self.launch_overhead_by_class),
        }
        if self.description:
            d["description"] = self.description
        if self.contention != 1.0:
            d["contention"] = self.contention
        if self.staged_fusion:
            d["staged_fusion"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Hardware":
        """Strict inverse of :meth:`to_dict`: unknown or missing fields raise HardwareError."""
        _check_keys(d, "", ("name", "device", "n_nodes", "devices_per_node", "intra_link", "inter_link"),
                    ("efficiency", "launch_overhead_by_class", "description", "contention", "staged_fusion"))
        eff = d.get("efficiency", {"default": (1.0, 1.0)})
        if eff is None or not isinstance(eff, Mapping):
            raise HardwareError("efficiency: expected a mapping kernel_class -> {compute, memory}")
        for k in ("n_nodes", "devices_per_node"):
            v = d[k]
            if isinstance(v, str):
                try:
                    v = int(v)
                except ValueError:
                    raise HardwareError(f"{k}: must be an integer >= 1, got {d[k]!r}") from None
                d = {**d, k: v}
        return cls(
            name=str(d["name"]),
            device=DeviceSpec.from_dict(d["device"]),
            n_nodes=d["n_nodes"],
            devices_per_node=d["devices_per_node"],
            intra_link=LinkSpec.from_dict(d["intra_link"], "intra_link"),
            inter_link=LinkSpec.from_dict(d["inter_link"], "inter_link"),
            efficiency=dict(eff),
            launch_overhead_by_class=dict(d.get("launch_overhead_by_class") or {}),
            description=str(d.get("description", "") or ""),
            contention=d.get("contention", 1.0),
            staged_fusion=d.get("staged_fusion", False),
        )

    def summary(self) -> str:
        dv = self.device
        return (f"{self.name}: {self.n_nodes} node(s) x {self.devices_per_node} x {dv.name}; "
                f"bf16 {dv.peak_flops['bfloat16'] / 1e12:.1f} TFLOP/s, fp32 {dv.peak_flops['float32'] / 1e12:.1f} "
                f"TFLOP/s, HBM {dv.mem_bandwidth / 1e12:.2f} TB/s, {dv.mem_capacity / 1e9:.0f} GB; "
                f"intra {self.intra_link.bandwidth / 1e9:.0f} GB/s, inter {self.inter_link.bandwidth / 1e9:.0f} GB/s")
