"""Campaign configuration: the YAML file users write, validated by pydantic (unknown keys refused).

A campaign = workload + hardware + objectives (+ constraints) + search settings + budget, plus
where it runs (cluster), where it is stored, and how plans are sampled for real execution.
``load_config`` turns every problem into a ``ConfigError`` naming the field and the fix.

Limits on what a config file may be (so that a hostile or broken file costs milliseconds and a
clear error, never a hang or a traceback): at most ``MAX_CONFIG_BYTES``, UTF-8 text, at most
``MAX_YAML_ALIASES`` aliases, at most ``MAX_YAML_NODES`` values counted with every alias
expanded (a "billion laughs" file is refused while it is counted, before anything prints it),
nested at most ``MAX_YAML_DEPTH`` deep. Error messages quote values shortened.
"""

from __future__ import annotations

import hashlib
import json
import re
import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from costmodel.hardware_io import UniqueKeyLoader
from optimizer.search.mutation import OPERATORS

OBJECTIVE_NAMES = ("makespan", "energy", "peak_memory", "devices")
STRATEGIES = ("native", "optuna-nsga2", "optuna-tpe", "random")


MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_ALIASES = 64
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 32
#: the largest integer a config value may hold (budgets, workload parameters)
MAX_INT = 2**53


class ConfigError(ValueError):
    """A campaign config is unusable; the message names the field and the fix."""


_SCHEMES = ("tcp", "tls", "ucx", "ws", "wss")
_ADDRESS = re.compile(r"^(?:(?P<scheme>[a-z]+)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})/?$")


def check_scheduler_address(address: str, where: str = "--scheduler") -> str:
    """``address`` if it is a Dask scheduler address with a port (``tcp://host:8786``,
    ``host:8786``, ``tls://[::1]:8786``); ``ConfigError`` naming the form otherwise."""
    a = address.strip()
    m = _ADDRESS.match(a)
    ok = m is not None and (m["scheme"] is None or m["scheme"] in _SCHEMES) and 0 < int(m["port"]) < 65536
    if not ok and not a.startswith("inproc://"):
        raise ConfigError(f"{where} {_short(address)} is not a Dask scheduler address; write it with its port, "
                          f"e.g. tcp://10.0.0.5:8786 or 10.0.0.5:8786 (dask scheduler prints it at start)")
    return a


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60
_REPR.maxlong = 40


def _short(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters (safe on huge or self-sharing values)."""
    return _REPR.repr(value)


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
        if self.file is not None and self.params:
            raise ValueError("workload.params do not apply to workload.file (a graph JSON holds its sizes); drop "
                             "them, or build the graph with those sizes ('tapestry graph build ... --set')")
        return self


class ConstraintsConfig(Strict):
    max_devices: int | None = Field(default=None, ge=1, le=MAX_INT)
    max_peak_memory: float | None = Field(default=None, gt=0, le=1e18, description="bytes per device")
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
    migration_interval: int = Field(default=4, ge=1, le=1_000_000, description="tasks per island between migrations")
    restart_after: int | None = Field(default=8, ge=1, le=1_000_000, description="tasks an island may run without "
                                      "bettering any objective's best by 0.1% before it restarts from the start "
                                      "plans; null: never")
    epsilon: float = Field(default=0.01, gt=0, le=1, description="relative ε-box size of the front archive")
    max_shards_per_op: int | None = Field(default=None, ge=1, le=1_000_000)
    seed_baselines: bool = Field(default=True, description="start from the hand-built baselines, not only "
                                                         "the single-device program")
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="a non-negative integer")
    layers: Literal["auto", "whole", "repeat"] = Field(
        default="auto", description="how plans of models with repeated layers are evaluated: 'whole' simulates "
        "every layer; 'repeat' simulates two truncations and extends the objectives along the layers, and "
        "makes each move in one layer in every layer like it (costmodel.repetition, ir.rewrites.tie); 'auto': "
        "repeat for programs of 16 layers or more")

    @field_validator("mutation_weights")
    @classmethod
    def _known_ops(cls, v: dict[str, float]) -> dict[str, float]:
        for k, w in v.items():
            if k not in OPERATORS:
                raise ValueError(f"unknown mutation operator {_short(k)}; operators are {sorted(OPERATORS)}")
            if not 0 <= w < float("inf"):
                raise ValueError(f"mutation weight {k} must be a finite number >= 0")
        return v


class BudgetConfig(Strict):
    evaluations: int | None = Field(default=20_000, ge=1, le=MAX_INT)
    wall_time: float | None = Field(default=None, gt=0, le=1e9, description="seconds")
    stall_evaluations: int | None = Field(default=None, ge=1, le=MAX_INT,
                                          description="stop when the hypervolume has not grown for this many")

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetConfig:
        if self.evaluations is None and self.wall_time is None and self.stall_evaluations is None:
            raise ValueError("set at least one of budget.evaluations, budget.wall_time, budget.stall_evaluations")
        return self


def with_budget(cfg: CampaignConfig, **overrides: Any) -> CampaignConfig:
    """``cfg`` with budget fields replaced (``None`` values are ignored), validated like the file's."""
    update = {k: v for k, v in overrides.items() if v is not None}
    if not update:
        return cfg
    try:
        budget = BudgetConfig.model_validate({**cfg.budget.model_dump(), **update})
    except ValidationError as e:
        raise ConfigError(_budget_error(e, "budget on the command line", update)) from None
    return cfg.model_copy(update={"budget": budget})


def _budget_error(e: ValidationError, source: str, flags: dict[str, Any]) -> str:
    """A budget validation error, naming the command-line flags (``--wall-time``) that were given."""
    text = _explain(e, source).split(" is invalid: ", 1)[-1]
    for k in flags:
        text = text.replace(f"'{k}'", "--" + k.replace("_", "-"))
    return f"invalid {source}: {text}"


def budget_with(budget: BudgetConfig, counters: dict[str, Any], evaluations: int | None, wall_time: float | None,
                source: str) -> tuple[BudgetConfig, list[str]]:
    """The budget of a resumed campaign: ``budget`` with the new totals ``evaluations`` and
    ``wall_time`` (validated like the config's), and ``notes`` for the user.

    A new total must exceed what the campaign has already spent. A limit the user did not give
    that is already spent is lifted (with a note), so that ``--evaluations 20000`` after a spent
    wall-time budget runs to 20000 evaluations instead of stopping at once."""
    update: dict[str, Any] = {k: v for k, v in (("evaluations", evaluations), ("wall_time", wall_time))
                              if v is not None}
    try:
        new = BudgetConfig.model_validate({**budget.model_dump(), **update})
    except ValidationError as e:
        raise ConfigError(_budget_error(e, f"budget for {source}", update)) from None
    done_e = int(counters.get("evaluations", 0) or 0)
    done_w = float(counters.get("wall_seconds", 0.0) or 0.0)
    stalled = done_e - int(counters.get("hv_improved_at", 0) or 0)
    if evaluations is not None and evaluations <= done_e:
        raise ConfigError(f"{source}: --evaluations is the new total and must exceed the {done_e} evaluations "
                          f"already done, e.g. --evaluations {done_e + 5000}")
    if wall_time is not None and wall_time <= done_w:
        raise ConfigError(f"{source}: --wall-time is the new total in seconds and must exceed the {done_w:.0f} s "
                          f"already searched, e.g. --wall-time {done_w + 600:.0f}")
    notes: list[str] = []
    if update:
        lift: dict[str, Any] = {}
        if "evaluations" not in update and new.evaluations is not None and done_e >= new.evaluations:
            lift["evaluations"] = None
            notes.append(f"the evaluation budget ({new.evaluations}) was spent; lifted (add --evaluations to set one)")
        if "wall_time" not in update and new.wall_time is not None and done_w >= new.wall_time:
            lift["wall_time"] = None
            notes.append(f"the wall-time budget ({new.wall_time:g} s) was spent; lifted (add --wall-time to set one)")
        if new.stall_evaluations is not None and stalled >= new.stall_evaluations:
            lift["stall_evaluations"] = None
            notes.append(f"the stall budget ({new.stall_evaluations} evaluations without progress) was spent; lifted")
        if lift:
            new = BudgetConfig.model_validate({**new.model_dump(), **lift})
    return new, notes


def spent_budget(budget: BudgetConfig, counters: dict[str, Any]) -> str | None:
    """Which limit of ``budget`` a campaign with ``counters`` has already reached (as
    ``Farm.exhausted`` says it), or None: a resume with it would stop at once."""
    done_e = int(counters.get("evaluations", 0) or 0)
    done_w = float(counters.get("wall_seconds", 0.0) or 0.0)
    if budget.evaluations is not None and done_e >= budget.evaluations:
        return f"its evaluation budget ({done_e} of {budget.evaluations} done)"
    if budget.wall_time is not None and done_w >= budget.wall_time:
        return f"its wall-time budget ({done_w:.0f} of {budget.wall_time:g} s searched)"
    stalled = done_e - int(counters.get("hv_improved_at", 0) or 0)
    if budget.stall_evaluations is not None and stalled >= budget.stall_evaluations:
        return f"its stall budget ({stalled} evaluations without progress, limit {budget.stall_evaluations})"
    return None


class ClusterConfig(Strict):
    scheduler: str | None = None
    workers: int | None = Field(default=None, ge=1, le=4096)
    threads_per_worker: int = Field(default=1, ge=1, le=1024)
    # local workers are restarted (one at a time, their tasks resubmitted) after this many seconds:
    # the caches are capped, but the allocator's high-water marks are not (issue 16); null: never
    worker_lifetime: float | None = Field(default=21600.0, ge=60, le=3e7, description="seconds; null: never")
    # the driver (`tapestry run`/`resume` on this machine; with a local cluster, the Dask
    # scheduler too) drains its tasks, checkpoints and replaces itself with `tapestry resume`
    # after this many seconds, for the same reason; null: never
    driver_lifetime: float | None = Field(default=21600.0, ge=10, le=3e7, description="seconds; null: never")

    @field_validator("scheduler")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_scheduler_address(v, "address")
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return v


class StorageConfig(Strict):
    url: str = "tapestry.db"


class SamplingConfig(Strict):
    rate: float = Field(default=0.0, ge=0, le=1, description="fraction of new front plans executed for real")
    backend: Literal["numpy", "cupy"] = "numpy"
    max_per_minute: float = Field(default=6.0, gt=0, le=1e6)
    repeats: int = Field(default=3, ge=1, le=10_000)
    hardware: str | None = Field(default=None, description="hardware the measured times are predicted on")
    calibrate_every: int = Field(default=5, ge=0, le=1_000_000,
                                 description="refit the sampling hardware every N sampled plans (0: never)")


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
    checkpoint_seconds: float = Field(default=5.0, gt=0, le=86_400)

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
            parts.append(f"'{loc}': {msg} (got {_short(err.get('input'))})")
    more = f"; and {len(e.errors()) - 5} more" if len(e.errors()) > 5 else ""
    return f"campaign config {source} is invalid: " + "; ".join(parts) + more


def parse_config(data: Any, source: str = "config", base_dir: Path | None = None) -> CampaignConfig:
    """Validate a config mapping; relative file paths resolve against ``base_dir``."""
    if not isinstance(data, dict):
        raise ConfigError(f"campaign config {source} must be a YAML mapping of keys to values, not "
                          f"{type(data).__name__} {_short(data)}")
    _check_size(data, source)
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
    return parse_config(read_yaml(p), str(p), p.parent)


class _CountingLoader(UniqueKeyLoader):
    """``yaml.SafeLoader`` that refuses a key given twice and more than ``MAX_YAML_ALIASES`` aliases."""

    aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise ConfigError(f"uses more than {MAX_YAML_ALIASES} YAML aliases (*name); write the values out")
        return super().compose_node(parent, index)


def _check_size(data: Any, source: str) -> None:
    """Refuse documents with more than ``MAX_YAML_NODES`` values (aliases expanded) or deeper than
    ``MAX_YAML_DEPTH``; stops counting at the limit, so a billion-laughs file is cheap."""
    stack, n = [(data, 0)], 0
    while stack:
        v, depth = stack.pop()
        n += 1
        if n > MAX_YAML_NODES:
            raise ConfigError(f"campaign config {source} holds more than {MAX_YAML_NODES} values (counting every "
                              f"alias expansion); a campaign config is a few dozen keys")
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"campaign config {source} is nested more than {MAX_YAML_DEPTH} levels deep")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def read_yaml(p: Path) -> Any:
    """The YAML document in file ``p`` as plain data, within the module's limits; ``ConfigError``
    for a missing file, a folder, a file too large, not UTF-8, or not valid YAML."""
    if not p.exists():
        raise ConfigError(f"campaign config {str(p)!r} does not exist; see configs/quickstart.yaml for an example")
    if p.is_dir():
        raise ConfigError(f"campaign config {str(p)!r} is a folder; give the YAML file inside it, e.g. "
                          f"configs/quickstart.yaml")
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"campaign config {p} is {size} bytes; a config is at most {MAX_CONFIG_BYTES} bytes "
                              f"(is it the right file?)")
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read campaign config {p}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"campaign config {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                          f"save it as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"campaign config {p} holds NUL bytes: it is not a text file")
    try:
        data = yaml.load(text, Loader=_CountingLoader)  # noqa: S506  (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"campaign config {p} {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"campaign config {p} is not valid YAML: {_first_lines(str(e))}") from None
    except RecursionError:
        raise ConfigError(f"campaign config {p} is nested too deeply to read") from None
    _check_size(data, str(p))
    return data


def _first_lines(text: str, n: int = 6, width: int = 200) -> str:
    return "\n".join(line[:width] for line in text.splitlines()[:n])


def _bad_param(v: Any, depth: int = 0) -> str | None:
    """Why a workload parameter value is unusable (None if it is fine): plain numbers, words,
    booleans and short lists of them only."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return None if abs(v) <= MAX_INT else "integers are at most 2**53 in size"
    if isinstance(v, float):
        return None if abs(v) < float("inf") else "numbers must be finite"
    if isinstance(v, str):
        return None if len(v) <= 256 else "words are at most 256 characters"
    if isinstance(v, list):
        if depth >= 3 or len(v) > 4096:
            return "lists are at most 4096 items, nested at most 3 deep"
        return next((w for w in (_bad_param(x, depth + 1) for x in v) if w), None)
    return f"expected a number, word, boolean or list, not a {type(v).__name__}"


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
        for k, v in wl.params.items():
            if k not in known:
                raise ConfigError(f"{source}: workload.params.{str(k)[:60]} is not a parameter of {wl.name!r}; "
                                  f"its parameters are {sorted(known)}")
            why = _bad_param(v)
            if why:
                raise ConfigError(f"{source}: workload.params.{k} = {_short(v)}: {why}")
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
