"""What a fabric declares (:mod:`sparsecomm.fabric.base`, "Capabilities"): the layers above ask for these,
never for the class, so each fabric must declare them truthfully."""

from __future__ import annotations

import torch

import sparsecomm as sc
from sparsecomm.fabric.base import Fabric
from sparsecomm.fabric.sim.sim import SimWorld


def test_the_base_declares_a_plain_real_fabric():
    assert Fabric.modelled_time is False and Fabric.in_process_services is False and Fabric.serial_pairs is False
    assert Fabric.direct_waits is False


def test_sim_fabric_capabilities_and_scratch():
    world = SimWorld(2)
    a, b = world.fabric(0), world.fabric(1)
    assert a.modelled_time and a.in_process_services and not a.serial_pairs and not a.direct_waits
    assert a.native_group is None and a.device == torch.device("cpu")
    # scratch: one per endpoint, kept across lookups; world_scratch: one per simulated world
    a.scratch["k"] = 1
    assert a.scratch is a.scratch and "k" not in b.scratch
    a.world_scratch["k"] = 2
    assert b.world_scratch["k"] == 2 and a.world_scratch is b.world_scratch
    assert "k" not in SimWorld(2).fabric(0).world_scratch
    world.close()


def test_a_modelled_clock_is_what_transports_report():
    """``modelled_time`` decides whether a transport reports modelled seconds: on the sim, a ring allreduce
    of 1 MB over 1 Gbit/s takes a modelled time near the alpha-beta figure 2 (n-1)/n * bytes / bw."""
    def fn(ctx):
        t = sc.transports.get("ring", ctx.fabric)
        t.allreduce(torch.ones(1 << 18))
        return t.last_stats.modelled_time_s

    times = sc.launch(fn, 2, network=sc.Network(bandwidth_gbps=1.0, latency_us=0.0))
    ideal = 2 * (2 - 1) / 2 * (1 << 20) / (1e9 / 8)
    assert all(ideal * 0.99 <= t <= ideal * 1.5 for t in times), (times, ideal)


def test_the_switch_keeps_its_state_on_the_fabric_not_in_module_globals():
    import sparsecomm.transports.switchml as sw

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric)
        t.allreduce(torch.ones(64))
        return (sorted(k for k in ctx.fabric.scratch if k.startswith("switch/")),
                sorted(k for k in ctx.fabric.world_scratch if k.startswith("switch/")))

    mine, shared = sc.launch(fn, 2)[0]
    assert mine == ["switch/worker_states"] and shared == ["switch/dataplanes"]
    assert not any(type(v).__name__ == "WeakKeyDictionary" for v in vars(sw).values())


def _torch_caps(ctx):
    f = ctx.fabric
    f.scratch["k"] = ctx.rank
    return (f.modelled_time, f.in_process_services, f.serial_pairs, f.native_group is not None,
            f.world_scratch is f.scratch, f.scratch["k"], str(f.device), f.direct_waits)


def test_torch_fabric_capabilities():
    """gloo: wall time, services are launcher ranks, a native group of the workers, a scratch per rank
    (one rank per process, so the job's shared scratch is the rank's own), waits on the caller's thread."""
    got = sc.launch(_torch_caps, 2, backend="gloo", timeout_s=60)
    assert got == [(False, False, False, True, True, r, "cpu", True) for r in range(2)]
