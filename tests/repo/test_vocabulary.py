"""One name per concept: the kept fraction is ``ratio`` (``density`` only a documented alias of the
ablation's axis; "block density" is the fraction of non-zero blocks), the compressor that does nothing is
``identity`` (``none`` its alias on the command line), the compression factor is the library's
``compression_factor`` / ``compression_factor_sent`` (no other quotient in the demo's table), and no text
names a round of work."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import pytest

import sparsecomm as sc

ROOT = Path(__file__).resolve().parents[2]
CLIS = ("convergence", "ablation", "demo")


def _help(name: str) -> str:
    import importlib

    mod = importlib.import_module(f"experiments.{name}")
    p = mod.parser() if hasattr(mod, "parser") else None
    if p is None:       # the demo builds its parser in main()
        with pytest.raises(SystemExit):
            mod.main(["--help"])
        return ""
    return p.format_help()


@pytest.mark.parametrize("name", CLIS)
def test_the_clis_name_the_kept_fraction_ratio(name, capsys):
    text = _help(name) or capsys.readouterr().out
    # "density" alone only as the option --density and on lines that call it the alias of ratio
    rest = "\n".join(ln for ln in text.replace("--density", "").splitlines() if "alias" not in ln)
    bare = re.findall(r"(?<!block )(?<!block-)(?<!block_)\bdensity\b", rest)
    assert not bare, (name, [ln for ln in rest.splitlines() if "density" in ln])
    if "--ratio" in text:
        assert "kept fraction" in text


def test_the_ablation_takes_density_as_the_alias_of_ratio(tmp_path):
    from experiments import ablation

    a = ablation.merge_args({}, ablation.parser().parse_args(["--compressor", "topk", "--density", "0.1"]))
    b = ablation.merge_args({}, ablation.parser().parse_args(["--compressor", "topk", "--ratio", "0.1"]))
    assert a["grid"] == b["grid"] == {"compressor": ["topk"], "ratio": [0.1]}
    old = tmp_path / "old.yaml"
    old.write_text("grid:\n  compressor: [topk]\n  transport: [allgather]\n  density: [0.1]\n")
    assert ablation.load_spec(old)["grid"] == {"compressor": ["topk"], "transport": ["allgather"], "ratio": [0.1]}
    (cell,), _ = ablation.expand(ablation.merge_args(ablation.load_spec(old), ablation.parser().parse_args([])))
    assert cell["ratio"] == 0.1 and cell["cfg"].compressor_kw == {"ratio": 0.1}


def test_no_compression_is_identity_and_none_its_alias():
    from experiments.common import config as C

    assert C.validate(C.RunConfig(compressor="none")).compressor == "identity"
    assert C.validate(C.RunConfig(compressor="none")).label == C.validate(C.RunConfig()).label
    assert "identity" in sc.compressors.available() and "none" not in sc.compressors.available()


def _public_callables():
    for name in sc.compressors.available():
        yield f"compressors {name}", sc.compressors.registry.factory(name)
    for name in sc.methods.available():
        yield f"methods {name}", sc.methods.registry.factory(name)
    yield "DistributedOptimizer", sc.DistributedOptimizer.__init__


def test_public_signatures_name_the_kept_fraction_ratio():
    """No public factory takes the kept fraction under another name."""
    other = {"density", "keep", "keep_ratio", "fraction", "k_ratio", "sparsity", "compress_ratio"}
    bad = [(who, p) for who, f in _public_callables() for p in inspect.signature(f).parameters if p in other]
    assert not bad, bad
    assert "ratio" in inspect.signature(sc.compressors.registry.factory("topk")).parameters


def test_the_demo_reports_the_librarys_compression_factor():
    text = (ROOT / "experiments" / "demo.py").read_text()
    assert "sent/declared" not in text and '"compression factor"' in text
    assert "compression_factor_sent" in text


def test_no_text_names_a_round_of_work():
    """Docstrings and docs state contracts: no "session-N" naming a round of the work"""
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    pat = re.compile(r"\bsession[- ]?\d+\b", re.IGNORECASE)
    hits = [f"{f}:{i}" for f in files if (ROOT / f).is_file()
            for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if pat.search(line)]
    assert not hits, hits
