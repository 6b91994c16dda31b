"""experiments.bench.cast_pair: the fp16 / bf16 pair's rows, measured interleaved, per call."""

from experiments.bench.cast_pair import main, measure


def test_measure_calls_every_row_rounds_times_block_in_alternating_order():
    seen = []
    fns = {"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}
    res = measure(fns, rounds=3, block=2)
    # one warm-up call each, then rounds a a b b | b b a a | a a b b
    assert seen == ["a", "b"] + list("aabb") + list("bbaa") + list("aabb")
    for walls, cpus, faults, sys_s in res.values():
        assert len(walls) == len(cpus) == 6 and faults >= 0 and sys_s >= 0


def test_every_row_is_printed_for_both_casts(capsys):
    assert main(["--n", "5000", "--rounds", "2", "--block", "1", "--torch-threads", "1"]) == 0
    out = capsys.readouterr().out
    for cast, dt in (("fp16", "float16"), ("bf16", "bfloat16")):
        block = out.split(f"# {cast}: n = 5,000")[1].split("\n# medians:")[0]
        names = [ln[:34].strip() for ln in block.splitlines()[3:]]
        assert names[:3] == ["compress", "decompress", "pair"], names
        assert names[-1] == f"torch x.to({dt}).to(float32)"
        rows = block.splitlines()[3:]
        assert all(len(r[34:].split()) == 5 for r in rows)
        if len(names) > 4:          # the kernel rows, where the cast has its fused kernels
            assert "kernels, preallocated" in names and "kernels, numpy buffers" in names
    assert out.count("# medians: pair - (compress + decompress)") == 2
