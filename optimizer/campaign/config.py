"""Campaign configuration: the YAML file users write, validated by pydantic (unknown keys refused).

A campaign = workload + hardware + objectives (+ constraints) + search settings + budget, plus
where it runs (cluster), where it is stored, and how plans are sampled for real execution.
``load_config`` turns every problem into a ``ConfigError`` naming the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

OBJECTIVE_NAMES = ("makespan", "energy", "peak_memory", "devices")
STRATEGIES = ("native", "optuna-nsga2", "optuna-tpe", "random")


class ConfigError(ValueError):
    """A campaign config is unusable; the message names the field and the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkloadConfig(Strict):
    """A built-in workload with parameters, a plan/graph JSON file, or an ONNX model whose
    symbolic dims ``params`` binds (``{onnx: model.onnx, params: {batch: 8}}``)."""

    name: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    file: str | None = None
    onnx: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadConfig:
        if sum(v is not None for v in (self.name, self.file, self.onnx)) != 1:
            raise ValueError("give exactly one of workload.name (a built-in workload), workload.file (a graph JSON) "
                             "or workload.onnx (an ONNX model)")
        return self


class ConstraintsConfig(Strict):
    max_devices: int | None = Field(default=None, ge=1)
    max_peak_memory: float | None = Field(default=None, gt=0, description="bytes per device")
    feasible_only: bool = True


class SearchConfig(Strict):
    strategy: Literal["native", "optuna-nsga2", "optuna-tpe", "random"] = "native"
    islands: int = Field(default=2, ge=1, le=256)
    population: int = Field(default=24, ge=4, le=4096)
    steps_per_task: int = Field(default=200, ge=1, le=1_000_000)
    parents_per_task: int = Field(default=4, ge=1, le=256)
    returns_per_task: int = Field(default=16, ge=1, le=1024)
    mutation_weights: dict[str, float] = Field(default_factory=dict)
    adaptive_weights: bool = True
    migration_interval: int = Field(default=4, ge=1, description="tasks per island between migrations")
    epsilon: float = Field(default=0.01, gt=0, le=1, description="relative ε-box size of the front archive")
    max_shards_per_op: int | None = Field(default=None, ge=1)
    seed_baselines: bool = Field(default=True, description="start from the hand-built baselines, not only "
                                                         "the single-device program")
    seed: int = 0

    @field_validator("mutation_weights")
    @classmethod
    def _known_ops(cls, v: dict[str, float]) -> dict[str, float]:
        from optimizer.search.mutation import OPERATORS

        for k, w in v.items():
            if k not in OPERATORS:
                raise ValueError(f"unknown mutation operator {k!r}; operators are {sorted(OPERATORS)}")
            if w < 0:
                raise ValueError(f"mutation weight {k} must be >= 0")
        return v


class BudgetConfig(Strict):
    evaluations: int | None = Field(default=20_000, ge=1)
    wall_time: float | None = Field(default=None, gt=0, description="seconds")
    stall_evaluations: int | None = Field(default=None, ge=1,
                                          description="stop when the hypervolume has not grown for this many")

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetConfig:
        if self.evaluations is None and self.wall_time is None and self.stall_evaluations is None:
            raise ValueError("set at least one of budget.evaluations, budget.wall_time, budget.stall_evaluations")
        return self


class ClusterConfig(Strict):
    scheduler: str | None = None
    workers: int | None = Field(default=None, ge=1)
    threads_per_worker: int = Field(default=1, ge=1)


class StorageConfig(Strict):
    url: str = "tapestry.db"


class SamplingConfig(Strict):
    rate: float = Field(default=0.0, ge=0, le=1, description="fraction of new front plans executed for real")
    backend: Literal["numpy", "cupy"] = "numpy"
    max_per_minute: float = Field(default=6.0, gt=0)
    repeats: int = Field(default=3, ge=1)
    hardware: str | None = Field(default=None, description="hardware the measured times are predicted on")


class RetentionConfig(Strict):
    """What the archive keeps over a long campaign (``storage.retention`` has the contract):
    plans of the front, its lineage, baselines, sampled and checkpointed plans; the rest as
    objectives only or folded into per-interval counts. On by default."""

    enabled: bool = True
    history: Literal["intervals", "objectives"] = Field(
        default="intervals", description="intervals: thinned evaluations become per-interval counts; "
                                         "objectives: their rows stay, without plans")
    interval_seconds: float = Field(default=60.0, gt=0, le=86_400, description="bucket of evaluation_intervals")
    grace_seconds: float = Field(default=120.0, ge=0, le=30 * 86_400,
                                 description="candidates younger than this are left whole")
    every_seconds: float = Field(default=120.0, gt=0, le=86_400, description="how often the driver compacts")
    deltas: bool = Field(default=True, description="store kept plans as rewrites of their parents where smaller")
    max_delta_depth: int = Field(default=16, ge=0, le=1000, description="rewrites replayed to read one plan, at most")


class CampaignConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    workload: WorkloadConfig
    hardware: str
    objectives: list[Literal["makespan", "energy", "peak_memory", "devices"]] = Field(
        default_factory=lambda: ["makespan", "peak_memory"], min_length=1, max_length=4)
    constraints: ConstraintsConfig = Field(default_factory=ConstraintsConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    checkpoint_seconds: float = Field(default=5.0, gt=0)

    @field_validator("objectives")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"objectives {v} repeat a name")
        return v

    def identity_hash(self) -> str:
        """Hash of what a resumed campaign must not change: workload, hardware, objectives, constraints."""
        core = {k: self.model_dump(mode="json")[k] for k in ("workload", "hardware", "objectives", "constraints")}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _explain(e: ValidationError, source: str) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{loc}': remove it or check its spelling (see configs/quickstart.yaml "
                         f"for the accepted keys)")
        elif err["type"] == "missing":
            parts.append(f"missing key '{loc}': add it")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"'{loc}': {msg} (got {err.get('input')!r})")
    more = f"; and {len(e.errors()) - 5} more" if len(e.errors()) > 5 else ""
    return f"campaign config {source} is invalid: " + "; ".join(parts) + more


def parse_config(data: Any, source: str = "config", base_dir: Path | None = None) -> CampaignConfig:
    """Validate a config mapping; relative file paths resolve against ``base_dir``."""
    if not isinstance(data, dict):
        raise ConfigError(f"campaign config {source} must be a YAML mapping of keys to values")
    try:
        cfg = CampaignConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None
    if base_dir is not None and cfg.workload.file and not Path(cfg.workload.file).is_absolute():
        wl = cfg.workload.model_copy(update={"file": str((base_dir / cfg.workload.file).resolve())})
        cfg = cfg.model_copy(update={"workload": wl})
    if base_dir is not None and cfg.workload.onnx and not Path(cfg.workload.onnx).is_absolute():
        wl = cfg.workload.model_copy(update={"onnx": str((base_dir / cfg.workload.onnx).resolve())})
        cfg = cfg.model_copy(update={"workload": wl})
    check_references(cfg, source)
    return cfg


def load_config(path: str | Path) -> CampaignConfig:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"campaign config {str(p)!r} does not exist; see configs/quickstart.yaml for an example")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"campaign config {p} is not valid YAML: {e}") from None
    return parse_config(data, str(p), p.parent)


def check_references(cfg: CampaignConfig, source: str = "config") -> None:
    """Names that pydantic cannot check: the workload, its parameters, the hardware."""
    from costmodel.hardware import HardwareError
    from costmodel.hardware_io import load_hardware
    from ir.workloads import WORKLOADS, workload_params

    wl = cfg.workload
    if wl.name is not None:
        if wl.name not in WORKLOADS:
            raise ConfigError(f"{source}: workload.name {wl.name!r} is unknown; built-in workloads are "
                              f"{sorted(WORKLOADS)} (or give workload.file)")
        known = workload_params(wl.name)
        for k in wl.params:
            if k not in known:
                raise ConfigError(f"{source}: workload.params.{k} is not a parameter of {wl.name!r}; "
                                  f"its parameters are {sorted(known)}")
    elif wl.onnx is not None:
        if not Path(wl.onnx).is_file():
            raise ConfigError(f"{source}: workload.onnx {wl.onnx!r} does not exist")
    elif not Path(wl.file).exists():
        raise ConfigError(f"{source}: workload.file {wl.file!r} does not exist")
    try:
        hw = load_hardware(cfg.hardware)
    except HardwareError as e:
        raise ConfigError(f"{source}: hardware {cfg.hardware!r}: {e}") from None
    if cfg.constraints.max_devices and cfg.constraints.max_devices > hw.n_devices:
        raise ConfigError(f"{source}: constraints.max_devices {cfg.constraints.max_devices} exceeds the "
                          f"{hw.n_devices} devices of {cfg.hardware!r}")
