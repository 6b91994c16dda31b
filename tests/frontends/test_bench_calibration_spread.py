"""experiments.bench.calibration_spread: max/min per host constant over calibrations."""

import json
import math

import pytest

from experiments.bench.calibration_spread import constants, main, ratio, spread


def _profile(**host):
    return {"host": {k: {"value": v, "unit": "s"} for k, v in host.items()}}


def test_spread_is_max_over_min_per_constant_and_table_entry():
    a = _profile(send_message_s=2e-5, call_s={"ring": 1e-3, "native": 0.0}, fresh_min_bytes=1 << 25)
    b = _profile(send_message_s=6e-5, call_s={"ring": 2e-3, "native": 1e-4}, fresh_min_bytes=1 << 25)
    c = _profile(send_message_s=4e-5, call_s={"ring": 1.5e-3, "native": 0.0})
    assert constants(a) == {"send_message_s": 2e-5, "call_s.ring": 1e-3, "call_s.native": 0.0,
                            "fresh_min_bytes": float(1 << 25)}
    got = spread([a, b, c])
    assert got["send_message_s"] == (pytest.approx(3.0), [2e-5, 6e-5, 4e-5])
    assert got["call_s.ring"][0] == pytest.approx(2.0)
    assert math.isinf(got["call_s.native"][0])                      # (0 in one run, not in another)
    assert got["fresh_min_bytes"] == (1.0, [float(1 << 25)] * 2 + [None])
    assert ratio([0.0, 0.0]) == 1.0


def test_profiles_are_compared_without_running_anything(tmp_path, capsys):
    paths = []
    for i, v in enumerate((1e-5, 3e-5)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(_profile(switch_message_s=v)))
    assert main(["--profiles", *map(str, paths)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["switch_message_s", "3.00"]
