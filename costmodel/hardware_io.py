"""Hardware from YAML files and presets, and back (``load_hardware``, ``save_hardware``).

YAML forms accepted by :func:`load_hardware`::

    # full spec (what save_hardware writes without a base)
    name: my-node
    device: {name: ..., peak_flops: {float32: ..., float16: ..., bfloat16: ...},
             mem_bandwidth: ..., mem_capacity: ..., launch_overhead: ...,
             active_power: ..., idle_power: ...}
    n_nodes: 1
    devices_per_node: 8
    intra_link: {bandwidth: ..., latency: ..., energy_per_byte: ...}
    inter_link: {bandwidth: ..., latency: ..., energy_per_byte: ...}
    efficiency: {default: {compute: 1.0, memory: 1.0}, matmul: [0.7, 0.9]}
    launch_overhead_by_class: {elementwise: 4.0e-6}     # optional

    # or a preset (or another YAML file, relative to this one) plus overrides, merged key by key
    base: h100-sxm-8
    efficiency: {matmul: {compute: 0.71, memory: 0.88}}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from costmodel.hardware import Hardware, HardwareError
from costmodel.presets import PRESETS, preset_names

__all__ = ["hardware_from_yaml_text", "load_hardware", "save_hardware"]


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _diff(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Keys of ``new`` that differ from ``base`` (recursively for mappings)."""
    out: dict[str, Any] = {}
    for k, v in new.items():
        b = base.get(k, None)
        if isinstance(v, Mapping) and isinstance(b, Mapping):
            sub = _diff(b, v)
            if sub:
                out[k] = sub
        elif k not in base or b != v:
            out[k] = v
    return out


def _resolve(d: Any, origin: str, base_dir: Path | None, seen: tuple[str, ...]) -> dict[str, Any]:
    """Turn a loaded YAML mapping (full spec or ``base:`` + overrides) into a full-spec dict."""
    if not isinstance(d, Mapping):
        raise HardwareError(f"{origin}: expected a YAML mapping at the top level, got {type(d).__name__}")
    if "base" not in d:
        return dict(d)
    base_ref = d["base"]
    if not isinstance(base_ref, str):
        raise HardwareError(f"{origin}: field base: expected a preset name or a YAML path, got {base_ref!r}")
    over = {k: v for k, v in d.items() if k != "base"}
    if base_ref in PRESETS:
        base = PRESETS[base_ref].to_dict()
    else:
        p = Path(base_ref)
        if base_dir is not None and not p.is_absolute():
            p = base_dir / p
        if not (p.suffix in (".yaml", ".yml") or p.exists()):
            raise HardwareError(
                f"{origin}: field base: unknown preset {base_ref!r}; known presets: {', '.join(preset_names())} "
                "(or give a path to a hardware YAML file)")
        key = str(p.resolve())
        if key in seen:
            raise HardwareError(f"{origin}: field base: circular base chain through {p}")
        base = _resolve(_read_yaml(p), str(p), p.parent, seen + (key,))
    if "efficiency" in over and over["efficiency"] is not None and not isinstance(over["efficiency"], Mapping):
        raise HardwareError(f"{origin}: efficiency: expected a mapping kernel_class -> {{compute, memory}}")
    # efficiency entries given as [c, m] lists replace the base entry as a whole
    return _deep_merge(base, over)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML keeps the last one
    silently: a second ``search:`` block replaced the whole first one)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            "while reading a mapping", node.start_mark,
                            f"key {key!r} is given twice (first on line {seen[key].line + 1}); YAML would keep only "
                            f"the last one: merge the two", key_node.start_mark)
                    seen[key] = key_node.start_mark
                except TypeError:  # an unhashable key: the base class reports it
                    pass
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HardwareError(f"hardware file not found: {path}") from None
    except OSError as e:
        raise HardwareError(f"cannot read hardware file {path}: {e}") from None
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise HardwareError(f"{path}: not valid YAML: {e}") from None


def _build(d: Mapping[str, Any], origin: str) -> Hardware:
    try:
        return Hardware.from_dict(d)
    except HardwareError as e:
        raise HardwareError(f"{origin}: {e}") from None


def hardware_from_yaml_text(text: str, base_dir: str | os.PathLike | None = None) -> Hardware:
    """Parse hardware from YAML text (full spec or ``base:`` + overrides)."""
    try:
        d = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise HardwareError(f"not valid YAML: {e}") from None
    return _build(_resolve(d, "<yaml>", Path(base_dir) if base_dir else None, ()), "<yaml>")


def load_hardware(spec: "str | os.PathLike | Hardware | Mapping[str, Any]") -> Hardware:
    """Hardware from a preset name (``"h100-sxm-8"``), a YAML file path, a dict, or a Hardware.

    Raises :class:`HardwareError` naming the known presets for an unknown name, and naming the
    field for a bad, unknown or missing field.
    """
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, Mapping):
        return _build(_resolve(spec, "<dict>", None, ()), "<dict>")
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    if not isinstance(spec, (str, os.PathLike)):
        raise HardwareError(f"expected a preset name or a YAML path, got {type(spec).__name__}")
    p = Path(spec)
    if p.suffix not in (".yaml", ".yml") and not p.exists():
        raise HardwareError(
            f"unknown hardware preset {str(spec)!r}; known presets: {', '.join(preset_names())} "
            "(or give a path to a hardware YAML file)")
    d = _read_yaml(p)
    return _build(_resolve(d, str(p), p.parent, (str(p.resolve()),)), str(p))


def save_hardware(hw: Hardware, path: str | os.PathLike, base: str | None = None) -> Path:
    """Write ``hw`` as YAML. With ``base`` (a preset name), write ``base: <name>`` plus only the
    fields that differ (the form used for calibrated files); falls back to the full spec if the
    differences cannot be expressed as a merge (e.g. an efficiency class removed)."""
    p = Path(path)
    full = hw.to_dict()
    doc: dict[str, Any] = full
    if base is not None:
        if base not in PRESETS:
            raise HardwareError(f"unknown hardware preset {base!r}; known presets: {', '.join(preset_names())}")
        bd = PRESETS[base].to_dict()
        over = _diff(bd, full)
        if Hardware.from_dict(_deep_merge(bd, over)) == hw:
            doc = {"base": base, **over}
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
    return p
