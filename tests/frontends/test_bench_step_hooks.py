"""experiments.bench.step's ``hooks`` case: every pair it prints compares two configurations it runs."""

from experiments.bench.step import HOOK_PAIRS, _hook_configs


def test_every_hook_pair_names_configurations_the_case_builds():
    names = [name for name, _ in _hook_configs()]
    assert len(names) == len(set(names))
    for ours, baseline in HOOK_PAIRS:
        assert ours in names and baseline in names, (ours, baseline)
    # torch's own allreduce_hook is measured against DDP's built-in all-reduce, and ours against it
    assert ("torch allreduce_hook", "ddp") in HOOK_PAIRS and ("sc none", "torch allreduce_hook") in HOOK_PAIRS
