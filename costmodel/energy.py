"""Energy of a simulated schedule.

Model: every *used* device draws ``active_power`` while it computes and ``idle_power`` for the
rest of the makespan (a device in the plan stays powered until the plan ends; unused devices are
not charged, they can run something else). Communication adds ``energy_per_byte`` of the link it
crosses for every byte moved (NVLink inside a node, the NIC across nodes); the power a device
draws while only copying is taken as idle power plus that per-byte energy.

    E = sum_{d used} [ P_active * busy_compute[d] + P_idle * (makespan - busy_compute[d]) ]
        + sum_{transfers t} bytes[t] * energy_per_byte[t]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .hardware import DeviceSpec, Hardware

__all__ = ["EnergyBreakdown", "energy_breakdown", "energy_joules", "schedule_energy"]


class EnergyBreakdown(NamedTuple):
    compute: float  # J, active power over compute time
    idle: float  # J, idle power over the rest of the makespan on used devices
    transfer: float  # J, per-byte link energy

    @property
    def total(self) -> float:
        return self.compute + self.idle + self.transfer


def energy_breakdown(makespan: float, busy_compute, used, device: DeviceSpec,
                     transfer_bytes=0.0, energy_per_byte=0.0) -> EnergyBreakdown:
    """Energy split into compute / idle / transfer (joules).

    ``busy_compute``: float[n_devices] compute-busy seconds; ``used``: bool[n_devices];
    ``transfer_bytes`` and ``energy_per_byte``: per-transfer arrays (or scalars) that broadcast,
    e.g. ``alloc_bytes[kind == 1]`` and ``hw.link_energy_per_byte(dev[t], dst[t])``.
    """
    busy = np.asarray(busy_compute, dtype=np.float64)
    u = np.asarray(used, dtype=bool)
    if busy.shape != u.shape:
        raise ValueError(f"busy_compute shape {busy.shape} != used shape {u.shape}")
    makespan = float(makespan)
    b = np.minimum(busy[u], makespan)  # a device cannot compute longer than the schedule
    e_compute = float(device.active_power * b.sum())
    e_idle = float(device.idle_power * (makespan - b).sum())
    e_transfer = float(np.sum(np.asarray(transfer_bytes, dtype=np.float64)
                              * np.asarray(energy_per_byte, dtype=np.float64)))
    return EnergyBreakdown(e_compute, e_idle, e_transfer)


def energy_joules(makespan: float, busy_compute, used, device: DeviceSpec,
                  transfer_bytes=0.0, energy_per_byte=0.0) -> float:
    """Total energy in joules (see :func:`energy_breakdown`)."""
    return energy_breakdown(makespan, busy_compute, used, device, transfer_bytes, energy_per_byte).total


def schedule_energy(schedule, hw: Hardware, kind, dev, dst, alloc_bytes) -> EnergyBreakdown:
    """Energy of a :class:`costmodel.simulate.Schedule` on ``hw`` given the simulator's input
    arrays (transfer bytes = ``alloc_bytes`` of transfer nodes, link chosen by node of src/dst)."""
    k = np.asarray(kind)
    t = k == 1
    src = np.asarray(dev)[t]
    tgt = np.asarray(dst)[t]
    nbytes = np.asarray(alloc_bytes, dtype=np.float64)[t]
    epb = hw.link_energy_per_byte(src, tgt) if nbytes.size else np.zeros(0)
    return energy_breakdown(schedule.makespan, schedule.busy_compute, schedule.used, hw.device, nbytes, epb)
