"""experiments/reproduce_training.py: time to a held-out target per scheme on a netbed.

The end-to-end case builds a netbed (root, like tests/netbed/) and runs ``--quick`` on 2 hosts; the
others check the pieces that decide its numbers: the AUC, the CSV's columns and the merge of runs.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os
import threading
import time

import pytest
import torch

import sparsecomm as sc
from experiments import reproduce_training as T

REQUIRED = ("model", "scheme", "transport", "hosts", "gbps", "time_to_target_s", "steps_to_target", "reached",
            "bytes_per_step", "comm_fraction")


def test_auc_matches_the_pairwise_definition_with_ties():
    """AUC = P(score of a positive > score of a negative) + P(tie) / 2, counted over every pair."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 12, (300,), generator=g).double()      # many ties
    labels = torch.bernoulli(torch.full((300,), 0.4), generator=g)
    pos, neg = scores[labels.bool()], scores[~labels.bool()]
    diff = pos[:, None] - neg[None, :]
    expected = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert T.auc(scores, labels) == pytest.approx(expected, abs=1e-12)


def test_the_click_target_is_below_the_bayes_auc_and_above_chance():
    task = T.click_task(quick=True)
    assert 0.5 < task.target < task.info["bayes_auc"]
    ids, y = task.batch(0, 0)
    assert ids.shape == (256, T.FIELDS) and set(y.unique().tolist()) <= {0.0, 1.0}
    assert not torch.equal(task.batch(1, 0)[0], ids)           # every worker its own batches


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def _left_behind() -> list[int]:
    """This process's live children and grandchildren, but multiprocessing's forkserver and resource
    tracker themselves (they serve the whole test session): the ranks are the forkserver's children."""
    left = []
    for c in _children(os.getpid()):
        try:
            with open(f"/proc/{c}/cmdline") as f:
                cmd = f.read()
        except OSError:
            continue
        if "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd:
            left += _children(c)
        else:
            left.append(c)
    return left


@pytest.mark.multiprocess
@pytest.mark.netbed
def test_quick_run_on_two_netbed_hosts_trains_every_scheme(tmp_path):
    from sparsecomm.netbed import list_netbed_namespaces

    from sparsecomm.fabric.sim.sim_profile import profile_dict

    before = set(list_netbed_namespaces())
    assert _left_behind() == []
    profile = tmp_path / "host.json"      # a host with per-message costs: the switches' bursts, modelled quickly
    profile.write_text(json.dumps(profile_dict(sc.HostModel(send_message_s=1e-5, recv_message_s=1e-5),
                                               date="2026-01-01", machine={}, method={})))
    rows = T.main(["--netbed", "1", "--hosts", "2", "--quick", "--models", "emb", "--out", str(tmp_path),
                   "--no-wandb", "--no-progress", "--profile", str(profile)])
    assert set(list_netbed_namespaces()) == before, "netbed namespaces left behind"
    assert _left_behind() == [], "processes left behind"
    with open(tmp_path / "summary.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames[:len(REQUIRED)]) == REQUIRED
        table = list(reader)
    assert [r["scheme"] for r in table] == [s.name for s in T.SCHEMES]
    want = {"hook none/omnireduce": "omnireduce", "hook none/switch": "switch",
            "hook none/sparse-switch": "sparse-switch", "optimizer none/omnireduce": "omnireduce",
            "hook ef+topk": "allgather"}
    for r in table:
        assert r["hosts"] == "2" and float(r["gbps"]) == 1.0
        assert want.get(r["scheme"], r["transport"]) == r["transport"]
        assert float(r["bytes_per_step"]) > 0 and 0 <= float(r["comm_fraction"]) <= 1, r
        assert float(r["step_s"]) > 0 and math.isfinite(float(r["metric"])), r
        # (torch's hook calls torch.distributed, which the SimFabric does not run: no modelled column)
        assert (float(r["modelled_comm_s"]) > 0) == (r["scheme"] != "torch powersgd") and float(r["link_only_s"]) > 0, r
        if r["reached"] == "True":
            assert float(r["metric"]) >= float(r["target"]) and int(r["steps_to_target"]) > 0, r
        else:
            assert r["note"].startswith("stopped at step"), r
    # stock DDP's bytes are counted: gloo's ring moves 2 (n-1)/n of the gradient per link and direction
    grad = sum(p.numel() * 4 for p in T.click_task(quick=True).build().parameters())
    assert float(table[0]["bytes_per_step"]) == pytest.approx(grad, rel=1e-5)
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0
    assert (tmp_path / "time_to_target.png").stat().st_size > 0
    # the results read back as they were written, and a run of one scheme merged into them replaces its row
    back = T.load(tmp_path)
    assert [r["row"]["scheme"] for r in back] == [s.name for s in T.SCHEMES] and all(r["curve"] for r in back)
    redo = dict(back[0], row=dict(back[0]["row"], note="redone"))
    merged = T.merge(back, [redo])
    assert [r["row"]["scheme"] for r in merged] == [s.name for s in T.SCHEMES]
    assert merged[0]["row"]["note"] == "redone" and merged[1:] == back[1:]


def _result(model: str, scheme: str, curve: list, target: float, reached: bool) -> dict:
    elapsed = curve[-1][0]
    row = {"model": model, "scheme": scheme, "transport": "x", "hosts": 2, "gbps": "loopback",
           "time_to_target_s": elapsed if reached else float("nan"), "steps_to_target": curve[-1][1] if reached else "",
           "reached": reached, "bytes_per_step": 1e6, "comm_fraction": 0.5, "target": target,
           "metric": curve[-1][2], "compute_s": 0.01, "step_s": elapsed / curve[-1][1], "modelled_s": float("nan"),
           "modelled_ratio": float("nan"), "note": ""}
    return {"row": row, "curve": curve, "describe": "", "info": {}}


def test_figures_show_every_curve_and_say_when_nothing_reached(tmp_path, monkeypatch):
    """DDP and the hook's uncompressed switch train the same model in about the same time: both curves show
    (their own markers); a model on which no scheme reached the target gets a note, not a panel of hatching;
    the legends sit under the panels."""
    from tests._figures import problems

    from experiments.common import plots

    figs = {}
    real = plots.save

    def keep(fig, path, *a, **kw):
        figs[path.name] = fig
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(plots, "save", keep)
    same = [(0.5 * t, 5 * t, 0.6 + 0.02 * t) for t in range(1, 9)]
    near = [(x + 1e-4, s, m) for x, s, m in same]
    results = [_result("emb", "ddp", same, 0.7, True), _result("emb", "hook none/switch", near, 0.7, True),
               _result("emb", "hook powersgd", [(0.4 * t, 5 * t, 0.6 + 0.01 * t) for t in range(1, 9)], 0.7, False),
               _result("mlp", "ddp", [(0.3 * t, 5 * t, 0.1 * t) for t in range(1, 6)], 0.9, False),
               _result("mlp", "hook powersgd", [(0.2 * t, 5 * t, 0.09 * t) for t in range(1, 6)], 0.9, False)]
    T.figures(results, tmp_path)
    acc, ttt = figs["time_to_accuracy.png"], figs["time_to_target.png"]
    assert problems(acc) == [] and problems(ttt) == []
    lines = {ln.get_label(): ln for ln in acc.axes[0].get_lines()}
    assert lines["ddp"].get_marker() != lines["hook none/switch"].get_marker()
    acc.canvas.draw()
    for ax in acc.axes:
        assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())
    emb, mlp = ttt.axes
    assert emb.axison and len(emb.patches) == 3
    assert not mlp.axison and "no scheme reached the target" in " ".join(t.get_text() for t in mlp.texts)


# ----------------------------------------------------------------------------- the modelled column
def _tiny_task(n: int) -> T.Task:
    """One ``Linear(n, 1)`` weight (one DDP bucket of ``n`` float32), a regression on random data."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Linear(n, 1, bias=False)

    def batch(rank, t):
        g = torch.Generator().manual_seed(100 * rank + t)
        return torch.randn(4, n, generator=g), torch.randn(4, 1, generator=g)

    return T.Task("tiny", build, batch, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                  lambda m: 0.0, target=1.0, lr=0.1, momentum=0.0, max_steps=3, eval_every=1, describe="tiny")


def test_the_modelled_step_of_stock_ddp_is_gloos_ring_by_hand_and_host_costs_add_per_message():
    """Stock DDP on 2 hosts is gloo's ring over one bucket (``native``'s model, in place, no handshake: 4 segments
    of a quarter bucket, 2 per rank, two in flight): each rank sends its 2 reduce-scatter segments back to back, the
    last arrives a latency after the second's transfer; then the same for the all-gather: 4 transfers and 2
    latencies. A host model (without native rates: the library's message costs) is then the critical path: every
    rank's 4 sends, 4 takes and the sum of its 2 received segments, one after the other (each message has arrived
    before its receiver takes it). The modelled step is longer than the link-only one (the bytes at the link
    rate)."""
    from sparsecomm.fabric.sim.sim_network import TCP_OVER_ETHERNET

    n, ddp = 1000, T.SCHEMES[0]
    rate, lat = 1e9 / 8 * TCP_OVER_ETHERNET, T.modelled_network(1.0, 2, 0).latency_us * 1e-6
    plain = T.modelled_comm_s(_tiny_task(n), ddp, 2, T.modelled_network(1.0, 2, 0))
    assert plain == pytest.approx(4 * (4 * n / 4 / rate) + 2 * lat, rel=1e-9)
    send, recv, add = 50e-6, 30e-6, 1e-8
    host = sc.HostModel(send_message_s=send, recv_message_s=recv, sum_element_s={"float32": add})
    net = dataclasses.replace(T.modelled_network(1.0, 2, 0), host=host)
    costly = T.modelled_comm_s(_tiny_task(n), ddp, 2, net)
    assert costly == pytest.approx(4 * (send + recv) + n / 2 * add, rel=1e-9)
    link_only = 2 * (2 - 1) / 2 * 4 * n / rate         # the closed form's communication: bytes at the link rate
    assert costly > plain > link_only


def test_the_modelled_step_runs_the_schemes_own_calls_and_a_host_costs_more():
    """OmniReduce through the hook and through the optimizer, on the same gradient, model the same step; host
    costs lengthen it."""
    task = _tiny_task(4096)
    by_name = {s.name: s for s in T.SCHEMES}
    net = T.modelled_network(1.0, 2, 0)
    hook = T.modelled_comm_s(task, by_name["hook none/omnireduce"], 2, net)
    assert hook > 0
    assert T.modelled_comm_s(task, by_name["optimizer none/omnireduce"], 2, net) == pytest.approx(hook, rel=1e-9)
    host = sc.HostModel(send_message_s=20e-6, recv_message_s=20e-6, scan_element_s=1e-9)
    assert T.modelled_comm_s(task, by_name["hook none/omnireduce"], 2,
                             dataclasses.replace(net, host=host)) > hook


def test_the_modelled_step_leaves_ddps_copies_to_its_measured_step_and_charges_the_optimizers_gather():
    """torch's reducer's copies of every gradient into its bucket and back into ``.grad`` are in DDP's measured step
    (``ddp_compute_*``, which the modelled step of a scheme under DDP adds): a hook scheme and stock DDP are charged no
    copy at ``copy_byte_s`` but their transport's own (PowerSGD's ``native``: one of the bucket); the optimizer is
    charged its own gather of the gradient into its bucket (``p.grad`` then views the average: no copy back); at a
    share of the cores of 2 each copy costs twice as much."""
    n, rate = 4096, 1e-9
    task = _tiny_task(n)
    by_name = {s.name: s for s in T.SCHEMES}
    net = T.modelled_network(1.0, 2, 0)
    for share in (1.0, 2.0):
        for name, copies in (("ddp", 0), ("hook none/omnireduce", 0), ("hook powersgd", 0), ("hook ef+topk", 0),
                             ("optimizer none/omnireduce", 1)):
            base = dataclasses.replace(net, host=sc.HostModel(cpu_share=share))
            copying = dataclasses.replace(net, host=sc.HostModel(copy_byte_s=rate, cpu_share=share))
            extra = T.modelled_comm_s(task, by_name[name], 2, copying) - T.modelled_comm_s(task, by_name[name], 2,
                                                                                         base)
            own = 1 if name == "hook powersgd" else 0     # (its transport's own copy of the bucket: native's)
            assert extra == pytest.approx((copies + own) * 4 * n * rate * share, rel=1e-9), (name, share)


def test_the_modelled_step_waits_for_the_last_worker_after_its_compute_and_less_after_a_short_encode():
    """On shared cores a call waits ``sync_s * (share - 1)`` for its last worker, scaled by the work since the
    previous call (``sync_work_s``): the step's compute is declared before its calls, so a scheme with one call a
    step (the optimizer's OmniReduce) waits all of it, as with ``sync_work_s`` unset, to the bit; declared as none,
    its call counts only the previous step's work and waits less. PowerSGD's calls a step (its P's and its Q's
    all-reduce) wait all of it at the first only: its step is shorter than with every call waiting all of it."""
    task = _tiny_task(4096)
    by_name = {s.name: s for s in T.SCHEMES}
    net = T.modelled_network(1.0, 2, 0)
    sync, work, compute = 2e-3, 4e-3, 20e-3
    full = dataclasses.replace(net, host=sc.HostModel(send_message_s=1e-5, recv_message_s=1e-5,
                                                      elementwise_element_s=1e-9, sync_s=sync, cpu_share=2.0))
    scaled = dataclasses.replace(net, host=dataclasses.replace(full.host, sync_work_s=work))
    one = by_name["optimizer none/omnireduce"]
    assert T.modelled_comm_s(task, one, 2, scaled, compute_s=compute).hex() == \
        T.modelled_comm_s(task, one, 2, full, compute_s=compute).hex()
    assert T.modelled_comm_s(task, one, 2, scaled, compute_s=0.0) < T.modelled_comm_s(task, one, 2, full,
                                                                                      compute_s=0.0) - sync / 2
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 1, bias=False))

    def batch(rank, t):
        g = torch.Generator().manual_seed(100 * rank + t)
        return torch.randn(4, 64, generator=g), torch.randn(4, 1, generator=g)

    mlp = T.Task("tiny2", build, batch, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), lambda m: 0.0,
                 target=1.0, lr=0.1, momentum=0.0, max_steps=3, eval_every=1, describe="tiny2")
    four = by_name["hook powersgd"]
    each, less = (T.modelled_comm_s(mlp, four, 2, full, compute_s=compute),
                  T.modelled_comm_s(mlp, four, 2, scaled, compute_s=compute))
    assert each - 3 * sync < less < each - sync / 2


def test_the_modelled_step_under_ddp_is_the_same_whatever_the_threads_timing():
    """The communication thread's charges of the last bucket's call are on the clock before the training thread
    reads the step's end, in every run (10 runs, each the same)."""
    task = _tiny_task(1 << 14)
    net = dataclasses.replace(T.modelled_network(1.0, 2, 0),
                              host=sc.HostModel(copy_byte_s=1e-9, elementwise_element_s=1e-9, kernel_call_s=1e-5,
                                                send_message_s=1e-5, recv_message_s=1e-5))
    by_name = {s.name: s for s in T.SCHEMES}
    for name in ("ddp", "hook ef+topk"):
        got = {T.modelled_comm_s(task, by_name[name], 2, net) for _ in range(10)}
        assert len(got) == 1, (name, sorted(got))


def test_the_modelled_network_takes_the_profile_and_shares_the_cores(tmp_path):
    from sparsecomm.fabric.sim.sim_network import TCP_OVER_ETHERNET
    from sparsecomm.fabric.sim.sim_profile import profile_dict

    plain = T.modelled_network(1.0, 4, 1)
    assert plain.host is None and plain.bandwidth_gbps == 1.0 and plain.payload_fraction == TCP_OVER_ETHERNET
    path = tmp_path / "host.json"
    host = sc.HostModel(send_message_s=1e-5, call_s={"native": 2e-3, "omnireduce": 5e-3})
    path.write_text(json.dumps(profile_dict(host, date="2026-01-01", machine={}, method={})))
    net = T.modelled_network(1.0, 4, 1, str(path))
    assert net.host.send_message_s == 1e-5 and net.latency_us == plain.latency_us
    assert net.host.call_s == {"native": 2e-3, "omnireduce": 5e-3}      # (native's model charges native's own)
    assert net.host.cpu_share == max(1.0, 5 / (os.cpu_count() or 1))


def test_the_modelled_network_counts_the_services_that_share_the_workers_cores():
    """A scheme's services share the cores in its model; on pinned ranks the sparse switch's does not (it
    computes only while the workers wait), the switch's still does."""
    schemes = {s.name: s for s in T.SCHEMES}
    assert schemes["hook none/switch"].sharing_services() == schemes["hook none/switch"].sharing_services(True) == 1
    assert schemes["hook none/sparse-switch"].sharing_services() == 1
    assert schemes["hook none/sparse-switch"].sharing_services(True) == 0
    assert schemes["ddp"].sharing_services(True) == 0 and schemes["hook none/omnireduce"].sharing_services() == 0


def test_ddp_buckets_are_stock_ddps_steady_layout():
    """From the last layer: a first bucket closed once past 1 MiB (the MLP's 4 MiB hidden matrix), then the rest."""
    model = T.digits_task(quick=False).build()
    fc1, fc2, fc3 = model[0], model[2], model[4]
    want = [[fc3.bias, fc3.weight, fc2.bias, fc2.weight], [fc1.bias, fc1.weight]]
    assert [[id(p) for p in b] for b in T.ddp_buckets(model)] == [[id(p) for p in b] for b in want]


def test_a_profile_is_checked_before_anything_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(T, "run_schemes", lambda *a, **k: pytest.fail("trained before checking --profile"))
    with pytest.raises(SystemExit):
        T.main(["--quick", "--profile", str(tmp_path / "host.json"), "--out", str(tmp_path), "--no-wandb"])
    assert "needs --netbed" in capsys.readouterr().err
    bad = tmp_path / "host.json"
    bad.write_text("{}")
    with pytest.raises(sc.errors.InvalidValueError, match="host.json"):
        T.main(["--netbed", "1", "--quick", "--profile", str(bad), "--out", str(tmp_path), "--no-wandb"])


def test_remodel_recomputes_the_modelled_columns_of_a_recorded_run_without_training(tmp_path, monkeypatch, capsys):
    """By hand, with a modelled step of 10 ms per host (hosts x 5 ms): a reached hook row of 80 steps and 11 ms of
    DDP's step with no communication (the workers' largest mean, the default; their median 9 ms; the plain step's
    4 ms is not its) on 2 hosts models 80 x (0.011 + 0.010) = 1.68 s, 0.6 of its 2.8 s; a row that stopped at step
    30 (its curve's last) after 1.5 s models 30 x (0.002 + 0.010) = 0.36 s; the optimizer's row adds the plain step:
    80 x (0.004 + 0.010) = 1.12 s; torch's hook and a loopback row keep their NaN; nothing trains, and the recorded
    folder is not written."""
    rec = tmp_path / "rec"
    rec.mkdir()
    base = {k: "" for k in T.COLUMNS} | {"model": "mlp", "transport": "native", "bytes_per_step": "1", "seed": "0",
                                         "comm_fraction": "0.5", "target": "0.95", "metric": "0.9", "step_s": "0.03",
                                         "modelled_s": "nan", "modelled_ratio": "nan", "link_only_s": "nan",
                                         "link_only_ratio": "nan", "modelled_comm_s": "nan", "note": ""}
    rows = [base | {"scheme": "hook powersgd", "hosts": "2", "gbps": "1", "time_to_target_s": "2.8",
                    "steps_to_target": "80", "reached": "True", "compute_s": "0.003", "compute_mean_s": "0.004",
                    "compute_max_s": "0.005", "ddp_compute_s": "0.009", "ddp_compute_mean_s": "0.011",
                    "ddp_compute_max_s": "0.013"},
            base | {"scheme": "hook ef+topk", "hosts": "2", "gbps": "1", "time_to_target_s": "nan",
                    "steps_to_target": "", "reached": "False", "compute_s": "0.001",
                    "compute_mean_s": "0.0015", "compute_max_s": "0.003", "ddp_compute_s": "0.001",
                    "ddp_compute_mean_s": "0.002", "ddp_compute_max_s": "0.003"},
            base | {"scheme": "optimizer none/omnireduce", "hosts": "2", "gbps": "1", "time_to_target_s": "2.8",
                    "steps_to_target": "80", "reached": "True", "compute_s": "0.003", "compute_mean_s": "0.004",
                    "compute_max_s": "0.005", "ddp_compute_s": "0.009", "ddp_compute_mean_s": "0.011",
                    "ddp_compute_max_s": "0.013"},
            base | {"scheme": "torch powersgd", "hosts": "2", "gbps": "1", "time_to_target_s": "3.0",
                    "steps_to_target": "80", "reached": "True", "compute_s": "0.011"},
            base | {"scheme": "ddp", "hosts": "2", "gbps": "loopback", "time_to_target_s": "1.0",
                    "steps_to_target": "80", "reached": "True", "compute_s": "0.011"}]
    with open(rec / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=T.COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(rec / "curves.csv", "w", newline="") as f:
        f.write("model,scheme,elapsed_s,step,metric,seed\nmlp,hook ef+topk,0.7,10,0.5,0\nmlp,hook ef+topk,1.5,30,0.9,0\n")
    monkeypatch.setattr(T, "run_schemes", lambda *a, **k: pytest.fail("--remodel trained"))
    monkeypatch.setattr(T, "modelled_comm_s", lambda task, scheme, hosts, net, compute_s: hosts * 0.005)
    got = T.main(["--remodel", str(rec), "--netbed", "1", "--out", str(tmp_path / "out"), "--no-wandb"])
    assert got[0]["modelled_s"] == pytest.approx(1.68) and got[0]["modelled_ratio"] == pytest.approx(0.6)
    assert got[1]["modelled_s"] == pytest.approx(0.36) and got[1]["modelled_ratio"] == pytest.approx(0.24)
    assert got[2]["modelled_s"] == pytest.approx(1.12) and got[2]["modelled_ratio"] == pytest.approx(0.4)
    assert all(math.isnan(r["modelled_s"]) for r in got[3:])
    assert sorted(p.name for p in rec.iterdir()) == ["curves.csv", "summary.csv"]
    assert (tmp_path / "out" / "remodelled.csv").exists() and "1.68" in capsys.readouterr().out


def test_the_compute_statistics_are_the_largest_median_the_largest_mean_and_the_mean_slowest_step():
    """Two workers' steps (started together): medians 2 and 1, means 4 and 5/3, each step's slowest 3, 2 and 9."""
    got = T.compute_stats([[1.0, 2.0, 9.0], [3.0, 1.0, 1.0]])
    assert got == {"compute_s": 2.0, "compute_mean_s": 4.0, "compute_max_s": pytest.approx(14 / 3)}


def test_remodel_adds_the_compute_statistic_asked_for_and_refuses_a_run_recorded_without_it(tmp_path, monkeypatch):
    """``--compute compute_max_s``: a hook's row adds DDP's, 80 steps x (0.015 + 0.010) = 2.0 s; a row recorded before
    the columns existed (empty) is refused with its name, by default too (``ddp_compute_mean_s``), ``--compute
    compute_s`` as well (DDP's step was not measured: train it again); the optimizer's row of such a run is
    modelled with ``--compute compute_s``, its plain step's."""
    rec = tmp_path / "rec"
    rec.mkdir()
    base = {k: "" for k in T.COLUMNS} | {"model": "mlp", "transport": "native", "bytes_per_step": "1", "seed": "0",
                                         "comm_fraction": "0.5", "target": "0.95", "metric": "0.96", "step_s": "0.03",
                                         "modelled_s": "nan", "modelled_ratio": "nan", "link_only_s": "nan",
                                         "link_only_ratio": "nan", "modelled_comm_s": "nan", "note": "",
                                         "scheme": "hook powersgd", "hosts": "2", "gbps": "1",
                                         "time_to_target_s": "2.5", "steps_to_target": "80", "reached": "True",
                                         "compute_s": "0.011"}
    with open(rec / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=T.COLUMNS)
        w.writeheader()
        w.writerow(base | {"compute_mean_s": "0.004", "compute_max_s": "0.005", "ddp_compute_s": "0.011",
                           "ddp_compute_mean_s": "0.012", "ddp_compute_max_s": "0.015"})
    (rec / "curves.csv").write_text("model,scheme,elapsed_s,step,metric,seed\n")
    declared = []         # (the compute the model declares before each step's calls: the statistic asked for)
    monkeypatch.setattr(T, "modelled_comm_s",
                        lambda task, scheme, hosts, net, compute_s: declared.append(compute_s) or hosts * 0.005)
    got = T.main(["--remodel", str(rec), "--compute", "compute_max_s", "--out", str(tmp_path / "out"),
                  "--no-wandb"])
    assert got[0]["modelled_s"] == pytest.approx(2.0) and got[0]["modelled_ratio"] == pytest.approx(0.8)
    assert declared == [0.015]
    with open(rec / "summary.csv", "w", newline="") as f:
        older = T.COLUMNS[:T.COLUMNS.index("compute_mean_s")]          # (an older run's columns)
        w = csv.DictWriter(f, fieldnames=older)
        w.writeheader()
        w.writerow({k: base[k] for k in older})
    with pytest.raises(ValueError, match="'hook powersgd' has no ddp_compute_max_s"):
        T.main(["--remodel", str(rec), "--compute", "compute_max_s", "--out", str(tmp_path / "out"), "--no-wandb"])
    with pytest.raises(ValueError, match="'hook powersgd' has no ddp_compute_mean_s"):   # (the default's column)
        T.main(["--remodel", str(rec), "--out", str(tmp_path / "out"), "--no-wandb"])
    with pytest.raises(ValueError, match="'hook powersgd' has no ddp_compute_s .*train it again"):
        T.main(["--remodel", str(rec), "--compute", "compute_s", "--out", str(tmp_path / "out"), "--no-wandb"])
    with open(rec / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=older)
        w.writeheader()
        w.writerow({k: base[k] for k in older} | {"scheme": "optimizer none/omnireduce"})
    got = T.main(["--remodel", str(rec), "--compute", "compute_s", "--out", str(tmp_path / "out"), "--no-wandb"])
    assert got[0]["modelled_s"] == pytest.approx(80 * 0.021) and declared == [0.015, 0.011]


def _torch_hook_worker(ctx, steps: int) -> dict:
    """``steps`` steps of the full-width MLP (DDP's two buckets) through torch's ``powerSGD_hook`` as the
    ``torch powersgd`` scheme runs it."""
    torch.set_num_threads(1)
    task = T.digits_task(quick=False)
    model = task.build()
    net = torch.nn.parallel.DistributedDataParallel(model)
    scheme = {s.name: s for s in T.SCHEMES}["torch powersgd"]
    hook = T.TorchPowerSGD(net, None, **scheme.options)
    opt = task.optimizer(model)
    sent = []
    for t in range(steps):
        opt.zero_grad()
        task.loss(net, task.batch(ctx.rank, t)).backward()
        opt.step()
        sent.append(hook.last_stats.bytes_sent)
    return {"sent": sent, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiprocess
def test_torchs_powersgd_scheme_runs_torchs_hook_in_one_order_and_counts_what_it_sends():
    """torch's hook on the MLP's two DDP buckets over gloo, bucket after bucket: the replicas stay identical
    over compressed steps, and the bytes are the whole gradient before ``start_powerSGD_iter``, then per
    matrix (n + m) r values and the biases whole, at gloo's ring volume (1 at 2 workers)."""
    steps = T.TORCH_POWERSGD_START + 4
    r0, r1 = sc.launch(functools.partial(_torch_hook_worker, steps=steps), 2, backend="gloo", timeout_s=300)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    model = T.digits_task(quick=False).build()
    full = sum(p.numel() for p in model.parameters()) * 4
    r = T.POWERSGD_RANK
    low = sum((p.shape[0] + p.shape[1]) * r if p.dim() == 2 else p.numel() for p in model.parameters()) * 4
    assert r0["sent"] == [full] * T.TORCH_POWERSGD_START + [low] * (steps - T.TORCH_POWERSGD_START)


def test_the_breakdown_table_sums_the_phases_and_leaves_the_remainder(tmp_path):
    """The table's remainder is the step less compute and the library's phases; the CSV has the same numbers, and
    the CPU times beside them (NaN for a result recorded without them)."""
    parts = {"compute_s": 0.010, "step_s": 0.030, "encode_s": 0.004, "transport_s": 0.006, "wait_s": 0.002,
             "decode_s": 0.003, "step_cpu_s": 0.012, "compute_cpu_s": 0.005, "transport_cpu_s": 0.0025}
    older = {k: v for k, v in parts.items() if "cpu" not in k}
    res = [{"row": {"model": "mlp", "scheme": "hook powersgd", "seed": 0}, "breakdown": parts},
           {"row": {"model": "mlp", "scheme": "ddp", "seed": 0}, "breakdown": older}]
    text = T.breakdown_table(res, tmp_path / "b.csv")
    assert "hook powersgd" in text and "transport_cpu" in text
    with open(tmp_path / "b.csv", newline="") as f:
        row, old = list(csv.DictReader(f))
    assert float(row["remainder_ms"]) == pytest.approx(7.0) and float(row["wait_ms"]) == pytest.approx(2.0)
    assert [float(row[f"{k}_ms"]) for k in ("step_cpu", "compute_cpu", "transport_cpu")] == pytest.approx([12, 5, 2.5])
    assert float(old["remainder_ms"]) == pytest.approx(7.0) and math.isnan(float(old["transport_cpu_ms"]))


@pytest.mark.multiprocess
def test_a_quick_loopback_run_breaks_the_step_down_for_ours_and_torchs_powersgd(tmp_path):
    """``--breakdown`` on 2 gloo processes: our hook's step has encode, transport and decode time recorded on its
    timelines (one file per worker); torch's hook makes no library call (its time is all remainder); torch's
    scheme is named, counted and reaches the quick target."""
    schemes = tuple(s for s in T.SCHEMES if s.name in ("hook powersgd", "torch powersgd"))
    out = T.run_schemes("mlp", schemes, 2, None, True, 60.0, 300.0, breakdown=str(tmp_path))
    by = {r["row"]["scheme"]: r for r in out}
    ours, theirs = by["hook powersgd"]["breakdown"], by["torch powersgd"]["breakdown"]
    assert ours["encode_s"] > 0 and ours["transport_s"] > 0 and ours["decode_s"] > 0
    assert ours["step_s"] > 0 and ours["compute_s"] > 0
    assert 0 < ours["step_cpu_s"] and 0 < ours["compute_cpu_s"] and ours["transport_cpu_s"] >= 0
    assert theirs["encode_s"] == theirs["transport_s"] == theirs["decode_s"] == theirs["transport_cpu_s"] == 0
    assert theirs["step_s"] > 0 and theirs["step_cpu_s"] > 0
    assert by["torch powersgd"]["row"]["transport"] == "native (gloo ring)" and by["torch powersgd"]["row"]["reached"]
    assert 0 < by["torch powersgd"]["row"]["bytes_per_step"] < 340_008       # below the dense gradient's
    assert math.isnan(by["torch powersgd"]["row"]["modelled_s"])
    for row in (by["hook powersgd"]["row"], by["torch powersgd"]["row"]):   # (DDP's own step, no communication)
        assert 0 < row["ddp_compute_s"] <= row["ddp_compute_max_s"] < 1 and 0 < row["ddp_compute_mean_s"] < 1
        assert row["ddp_compute_mean_s"] != row["compute_mean_s"]
    for r in range(2):
        assert (tmp_path / f"mlp_hook_powersgd.rank{r}.json").stat().st_size > 0


def test_the_modelled_workers_start_from_the_weights_the_task_builds_whatever_the_threads_scheduling():
    """The simulated workers are threads of one process; a task's ``build`` seeds torch's global generator and
    draws from it. Here it pauses in between, so that the workers' builds overlap: each worker still trains the
    weights one build gives alone (and so all the same ones)."""
    n = 64
    tiny = _tiny_task(n)
    seen, lock = [], threading.Lock()

    def build():
        torch.manual_seed(0)
        time.sleep(0.2)             # (the other worker seeds meanwhile)
        return torch.nn.Linear(n, 1, bias=False)

    def loss(m, b):
        with lock:
            seen.append(m.weight.detach().clone())
        return tiny.loss(m, b)

    task = dataclasses.replace(tiny, build=build, loss=loss)
    T.modelled_comm_s(task, T.SCHEMES[0], 2, T.modelled_network(1.0, 2, 0), steps=1)
    want = build().weight.detach()
    assert len(seen) == 2 and all(torch.equal(w, want) for w in seen)
